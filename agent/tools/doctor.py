"""Checks behind ``sysdra doctor``. Each returns :class:`Finding` s; none raises.

A finding says what is wrong *and* how to fix it. Levels: ``ok``, ``warn`` (works
but risky), ``fail`` (broken: doctor exits non-zero), ``skip`` (not applicable).
"""

from __future__ import annotations

import email.utils
import json
import os
import socket
import stat
import time
from dataclasses import dataclass
from typing import Callable

import yaml

import cdi

SCHEMA_DIR = os.path.join(os.path.dirname(os.path.abspath(cdi.__file__)), "schema")
MAX_CLOCK_SKEW = 5.0  # seconds; certificates and leases tolerate little more


@dataclass(frozen=True)
class Finding:
    check: str
    level: str  # ok | warn | fail | skip
    message: str
    fix: str = ""


def ok(check: str, message: str) -> Finding:
    return Finding(check, "ok", message)


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


# --- CDI specs --------------------------------------------------------------------------------
def _schema_validator():
    """A jsonschema validator for the vendored CDI schema, or None without jsonschema."""
    try:
        import jsonschema
        from referencing import Registry, Resource
    except ImportError:
        return None
    try:
        with open(os.path.join(SCHEMA_DIR, "schema.json"), encoding="utf-8") as f:
            schema = json.load(f)
        with open(os.path.join(SCHEMA_DIR, "defs.json"), encoding="utf-8") as f:
            defs = json.load(f)
    except OSError:  # an install without the package data: structural checks only
        return None
    registry = Registry().with_resource("defs.json", Resource.from_contents(defs, default_specification=_draft7()))
    return jsonschema.Draft7Validator(schema, registry=registry)


def _draft7():
    from referencing.jsonschema import DRAFT7

    return DRAFT7


def _structural_errors(spec: object) -> list[str]:
    """The schema's required shape, for machines without jsonschema."""
    if not isinstance(spec, dict):
        return ["top level is not an object"]
    errors = [f"missing required field {k!r}" for k in ("cdiVersion", "kind", "devices") if k not in spec]
    devices = spec.get("devices")
    if "devices" in spec and not isinstance(devices, list):
        errors.append("devices is not a list")
    for i, d in enumerate(devices if isinstance(devices, list) else []):
        if not isinstance(d, dict) or "name" not in d or "containerEdits" not in d:
            errors.append(f"devices[{i}] needs name and containerEdits")
    return errors


