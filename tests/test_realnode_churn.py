"""Churn on the real node (tests/realnode.py): many pods at once with GPU shares (``--share gpu``,
the GPU's MPS daemon), GPUs taken whole by one share of all their compute, and pods without
claims; some with an init container and a second container; some deleted while still starting.
In the middle of each round one of the node's processes goes: the agent SIGKILLed and started
again, containerd restarted, the kubelet restarted. A sampler reads the checkpoint all along.

At the end, every pod deleted: each container that ran saw its claim's devices, no GPU was ever
prepared beyond its compute, the checkpoint is empty, no CDI spec, metadata file, MPS daemon or
mount of a claim is left, the slices are as before, the agent's log has no traceback and no
ERROR the test did not cause. Root only; a few minutes on two cores.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from collections import defaultdict
from fractions import Fraction

import pytest

from tests.controlplane import peer
from tests.realnode import DRIVER, RealNode
from tests.realnode_leftovers import HostState
from tests.realnode_pods import METADATA, module_node, namespace, wait

pytestmark = [pytest.mark.slow, pytest.mark.root]

SHARE = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu-share.sysdra.io"}}]}}
WHOLE = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu-share.sysdra.io",
                                                              "capacity": {"requests": {"compute": "100"}}}}]}}  # fmt: skip
NIC = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "nic.sysdra.io"}}]}}  # (the claim's name in the pods)
SEES = ("env | grep -E '^(SYSDRA_DEVICES|SYSDRA_CLAIM_UID|CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)=' | sort; ls /dev | grep '^nvidia[0-9]'; ls /sys/class/net | grep -x gpu; "
        f"cat {METADATA}/resourceclaimtemplates/gpu/gpu/{DRIVER}-metadata.json 2>/dev/null | tr -d ' \\n' | grep -o '\"uid\":\"[^\"]*\"'")


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    yield from module_node(tmp_path_factory, "churn")


def plugin_dir(node: RealNode) -> str:
    return os.path.join(node.kubelet_dir, "plugins", DRIVER)


def checkpoint(node: RealNode) -> dict:
    from agent.prepare.checkpoint import Checkpoint

    return Checkpoint.load(os.path.join(plugin_dir(node), "checkpoint.json"), move_corrupt=False).claims


class Sampler(threading.Thread):
    """Reads the checkpoint over and over: a GPU whose prepared shares consume more than its
    compute at one moment is an overcommit (the scheduler never allocates that)."""

    def __init__(self, node: RealNode):
        super().__init__(daemon=True)
        self.node, self.done, self.over, self.samples = node, threading.Event(), [], 0

    def run(self) -> None:
        while not self.done.wait(0.2):
            try:
                claims = checkpoint(self.node)
            except Exception:  # noqa: BLE001 - a file replaced mid-read: the next sample
                continue
            self.samples += 1
            compute: dict[str, Fraction] = defaultdict(Fraction)
            for entry in claims.values():
                for d in entry.get("devices") or ():
                    consumed = (d.get("consumedCapacity") or {}).get("compute")
                    compute[d["device"]] += Fraction(consumed) if consumed is not None else Fraction(100)
            self.over += [(dev, c, sorted(claims)) for dev, c in compute.items() if c > 100]


def churn_pod(node: RealNode, ns: str, name: str, spec: dict | None, *, init: bool = False, second: bool = False) -> None:
    """A pod with a claim from ``spec`` (none: no claim) used by its app container, and maybe an
    init container and a second container holding the claim too. A NIC's pod has a network
    namespace of its own, where the NRI plugin moves the netdev (named as the request), and requires
    the plugin (containerd's validator refuses its containers while the agent is not registered:
    docs/networking.md)."""
    claims = [{"name": "gpu", "resourceClaimTemplateName": template(node, ns, spec)}] if spec else []
    uses = {"resources": {"claims": [{"name": "gpu"}]}} if spec else {}

    def container(cname: str, end: str) -> dict:
        return {"name": cname, "image": node.image, "imagePullPolicy": "Never", "command": ["sh", "-c", f"{SEES}; echo END{end}"], **uses}

    containers = [container("app", "; exec sleep 3600")] + ([container("second", "; exec sleep 3600")] if second else [])
    meta = {"name": name, "namespace": ns}
    if spec is NIC:
        meta["annotations"] = {"required-plugins.noderesource.dev/pod": '["sysdra"]'}
    node.plane.create({"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                       "spec": {"automountServiceAccountToken": False, "hostNetwork": spec is not NIC, "terminationGracePeriodSeconds": 1,
                                "resourceClaims": claims, "containers": containers,
                                "initContainers": [container("init", "")] if init else []}})  # fmt: skip


def template(node: RealNode, ns: str, spec: dict) -> str:
    name = {id(WHOLE): "whole", id(SHARE): "share", id(NIC): "nic"}[id(spec)]
    if not any(t["metadata"]["name"] == name for t in node.plane.list("ResourceClaimTemplate", ns)):
        node.plane.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                           "metadata": {"name": name, "namespace": ns}, "spec": {"spec": spec}})  # fmt: skip
    return name


def many(node: RealNode, ns: str, prefix: str, count: int, nics: int = 0) -> list[str]:
    """``count`` pods created at once, kinds in turn: a share, a whole GPU, none, a share with an
    init container and a second container; then ``nics`` pods with a NIC each."""
    names = []
    for i in range(count):
        kind = i % 4
        name = f"{prefix}-{i}"
        churn_pod(node, ns, name, (SHARE, WHOLE, None, SHARE)[kind], init=kind == 3, second=kind == 3)
        names.append(name)
    for i in range(nics):
        churn_pod(node, ns, f"{prefix}-nic{i}", NIC, second=i % 2 == 1)
        names.append(f"{prefix}-nic{i}")
    return names


def settled(node: RealNode, ns: str) -> bool:
    """No pod terminating, and the checkpoint holds the claims of the pods there are: no unprepare
    under way."""
    pods = node.plane.list("Pod", ns)
    held = {c["metadata"]["uid"] for c in node.plane.list("ResourceClaim", ns)
            if any(r["name"] in {p["metadata"]["name"] for p in pods} for r in c["status"].get("reservedFor") or ())}  # fmt: skip
    return not any(p["metadata"].get("deletionTimestamp") for p in pods) and set(checkpoint(node)) == held


def nics_gone(node: RealNode, ns: str, netdevs: list[str]) -> None:
    """The NICs' pods deleted, once no unprepare runs (the agent running): their netdevs back on the
    host. (A StopPodSandbox that waits past its 1.5 s for the serialize lock an unprepare holds, an
    MPS daemon's stop, say, leaves the netdev in the namespace the runtime then destroys: a veth
    dies with it, where a NIC function comes back to the host and is renamed by the 10 s look.)"""
    from agent.prepare import rtnl

    wait(lambda: settled(node, ns), "no unprepare under way", node, log="agent")
    delete(node, ns, [p["metadata"]["name"] for p in node.plane.list("Pod", ns) if "-nic" in p["metadata"]["name"]])
    wait(lambda: not [p for p in node.plane.list("Pod", ns) if "-nic" in p["metadata"]["name"]], "the NICs' pods gone", node)
    wait(lambda: all(rtnl.has_link("/proc/self/ns/net", n) for n in netdevs), "every netdev back on the host", node,
         log="agent")  # fmt: skip


@pytest.fixture
def netdevs(node):
    """A veth under each fixture NIC's interface name, on the host (tests/test_realnode.py's
    nic_netdevs): the NRI plugin moves the claimed one into its pod and back."""
    from discovery.inventory import scan

    names = [d.nic.interfaces[0].name for d in scan(node.root).devices if d.nic and d.nic.interfaces]
    for i, name in enumerate(names):
        subprocess.run(["ip", "link", "add", name, "type", "veth", "peer", "name", f"sdrch{i}"], check=True)
    yield names
    for name in names:
        subprocess.run(["ip", "link", "del", name], check=False)


def delete(node: RealNode, ns: str, names: list[str]) -> None:
    for name in names:
        node.plane.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{name}", ok=False)


def container_log(node: RealNode, ns: str, pod: str, container: str) -> list[str] | None:
    r = node.plane.request("GET", f"/api/v1/namespaces/{ns}/pods/{pod}/log", params={"container": container}, ok=False)
    return r.text.splitlines() if r.status_code == 200 else None


def saw_its_devices(node: RealNode, ns: str, names: list[str]) -> None:
    """Each pod runs; each of its containers' log (once its script ended) names its claim's UID
    and device and shows that GPU's device node (and no claim where the pod has none)."""
    from discovery.inventory import scan

    nodes = {d.name: {n.path for n in d.device_nodes} for d in scan(node.root).devices}
    for name in names:
        wait(lambda: node.plane.get("Pod", name, ns)["status"].get("phase") == "Running", f"pod {ns}/{name} running", node,
             timeout=180)  # fmt: skip
        pod = node.plane.get("Pod", name, ns)
        claim = None
        if pod["spec"].get("resourceClaims"):
            (st,) = pod["status"]["resourceClaimStatuses"]
            claim = node.plane.get("ResourceClaim", st["resourceClaimName"], ns)
        for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:
            lines = wait(lambda: (got := container_log(node, ns, name, c["name"])) and any(x.startswith("END") for x in got) and got,
                         f"{ns}/{name}/{c['name']}'s log", node)  # fmt: skip
            if claim is None:
                assert not [x for x in lines if x.startswith("SYSDRA_") or x.startswith("nvidia")], (name, c["name"], lines)
                continue
            (result,) = claim["status"]["allocation"]["devices"]["results"]
            assert f"SYSDRA_CLAIM_UID={claim['metadata']['uid']}" in lines, (name, c["name"], lines)
            assert f"SYSDRA_DEVICES={result['device']}" in lines, (name, c["name"], lines)
            assert f'"uid":"{claim["metadata"]["uid"]}"' in lines, (name, c["name"], lines)  # its KEP-5304 metadata
            if result["device"].startswith("nic-"):
                assert "gpu" in lines, (name, c["name"], lines)  # the netdev in the pod, as its request
                continue
            gpu_nodes = {p.rsplit("/", 1)[1] for p in nodes[result["device"]] if re.fullmatch(r"/dev/nvidia\d+", p)}
            assert gpu_nodes == {x for x in lines if re.fullmatch(r"nvidia\d+", x)}, (name, c["name"], lines)
            compute = result["consumedCapacity"]["compute"]
            assert f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={compute}" in lines, (name, c["name"], lines)


