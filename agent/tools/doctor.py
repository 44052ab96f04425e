"""Checks behind ``sysdra doctor``. Each returns :class:`Finding` s; none raises.

A finding says what is wrong *and* how to fix it. Levels: ``ok``, ``warn`` (works
but risky), ``fail`` (broken: doctor exits non-zero), ``skip`` (not applicable).
"""

from __future__ import annotations

import email.utils
import os
import socket
import stat
import threading
import time
from typing import Callable

from agent.tools.doctor_files import check_cdi_dirs, check_checkpoint, check_metadata
from agent.tools.findings import Finding, ok

MAX_CLOCK_SKEW = 5.0  # seconds; certificates and leases tolerate little more
API_DEADLINE = 15.0  # seconds for each question to the API server: httpx's timeout is per read, and a
# server or proxy that trickles its answer would hold doctor for as long as it trickles


# --- kubelet directories and sockets ------------------------------------------------------
def check_dir(check: str, path: str, fix: str) -> Finding:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return Finding(check, "fail", f"{path} does not exist", fix)
    except OSError as err:
        return Finding(check, "fail", f"{path}: {err.strerror}", "run sysdra doctor as root")
    if not stat.S_ISDIR(st.st_mode):
        return Finding(check, "fail", f"{path} is not a directory", f"remove {path}; {fix}")
    return ok(check, f"{path} exists")