def _load_spec(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return json.loads(text) if path.endswith(".json") else yaml.safe_load(text)


def _version_key(v: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in v.removeprefix("v").split("."))
    except ValueError:
        return ()


def check_cdi_spec(path: str, validator=None) -> tuple[list[Finding], dict | None]:
    """Parse, schema, runtime strictness, minimum version; returns findings and the spec."""
    check = f"cdi:{path}"
    try:
        spec = _load_spec(path)
    except (OSError, ValueError, yaml.YAMLError) as err:
        return [Finding(check, "fail", f"does not parse: {str(err).splitlines()[0]}",
                        "the runtime ignores the file (or fails every container using it): fix or remove it")], None
    if validator is not None:
        errors = [f"{'/'.join(map(str, e.absolute_path)) or 'spec'}: {e.message}" for e in validator.iter_errors(spec)]
    else:
        errors = _structural_errors(spec)
    if errors:
        return [Finding(check, "fail", "violates the CDI schema: " + "; ".join(errors[:3]), "regenerate the spec with its tool")], None
    found: list[Finding] = []
    try:
        from cdi.spec import SpecError, minimum_version, validate
    except ImportError:
        return [Finding(check, "warn", "parses and matches the schema; minimum-version rule not available in this build")], spec
    try:
        validate(spec)
    except SpecError as err:
        msg = str(err)
        fix = ("lower cdiVersion to what the content needs (older runtimes reject newer versions) or remove the newer fields"
               if "below" not in msg else "raise cdiVersion: the content uses newer fields")
        return [Finding(check, "fail", f"a container runtime rejects it: {msg}", fix)], spec
    need, have = minimum_version(spec), str(spec.get("cdiVersion")).removeprefix("v")
    if _version_key(have) > _version_key(need):
        found.append(Finding(check, "warn", f"cdiVersion {have} but the content needs only {need}",
                             f"write cdiVersion {need}: runtimes older than {have} refuse the file"))
    else:
        found.append(ok(check, f"valid, cdiVersion {have}, {len(spec.get('devices') or [])} devices"))
    return found, spec


def check_cdi_dirs(dirs: list[str]) -> list[Finding]:
    validator = _schema_validator()
    found: list[Finding] = []
    if validator is None:
        found.append(Finding("cdi", "warn", "jsonschema or the vendored schema (cdi/schema) missing: structural checks only", "pip install jsonschema"))
    seen: dict[str, str] = {}  # qualified device -> file that defines it
    for d in dirs:
        if not os.path.isdir(d):
            found.append(Finding("cdi", "skip" if d == "/etc/cdi" else "warn", f"{d} does not exist",
                                 "" if d == "/etc/cdi" else "systemd-tmpfiles --create /etc/tmpfiles.d/sysdra.conf"))
            continue
        names = sorted(n for n in os.listdir(d) if n.endswith((".json", ".yaml")) and not n.startswith("."))
        for name in names:
            path = os.path.join(d, name)
            spec_findings, spec = check_cdi_spec(path, validator)
            found.extend(spec_findings)
            for dev in (spec or {}).get("devices") or []:
                qualified = f"{spec.get('kind')}={dev.get('name')}"
                if qualified in seen:
                    found.append(Finding(f"cdi:{path}", "fail", f"device {qualified} is also defined in {seen[qualified]}",
                                         "the runtime refuses conflicting devices: remove the stale file"))
                seen.setdefault(qualified, path)
                for node in (dev.get("containerEdits") or {}).get("deviceNodes") or []:
                    host = node.get("hostPath") or node.get("path")
                    if host and not os.path.exists(host):
                        found.append(Finding(f"cdi:{path}", "warn", f"device {qualified}: {host} does not exist on this host",
                                             "a container using it fails to start; the device is gone or the spec is stale"))
        if not names:
            found.append(ok("cdi", f"{d}: no specs"))
    return found


# --- KEP-5304 metadata files ------------------------------------------------------------------
def parse_json_stream(text: str) -> list:
    decoder, pos, out = json.JSONDecoder(), 0, []
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return out
        obj, pos = decoder.raw_decode(text, pos)
        out.append(obj)


def check_metadata(plugin_dir: str) -> list[Finding]:
    top = os.path.join(plugin_dir, "dra-device-metadata")
    if not os.path.isdir(top):
        return [Finding("metadata", "skip", f"{top} does not exist (no claims prepared with device metadata)")]
    found: list[Finding] = []
    count = 0
    for dirpath, _, files in os.walk(top):
        for name in files:
            if name != "metadata.json":
                continue
            path = os.path.join(dirpath, name)
            count += 1
            try:
                objs = parse_json_stream(open(path, encoding="utf-8").read())
            except (OSError, ValueError) as err:
                found.append(Finding(f"metadata:{path}", "fail", f"not a complete JSON stream: {err}",
                                     "the agent rewrites it on the next prepare; unprepare/prepare the claim or delete the pod"))
                continue
            bad = [o for o in objs if not (isinstance(o, dict) and o.get("kind") == "DeviceMetadata"
                                           and str(o.get("apiVersion", "")).startswith("metadata.resource.k8s.io/")
                                           and isinstance(o.get("requests"), list))]
            if not objs or bad:
                found.append(Finding(f"metadata:{path}", "fail", "empty or not DeviceMetadata objects",
                                     "remove the file; the agent writes it on prepare"))
            elif stat.S_IMODE(os.stat(path).st_mode) & 0o004 == 0:
                found.append(Finding(f"metadata:{path}", "warn", "not world-readable", f"chmod 0644 {path}"))
    if count and not found:
        found.append(ok("metadata", f"{count} metadata files are complete"))
    elif not count:
        found.append(ok("metadata", "no metadata files"))
    return found


def check_checkpoint(plugin_dir: str) -> list[Finding]:
    """The record of prepared claims loads (read-only: nothing is moved or repaired here),
    and no corrupt one was moved aside and forgotten."""
    from agent.prepare.checkpoint import STARTED, Checkpoint, CheckpointError

    path = os.path.join(plugin_dir, "checkpoint.json")
    found: list[Finding] = []
    try:
        aside = sorted(n for n in os.listdir(plugin_dir) if n.startswith("checkpoint.json") and ".corrupt-" in n)
    except OSError:
        aside = []
    if aside:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(int(aside[-1].rsplit("-", 1)[1]))) \
            if aside[-1].rsplit("-", 1)[1].isdigit() else "?"
        found.append(Finding("checkpoint:aside", "warn",
                             f"a corrupt checkpoint was moved aside (last at {when}): {', '.join(aside)}",
                             f"inspect them (the agent adopted the claims it found CDI specs for), then remove them from {plugin_dir}"))
    if not os.path.exists(path) and not os.path.exists(path + ".journal"):
        return found + [Finding("checkpoint", "skip", f"{path} does not exist (no claim prepared yet)")]
    try:
        cp = Checkpoint.load(path, move_corrupt=False)
    except CheckpointError as err:
        return found + [Finding("checkpoint", "fail", str(err), "run the sysdra version that wrote it")]
    except (OSError, ValueError, RecursionError) as err:
        return found + [Finding("checkpoint", "fail", f"does not load: {err}",
                                "restart the agent: it moves the files aside, logs CHECKPOINT CORRUPT and "
                                "adopts the claims whose CDI specs exist")]
    started = [u for u, e in cp.claims.items() if e.get("state") == STARTED]
    found.append(ok("checkpoint", f"{len(cp.claims)} claims recorded ({len(started)} being prepared), "
                                  f"generation {cp.generation}, {cp.journal_records} journal records"))
    return found