def gone(node: RealNode, ns: str) -> bool:
    return not node.plane.list("Pod", ns)


def restart_agent(node: RealNode, crash_at: str = "") -> None:
    """The agent stopped and started again as the chart's ``nvidia.mps`` runs it; ``crash_at``: it
    SIGKILLs itself there (``SYSDRA_TEST_CRASH_AT``)."""
    node.stop_process("agent")
    node.start_agent("--share", "gpu", propagation="shared", env={"SYSDRA_TEST_CRASH_AT": crash_at} if crash_at else None)


def crashed(node: RealNode, point: str, then: str = "") -> None:
    """Waits for the agent to die at ``point``; starts it again without the hook (``then``: with
    the hook at that point, where the start's recovery dies, and once more without)."""
    proc = node.procs["agent"]
    wait(lambda: proc.poll() is not None, f"the agent killed at {point}", node, log="agent")
    assert proc.returncode == -signal.SIGKILL, node.log_tail("agent")
    if then:
        node.start_agent("--share", "gpu", propagation="shared", env={"SYSDRA_TEST_CRASH_AT": then}, wait=False)
        crashed(node, then)
    else:
        restart_agent(node)


def start_containerd(node: RealNode) -> None:
    node._start_containerd({n: peer(n) for n in ("containerd", "ctr", "containerd-shim-runc-v2")}, 120)