def check_socket(check: str, path: str, fix: str) -> Finding:
    """Exists, is a socket, and something accepts connections on it."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return Finding(check, "fail", f"{path} does not exist", fix)
    if not stat.S_ISSOCK(st.st_mode):
        return Finding(check, "fail", f"{path} is not a socket ({_kind(st.st_mode)})",
                       f"remove {path} (nothing but the agent should create it), then restart the agent")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect(path)
    except ConnectionRefusedError:
        return Finding(check, "fail", f"{path} is a stale socket: nobody listens", fix)
    except OSError as err:
        return Finding(check, "fail", f"cannot connect to {path}: {err.strerror or err}", "run sysdra doctor as root")
    finally:
        s.close()
    return ok(check, f"{path} is served")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symlink"), (stat.S_ISFIFO, "FIFO")):
        if test(mode):
            return name
    return "special file"


def check_kubelet(settings) -> list[Finding]:
    start = "start the agent: systemctl start sysdra (journalctl -u sysdra shows why it is not up)"
    found = [
        check_dir("kubelet", settings.kubelet_dir, "is the kubelet installed with this --root-dir? pass --kubelet-dir"),
        check_dir("kubelet", settings.registry_dir, "the kubelet creates it on start; check the kubelet is running (systemctl status kubelet)"),
        check_dir("kubelet", settings.plugin_dir, start),
    ]
    dra, reg = _socket_paths(settings)
    found.append(check_socket("dra-socket", dra, start))
    found.append(check_socket("registration-socket", reg, start))
    return found


def _socket_paths(settings) -> tuple[str, str]:
    try:
        from agent.kubeletplugin.sockets import dra_socket_path, registration_socket_path

        return dra_socket_path(settings), registration_socket_path(settings)
    except ImportError:  # kubelet plugin not built in: the plain names
        return (os.path.join(settings.plugin_dir, "dra.sock"),
                os.path.join(settings.registry_dir, f"{settings.driver_name}-reg.sock"))


# --- registration (from the running agent) -------------------------------------------------
def check_registration(status_socket: str, query: Callable[[str], dict] | None = None) -> list[Finding]:
    from agent.service.status import AgentNotRunning, query_status

    try:
        status = (query or query_status)(status_socket)
    except AgentNotRunning as err:
        return [Finding("registration", "fail", str(err), "systemctl start sysdra; journalctl -u sysdra -n 50")]
    reg = status.get("registration") or {}
    state = reg.get("state")
    found = []
    if state == "registered":
        found.append(ok("registration", "the kubelet registered the plugin"))
    elif state == "failed":
        found.append(Finding("registration", "fail", f"the kubelet rejected the registration: {reg.get('error')}",
                             "check the kubelet's log (journalctl -u kubelet | grep -i dra) and that DRA is enabled"))
    else:
        found.append(Finding("registration", "warn", f"registration state {state!r}: the kubelet has not confirmed it",
                             "check the kubelet is running and uses the same --root-dir as --kubelet-dir"))
    err = status.get("lastError")
    if err:
        found.append(Finding("agent", "warn", f"last error ({err.get('where')}): {err.get('message')}", "see journalctl -u sysdra"))
    return found


# --- API server ------------------------------------------------------------------------------
# (verb, group, resource) the agent uses: publish/kubestore.py, claims.py and statusbackends.py
# (status.devices by server-side apply: the synthetic resourceclaims/driver subresource is
# asked for the driver name, with the verb for a claim allocated to the token's own node)
API_PERMISSIONS = (
    ("list", "resource.k8s.io", "resourceslices"),
    ("watch", "resource.k8s.io", "resourceslices"),
    ("create", "resource.k8s.io", "resourceslices"),
    ("update", "resource.k8s.io", "resourceslices"),
    ("delete", "resource.k8s.io", "resourceslices"),
    ("get", "resource.k8s.io", "resourceclaims"),
    ("patch", "resource.k8s.io", "resourceclaims/status"),
    ("associated-node:patch", "resource.k8s.io", "resourceclaims/driver"),
    ("get", "", "nodes"),
)
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"  # set from a token's node claim (KEP-4193)
SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"
# with nvidia_mps_pod, in its namespace: the MPS daemons' pods (prepare/mps_pods.py)
MPS_POD_PERMISSIONS = tuple((verb, "", "pods") for verb in ("get", "list", "create", "delete"))


def check_api(cluster: str, node_name: str, review: Callable[..., tuple[bool, str | None]] | None = None,
              now: Callable[[], float] = time.time, driver_name: str = "sysdra.io",
              mps_namespace: str | None = None, whoami: Callable[[], dict] | None = None) -> list[Finding]:
    """``review(verb, group, resource, name[, namespace]) -> (allowed, server Date header)``;
    ``whoami() -> userInfo`` (``username``, ``extra``); the defaults ask the API server through
    lightkube (SelfSubjectAccessReviews, a SelfSubjectReview).
    ``mps_namespace``: where the MPS daemons' pods are made (``nvidia_mps_pod``)."""
    if cluster.startswith("dir:"):
        return [Finding("api", "skip", f"--cluster {cluster}: offline cluster directory, no API server to check")]
    try:
        if review is None or whoami is None:
            default_review, default_whoami = _lightkube_api()
            review, whoami = review or default_review, whoami or default_whoami
        allowed_first, date = review(*API_PERMISSIONS[0], None)
    except Exception as err:  # noqa: BLE001 - any failure here means "not reachable"
        return [Finding("api", "fail", f"API server not reachable: {type(err).__name__}: {str(err)[:200]}",
                        "check KUBECONFIG (/etc/sysdra/kubeconfig for the service), the server address and the network")]
    found = [ok("api", "API server reachable")]
    denied = []
    try:
        for i, (verb, group, resource) in enumerate(API_PERMISSIONS):
            name = {"nodes": node_name, "resourceclaims/driver": driver_name}.get(resource)
            if not (allowed_first if i == 0 else review(verb, group, resource, name)[0]):
                denied.append(f"{verb} {resource}")
    except Exception as err:  # noqa: BLE001 - reachable a moment ago: say what failed
        return found + [Finding("rbac", "fail", f"the API server stopped answering: {type(err).__name__}: {str(err)[:200]}",
                                "see the API server's log and what lies between (a proxy, a load balancer)")]
    if denied:
        found.append(Finding("rbac", "fail", "not allowed: " + ", ".join(denied),
                             "apply deploy/rbac.yaml (ClusterRole sysdra) and bind it to the agent's identity"))
    else:
        found.append(ok("rbac", "can list/watch/create/update/delete ResourceSlices, get ResourceClaims and "
                                  "Nodes, patch claim status for its driver"))
    found.append(_ask_identity(whoami, node_name))
    if mps_namespace:
        found.append(_check_mps_pods(review, mps_namespace))
    found.append(check_clock(date, now()))
    return found


def _ask_identity(whoami: Callable[[], dict], node_name: str) -> Finding:
    try:
        user = whoami()
    except Exception as err:  # noqa: BLE001 - reachable a moment ago: say what failed, check the rest
        return Finding("identity", "warn", f"could not ask the API server who we are (SelfSubjectReview): "
                                           f"{type(err).__name__}: {str(err)[:200]}", "see the API server's log")
    return check_identity(user, node_name)


