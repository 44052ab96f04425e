"""CDI spec dicts: naming, minimum ``cdiVersion`` and a strict validator.

Specs are plain dicts (exactly what is serialised). ``minimum_version`` ports the
rules of the CDI library's MinimumRequiredVersion (reference
cdi-and-device-metadata.md §1.3) so we never write a version newer than the
content needs: runtimes reject versions they do not know (podman 4.3 knows <= 0.5.0).
``validate`` mirrors the runtime parser's strictness (unknown keys reject the whole
file there), so a spec we write is one the runtime accepts.
"""

from __future__ import annotations

import re

VENDOR_CLASS_RE = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
DEVICE_NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
KNOWN_VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")

# each object's fields with the JSON type the runtime's Go types (specs-go) unmarshal: another
# type rejects the whole file there (null is any field's zero value)
_SPEC_KEYS = {"cdiVersion": "str", "kind": "str", "annotations": "map", "devices": "list", "containerEdits": "obj"}
_DEVICE_KEYS = {"name": "str", "annotations": "map", "containerEdits": "obj"}
_EDIT_KEYS = {"env": "list", "deviceNodes": "list", "mounts": "list", "hooks": "list", "intelRdt": "obj",
              "additionalGids": "list", "netDevices": "list"}
_NODE_KEYS = {"path": "str", "hostPath": "str", "type": "str", "major": "int", "minor": "int", "fileMode": "int",
              "permissions": "str", "uid": "int", "gid": "int"}
_MOUNT_KEYS = {"hostPath": "str", "containerPath": "str", "options": "strs", "type": "str"}
_HOOK_KEYS = {"hookName": "str", "path": "str", "args": "strs", "env": "list", "timeout": "int"}
_RDT_KEYS = {"closID": "str", "l3CacheSchema": "str", "memBwSchema": "str", "schemata": "strs", "enableMonitoring": "bool"}
_NETDEV_KEYS = {"hostInterfaceName": "str", "name": "str"}
_HOOK_NAMES = {"prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"}
_JSON_TYPES = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: type(v) is int,
    "bool": lambda v: isinstance(v, bool),
    "obj": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
    "strs": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "map": lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
}


class SpecError(ValueError):
    """The spec would be rejected by a container runtime."""


def vendor_of(driver_name: str) -> str:
    """Our CDI vendor: ``k8s.<driver>`` (a driver name may start with a digit; this never does)."""
    return "k8s." + driver_name


def claim_kind(driver_name: str) -> str:
    return vendor_of(driver_name) + "/claim"


def qualified_name(kind: str, device: str) -> str:
    return f"{kind}={device}"


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def _edits(spec: dict) -> list[dict]:
    return [spec.get("containerEdits") or {}] + [d.get("containerEdits") or {} for d in spec.get("devices") or []]


def minimum_version(spec: dict) -> str:
    """Lowest cdiVersion whose features cover ``spec`` (newest rule first, first match wins)."""
    devices = spec.get("devices") or []
    edits = _edits(spec)
    rdts = [e["intelRdt"] for e in edits if e.get("intelRdt") is not None]
    if any(e.get("netDevices") for e in edits) or any("schemata" in r or r.get("enableMonitoring") for r in rdts):
        return "1.1.0"
    if rdts or any(e.get("additionalGids") for e in edits):
        return "0.7.0"
    kind = spec.get("kind", "")
    klass = kind.split("/", 1)[1] if "/" in kind else ""
    if spec.get("annotations") or any(d.get("annotations") for d in devices) or "." in klass:
        return "0.6.0"
    if any(d.get("name", "")[:1].isdigit() for d in devices) or any(
        n.get("hostPath") for e in edits for n in e.get("deviceNodes") or []
    ):
        return "0.5.0"
    if any(m.get("type") for e in edits for m in e.get("mounts") or []):
        return "0.4.0"
    return "0.3.0"


def _check_keys(obj: object, allowed: dict[str, str], where: str) -> dict:
    """``obj`` an object of the ``allowed`` fields, each of its JSON type."""
    if not isinstance(obj, dict):
        raise SpecError(f"{where}: must be an object")
    if not obj.keys() <= allowed.keys():
        raise SpecError(f"{where}: unknown field(s) {', '.join(sorted(set(obj) - set(allowed)))}")
    for key, value in obj.items():
        if value is not None and not _JSON_TYPES[allowed[key]](value):
            raise SpecError(f"{where}.{key}: must be {_TYPE_NAMES[allowed[key]]}")
    return obj