def mps_leftovers(node: RealNode) -> list[str]:
    """MPS shm mounts in the node's namespace and the simulated daemons still running."""
    out = subprocess.run([*node.enter, "cat", "/proc/self/mountinfo"], capture_output=True, text=True, check=True).stdout
    mounts = [line.split()[4] for line in out.splitlines() if f"/plugins/{DRIVER}/mps/" in line.split()[4]]
    daemons = [" ".join(p.cmdline()) for p in node.namespace_processes() if "nvidia-cuda-mps-control" in " ".join(p.cmdline())]
    return mounts + daemons


def claim_files(node: RealNode) -> list[str]:
    from agent.prepare.metadata import layout

    specs = [f for f in os.listdir(node.cdi_dir) if "claim_" in f or "_metadata_" in f]
    meta = layout.host_root(plugin_dir(node))
    metadata = [os.path.join(d, f) for d, _, fs in os.walk(meta) for f in fs] if os.path.isdir(meta) else []
    return specs + metadata


def device_views(node: RealNode) -> list:
    return sorted((d["name"], sorted(d.get("attributes", {})), sorted(d.get("capacity", {})))
                  for s in node.slices() for d in s["spec"].get("devices", []))  # fmt: skip


EXPLAINED = ()  # ERROR lines the test's doing explains: none