def check_identity(user: dict, node_name: str) -> Finding:
    """RBAC passes for any credential of the agent's ServiceAccount, but the API server lets a
    client write claim status (``associated-node:patch`` on resourceclaims/driver) only as a
    ServiceAccount whose token is bound to exactly the claim's node (its node-name extra), and
    deploy/admission-policy.yaml checks the same extra for ResourceSlice writes
    (docs/cluster-integration.md). A Secret-based token or a client certificate has none."""
    name = user.get("username") or "(anonymous)"
    nodes = list((user.get("extra") or {}).get(NODE_NAME_EXTRA) or [])
    if name.startswith(SERVICE_ACCOUNT_PREFIX) and nodes == [node_name]:
        return ok("identity", f"{name}, its token bound to node {node_name}")
    if not name.startswith(SERVICE_ACCOUNT_PREFIX):
        why = f"the agent's identity {name} is not a ServiceAccount"
    elif not nodes:
        why = f"the token of {name} is bound to no node ({NODE_NAME_EXTRA} missing)"
    else:
        why = f"the token of {name} is bound to node {', '.join(nodes)}, not to this node {node_name}"
    return Finding("identity", "fail", f"{why}: the API server refuses the agent's claim status writes (status.devices) "
                                       "and, where deploy/admission-policy.yaml is installed, its ResourceSlice writes",
                   f"give the agent a token of ServiceAccount sysdra bound to this node: kubectl create token sysdra "
                   f"-n sysdra --bound-object-kind Node --bound-object-name {node_name} --duration 168h, into the "
                   "kubeconfig's tokenFile (docs/operations.md, \"Credentials\"); the DaemonSet's pod token has it")


def _check_mps_pods(review: Callable[..., tuple[bool, str | None]], namespace: str) -> Finding:
    denied = [f"{verb} pods" for verb, group, resource in MPS_POD_PERMISSIONS
              if not review(verb, group, resource, None, namespace)[0]]
    if denied:
        return Finding("rbac-mps", "fail", f"in namespace {namespace}, not allowed: {', '.join(denied)}: an MPS share's "
                                           "claim fails, its daemon's pod cannot be made",
                       "install the chart with nvidia.mps (its Role <release>-mps), or bind such a Role to the agent")
    return ok("rbac-mps", f"can get/list/create/delete the MPS daemons' pods in namespace {namespace}")


def check_clock(date_header: str | None, local: float) -> Finding:
    if not date_header:
        return Finding("clock", "skip", "the API server sent no Date header")
    try:
        server = email.utils.parsedate_to_datetime(date_header).timestamp()
    except (TypeError, ValueError):
        return Finding("clock", "warn", f"unparsable Date header {date_header!r}")
    skew = local - server
    if abs(skew) > MAX_CLOCK_SKEW:
        return Finding("clock", "fail", f"local clock is {skew:+.0f}s off the API server's",
                       "enable time sync (timedatectl set-ntp true; chronyc tracking)")
    return ok("clock", f"within {MAX_CLOCK_SKEW:g}s of the API server")


def _lightkube_api():
    """(review, whoami) on one lightkube client."""
    from lightkube import Client
    from lightkube.models.authorization_v1 import ResourceAttributes, SelfSubjectAccessReviewSpec
    from lightkube.resources.authentication_v1 import SelfSubjectReview
    from lightkube.resources.authorization_v1 import SelfSubjectAccessReview

    client = Client(timeout=10.0)
    generic = client._client  # the public create() hides the response headers we need for the clock

    @_within

    def review(verb: str, group: str, resource: str, name: str | None, namespace: str | None = None) -> tuple[bool, str | None]:
        resource, _, subresource = resource.partition("/")
        ssar = SelfSubjectAccessReview(spec=SelfSubjectAccessReviewSpec(resourceAttributes=ResourceAttributes(
            verb=verb, group=group, resource=resource, subresource=subresource or None, name=name, namespace=namespace)))
        request = generic.prepare_request("post", res=SelfSubjectAccessReview, obj=ssar)
        response = generic.send(generic.build_adapter_request(request))
        result = generic.handle_response("post", response, request)
        return bool(result.status and result.status.allowed), response.headers.get("date")

    @_within
    def whoami() -> dict:
        status = client.create(SelfSubjectReview()).status
        user = status.userInfo if status else None
        return {"username": user.username, "extra": user.extra or {}} if user else {}

    return review, whoami


def _within(ask: Callable) -> Callable:
    """``ask`` answered within API_DEADLINE, else TimeoutError (its thread is left to end with
    the command: a daemon thread)."""
    def bounded(*args):
        box: dict = {}

        def run():
            try:
                box["answer"] = ask(*args)
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                box["error"] = err
        thread = threading.Thread(target=run, name="doctor-api", daemon=True)
        thread.start()
        thread.join(API_DEADLINE)
        if thread.is_alive():
            raise TimeoutError(f"no whole answer within {API_DEADLINE:g} s")
        if "error" in box:
            raise box["error"]
        return box["answer"]
    return bounded