# --- API server ------------------------------------------------------------------------------
# (verb, group, resource, namespaced) the agent uses: publish/kubestore.py and claims.py
API_PERMISSIONS = (
    ("list", "resource.k8s.io", "resourceslices"),
    ("watch", "resource.k8s.io", "resourceslices"),
    ("create", "resource.k8s.io", "resourceslices"),
    ("update", "resource.k8s.io", "resourceslices"),
    ("delete", "resource.k8s.io", "resourceslices"),
    ("get", "resource.k8s.io", "resourceclaims"),
    ("get", "", "nodes"),
)


def check_api(cluster: str, node_name: str, review: Callable[[str, str, str, str | None], tuple[bool, str | None]] | None = None,
              now: Callable[[], float] = time.time) -> list[Finding]:
    """``review(verb, group, resource, name) -> (allowed, server Date header)``; the
    default asks the API server with SelfSubjectAccessReviews through lightkube."""
    if cluster.startswith("dir:"):
        return [Finding("api", "skip", f"--cluster {cluster}: offline cluster directory, no API server to check")]
    try:
        review = review or _lightkube_review()
        allowed_first, date = review(*API_PERMISSIONS[0], None)
    except Exception as err:  # noqa: BLE001 - any failure here means "not reachable"
        return [Finding("api", "fail", f"API server not reachable: {type(err).__name__}: {str(err)[:200]}",
                        "check KUBECONFIG (/etc/sysdra/kubeconfig for the service), the server address and the network")]
    found = [ok("api", "API server reachable")]
    denied = []
    for i, (verb, group, resource) in enumerate(API_PERMISSIONS):
        allowed = allowed_first if i == 0 else review(verb, group, resource, node_name if resource == "nodes" else None)[0]
        if not allowed:
            denied.append(f"{verb} {resource}")
    if denied:
        found.append(Finding("rbac", "fail", "not allowed: " + ", ".join(denied),
                             "apply deploy/rbac.yaml (ClusterRole sysdra) and bind it to the agent's identity"))
    else:
        found.append(ok("rbac", "can list/watch/create/update/delete ResourceSlices, get ResourceClaims and Nodes"))
    found.append(check_clock(date, now()))
    return found


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


def _lightkube_review():
    from lightkube import Client
    from lightkube.models.authorization_v1 import ResourceAttributes, SelfSubjectAccessReviewSpec
    from lightkube.resources.authorization_v1 import SelfSubjectAccessReview

    client = Client(timeout=10.0)
    generic = client._client  # the public create() hides the response headers we need for the clock

    def review(verb: str, group: str, resource: str, name: str | None) -> tuple[bool, str | None]:
        ssar = SelfSubjectAccessReview(spec=SelfSubjectAccessReviewSpec(
            resourceAttributes=ResourceAttributes(verb=verb, group=group, resource=resource, name=name)))
        request = generic.prepare_request("post", res=SelfSubjectAccessReview, obj=ssar)
        response = generic.send(generic.build_adapter_request(request))
        result = generic.handle_response("post", response, request)
        return bool(result.status and result.status.allowed), response.headers.get("date")

    return review


# --- everything ---------------------------------------------------------------------------------
def run_all(settings, status_socket: str, cdi_dirs: list[str], api: bool = True) -> list[Finding]:
    found = check_kubelet(settings)
    found += check_registration(status_socket)
    found += check_cdi_dirs(cdi_dirs)
    found += check_metadata(settings.plugin_dir)
    found += check_checkpoint(settings.plugin_dir)
    if api:
        found += check_api(settings.cluster, settings.node_name)
    return found