def test_churn_with_the_agent_containerd_and_the_kubelet_going_in_the_middle(node, netdevs):
    restart_agent(node, crash_at="prepare:specs-written")
    before = device_views(node)
    logged = len(node.log_tail("agent", 10**6).splitlines())
    sampler = Sampler(node)
    sampler.start()
    ns = namespace(node)
    try:
        # the agent killed in its first prepare (host changes and specs made, not yet completed:
        # the GPU's MPS daemon runs), then in the recovery that rolls it back, as it stops that
        # daemon; pods deleted while it is gone, more created
        a = many(node, ns, "a", 16)
        crashed(node, "prepare:specs-written", then="mps:ended")
        delete(node, ns, a[:3])
        b = many(node, ns, "b", 4)
        saw_its_devices(node, ns, a[3:] + b)

        # killed once a new GPU's MPS daemon runs, before its record says so
        restart_agent(node, crash_at="mps:launched")
        g = many(node, ns, "g", 4)
        crashed(node, "mps:launched")
        saw_its_devices(node, ns, a[3:] + b + g)
        delete(node, ns, g)

        # killed once a prepare is saved completed, before the kubelet has the answer: its retry
        # is a re-prepare
        restart_agent(node, crash_at="prepare:completed")
        p = many(node, ns, "p", 4)
        crashed(node, "prepare:completed")
        saw_its_devices(node, ns, p)
        delete(node, ns, p)

        # SIGKILLed while pods start, at no point in particular
        held = len(checkpoint(node))
        c = many(node, ns, "c", 8)
        wait(lambda: len(checkpoint(node)) >= held + 2, "claims of the new pods prepared", node, log="agent")
        node.stop_process("agent", signal.SIGKILL)
        delete(node, ns, a[3:7] + c[:1])
        restart_agent(node)
        saw_its_devices(node, ns, a[7:] + b + c[1:])

        # containerd restarted while pods start; some deleted before it is back
        # (NICs' pods go only with nics_gone)
        held = len(checkpoint(node))
        d = many(node, ns, "d", 8, nics=2)
        wait(lambda: len(checkpoint(node)) >= held + 2, "claims of the new pods prepared", node, log="agent")
        node.stop_process("containerd")
        delete(node, ns, d[:2] + c[1:3])
        start_containerd(node)
        saw_its_devices(node, ns, a[7:] + b + c[3:] + d[2:])

        # the kubelet restarted; pods deleted and created while it is down, the agent SIGKILLed
        # meanwhile and started after the kubelet
        e = many(node, ns, "e", 4, nics=1)
        node.stop_process("kubelet")
        delete(node, ns, b + d[2:5])
        node.stop_process("agent", signal.SIGKILL)
        f = many(node, ns, "f", 4, nics=1)
        node.start_kubelet()
        restart_agent(node)
        saw_its_devices(node, ns, a[7:] + c[3:] + d[5:] + e + f)
        nics_gone(node, ns, netdevs)

        # killed once a netdev's move is recorded, before it moves
        restart_agent(node, crash_at="netdev:recorded")
        h = many(node, ns, "h", 0, nics=3)
        crashed(node, "netdev:recorded")
        saw_its_devices(node, ns, h)
        nics_gone(node, ns, netdevs)

        # the agent killed once its unprepare saved the checkpoint (files and daemons still there)
        restart_agent(node, crash_at="unprepare:saved")
        delete(node, ns, a[7:] + c[3:] + d[5:])
        crashed(node, "unprepare:saved")
        # killed as a GPU's last share goes, its daemon ended, its record not yet removed
        restart_agent(node, crash_at="mps:ended")
        delete(node, ns, [p["metadata"]["name"] for p in node.plane.list("Pod", ns)])
        crashed(node, "mps:ended")
        wait(lambda: gone(node, ns), "every pod deleted", node, timeout=180)
        wait(lambda: not checkpoint(node), "the checkpoint without a claim", node, timeout=120, log="agent")
    finally:
        sampler.done.set()
        sampler.join(5)
    assert sampler.samples and not sampler.over, sampler.over
    wait(lambda: not claim_files(node), "no CDI spec or metadata file of a claim", node, log="agent")
    wait(lambda: not mps_leftovers(node), "no MPS daemon or mount left", node, log="agent")
    assert device_views(node) == before
    lines = node.log_tail("agent", 10**6).splitlines()[logged:]
    assert not [x for x in lines if "Traceback" in x], "\n".join(lines[-80:])
    errors = [x for x in lines if " ERROR " in x and not any(e in x for e in EXPLAINED)]
    assert not errors, "\n".join(errors)


def test_zz_the_node_leaves_nothing_behind_even_under_a_running_share(node):
    """Stopped with a share's pod running (a test that failed mid-way): its GPU's MPS daemon, in a
    mount namespace of its own and no longer the agent's child once the agent stops, goes too."""
    restart_agent(node)
    ns = namespace(node)
    churn_pod(node, ns, "left", SHARE)
    wait(lambda: checkpoint(node) and mps_leftovers(node), "the share's daemon running", node, log="agent")
    node.stop()
    problems = node.before.compare(HostState.take(), node_dir=node.dir, cgroup_root=node.cgroup_root)
    assert not problems, "\n".join(problems)