def check_nvidia_driver(root: str, driver_root: str) -> list[Finding]:
    """Whether a container given an NVIDIA GPU here could run CUDA (docs/nvidia.md)."""
    from discovery.nvidia import kernel_module_version
    from discovery.nvidia_driver import find_driver_files
    from discovery.sysfs import HostFS

    if kernel_module_version(HostFS(root)) is None:
        return [Finding("nvidia", "skip", "no nvidia kernel module loaded")]
    files = find_driver_files(root, driver_root)
    fix = "set nvidia_driver_root to where the driver is installed, or install the user-space driver of the module's version"
    found = [Finding("nvidia", "fail", err, fix) for err in files.errors]
    found += [Finding("nvidia", "warn", w, fix) for w in files.warnings]
    if not files.errors:
        found.append(Finding("nvidia", "ok", f"user-space driver {files.version} under {driver_root}: "
                             f"{len(files.libraries)} libraries, {len(files.binaries)} tools, "
                             f"{_loader(files)}"))
    return found


def _loader(files) -> str:
    """How the spec lets the loader find the driver, and whether it enables CUDA forward compatibility."""
    if not files.cdi_hook:
        return "LD_LIBRARY_PATH (no CUDA forward compatibility: no nvidia-cdi-hook)"
    if not files.cuda_compat:
        return "ld-cache hook (no CUDA forward compatibility: its nvidia-cdi-hook has no enable-cuda-compat, toolkit < v1.17.5)"
    return "ld-cache hook, CUDA forward compatibility"


def check_nvml(root: str, driver_root: str, enabled: bool = True) -> list[Finding]:
    """Whether NVML answers here, as the agent's GPU facts, dynamic MIG and XID/ECC health need."""
    from discovery.nvidia import kernel_module_version
    from discovery.nvml import Nvml
    from discovery.sysfs import HostFS

    if kernel_module_version(HostFS(root)) is None:
        return []  # no NVIDIA GPU driver: check_nvidia_driver says so
    without = "GPU facts come from the PCI ID table; no dynamic MIG, no XID/ECC health events"
    if not enabled:
        return [Finding("nvml", "skip", f"nvml: false: {without}")]
    nvml, why = Nvml.probe(root, driver_root)
    if nvml is None:
        return [Finding("nvml", "warn", f"NVML: {why}: {without}",
                        "point nvidia_driver_root at the driver; in a container, give it the GPUs' device nodes")]
    count = nvml.call("counting GPUs", nvml.pynvml.nvmlDeviceGetCount)
    version = nvml.call("the driver version", nvml.pynvml.nvmlSystemGetDriverVersion)
    if count is None or version is None:
        return [Finding("nvml", "warn", f"NVML started but did not answer ({nvml.failed}): {without}",
                        "check the GPUs' state (nvidia-smi) and the driver's log (dmesg)")]
    return [Finding("nvml", "ok", f"NVML of driver {version} answers for {count} GPU(s)")]


# --- everything ---------------------------------------------------------------------------------
def run_all(settings, status_socket: str, cdi_dirs: list[str], api: bool = True,
            containerd_config: str | None = None) -> list[Finding]:
    from agent.service.status import AgentNotRunning, query_status
    from agent.tools.doctor_crio import check_crio
    from agent.tools.doctor_ipam import check_ipam
    from agent.tools.doctor_mig import check_mig
    from agent.tools.doctor_runtime import check_containerd, check_gpu_faults, check_nri

    try:  # asked once: registration and NRI read the same document
        status: dict | AgentNotRunning = query_status(status_socket)
    except AgentNotRunning as err:
        status = err

    def answer(_path: str) -> dict:
        if isinstance(status, AgentNotRunning):
            raise status
        return status

    found = check_kubelet(settings)
    found += check_registration(status_socket, answer)
    found += check_nri(status if isinstance(status, dict) else None)
    found += check_containerd(settings.root, settings.nri_socket, settings.cdi_dir, containerd_config)
    found += check_crio(settings.root, settings.nri_socket, settings.cdi_dir)
    found += check_ipam(settings)
    found += check_gpu_faults(settings.plugin_dir, settings.root)
    found += check_cdi_dirs(cdi_dirs)
    found += check_metadata(settings.plugin_dir)
    found += check_checkpoint(settings.plugin_dir)
    found += check_nvidia_driver(settings.root, settings.nvidia_driver_root)
    found += check_nvml(settings.root, settings.nvidia_driver_root, settings.nvml)
    found += check_mig(settings)
    if api:
        found += check_api(settings.cluster, settings.node_name, driver_name=settings.driver_name,
                           mps_namespace=settings.nvidia_mps_pod.namespace if settings.nvidia_mps_pod else None)
    return found