_TYPE_NAMES = {"str": "a string", "int": "an integer", "bool": "a boolean", "obj": "an object", "list": "a list",
               "strs": "a list of strings", "map": "an object of strings"}


def _check_env(env: object, where: str) -> None:
    if not isinstance(env, list) or not all(isinstance(e, str) and e.find("=") > 0 for e in env):
        raise SpecError(f"{where}.env: every entry must be NAME=value")


def _check_edits(edits: object, where: str) -> None:
    edits = _check_keys(edits, _EDIT_KEYS, where)
    if edits.get("env") is not None:
        _check_env(edits["env"], where)
    for i, node in enumerate(edits.get("deviceNodes") or []):
        w = f"{where}.deviceNodes[{i}]"
        _check_keys(node, _NODE_KEYS, w)
        if not node.get("path"):
            raise SpecError(f"{w}: path is required")
        if node.get("type", "") not in ("", "b", "c", "u", "p"):
            raise SpecError(f"{w}: invalid type {node['type']!r}")
        perms = node.get("permissions", "")
        if perms and perms != "none" and set(perms) - set("rwm"):
            raise SpecError(f"{w}: invalid permissions {perms!r}")
    gids = edits.get("additionalGids") or []
    if not isinstance(gids, list) or not all(type(g) is int and 0 <= g < 2**32 for g in gids):
        raise SpecError(f"{where}.additionalGids: must be a list of uint32 group ids")
    for i, mount in enumerate(edits.get("mounts") or []):
        w = f"{where}.mounts[{i}]"
        _check_keys(mount, _MOUNT_KEYS, w)
        if not mount.get("hostPath") or not mount.get("containerPath"):
            raise SpecError(f"{w}: hostPath and containerPath are required")
    for i, hook in enumerate(edits.get("hooks") or []):
        w = f"{where}.hooks[{i}]"
        _check_keys(hook, _HOOK_KEYS, w)
        if hook.get("hookName") not in _HOOK_NAMES or not hook.get("path"):
            raise SpecError(f"{w}: invalid hookName or empty path")
        if hook.get("env") is not None:
            _check_env(hook["env"], w)
    if edits.get("intelRdt") is not None:
        _check_keys(edits["intelRdt"], _RDT_KEYS, f"{where}.intelRdt")
    for i, netdev in enumerate(edits.get("netDevices") or []):
        _check_keys(netdev, _NETDEV_KEYS, f"{where}.netDevices[{i}]")


def validate(spec: dict, needed: str | None = None) -> None:
    """Raise SpecError for anything a CDI runtime would reject. ``needed``: the spec's
    minimum version when the caller just computed it."""
    _check_keys(spec, _SPEC_KEYS, "spec")
    version = str(spec.get("cdiVersion", "")).removeprefix("v")
    if version not in KNOWN_VERSIONS:
        raise SpecError(f"spec: unknown cdiVersion {spec.get('cdiVersion')!r}")
    vendor, _, klass = str(spec.get("kind", "")).partition("/")
    if not VENDOR_CLASS_RE.match(vendor) or not VENDOR_CLASS_RE.match(klass):
        raise SpecError(f"spec: invalid kind {spec.get('kind')!r}")
    devices = spec.get("devices")
    if not isinstance(devices, list) or not devices:
        raise SpecError("spec: no devices")
    seen = set()
    for i, dev in enumerate(devices):
        _check_keys(dev, _DEVICE_KEYS, f"devices[{i}]")
        name = dev.get("name", "")
        if not isinstance(name, str) or not DEVICE_NAME_RE.match(name):
            raise SpecError(f"devices[{i}]: invalid device name {name!r}")
        if name in seen:
            raise SpecError(f"devices[{i}]: duplicate device name {name!r}")
        seen.add(name)
        if not dev.get("containerEdits"):
            raise SpecError(f"devices[{i}]: empty device edits")
        _check_edits(dev["containerEdits"], f"devices[{i}].containerEdits")
    if "containerEdits" in spec:
        _check_edits(spec["containerEdits"], "spec.containerEdits")
    # after the shape checks: minimum_version reads the content as a spec's
    needed = needed or minimum_version(spec)
    if _version_key(version) < _version_key(needed):
        raise SpecError(f"spec: cdiVersion {version} is below the {needed} its content needs")


def finish(spec: dict) -> dict:
    """Set ``cdiVersion`` to the computed minimum (first key, for readability) and validate."""
    body = {k: v for k, v in spec.items() if k != "cdiVersion"}
    needed = minimum_version(body)
    out = {"cdiVersion": needed, **body}
    validate(out, needed)
    return out
