"""The per-claim CDI spec: what a container gets for the devices of one claim.

Layout (documented in docs/kubelet-plugin.md, keep the env names stable):
- kind ``k8s.<driver>/claim``, one CDI device ``<claimUID>-<device>`` per device (per share:
  ``<claimUID>-<device>-<shareID>``, with the share's environment, docs/sharing.md) with
  its device nodes (``hostPath`` only where the host's path differs from the container's: the
  agent's ``--root`` is its own view of the host, never part of a path the runtime reads) and
  ``SYSDRA_DEVICE_<NAME>=<pci bus id>`` (unique per device, so never duplicated), and with
  ``cdi_additional_gids`` on the host groups of its group-owned nodes (``additionalGids``);
- spec-level edits (applied once when any device of the claim is injected) carry the
  claim-wide lists: ``SYSDRA_CLAIM_UID``, ``SYSDRA_DEVICES``,
  ``SYSDRA_<KIND>_PCI_BUS_IDS`` per kind and ``SYSDRA_NIC_INTERFACES``, and what a vendor's
  devices need once per claim (NVIDIA's user-space driver, cdi/nvidia.py).

No variable is set twice in what one device brings to a container (its own edits and the
spec-level ones), nor to two values by two devices of a claim (one container may get them all):
runtimes keep one of two values silently, so ``build_claim_spec`` refuses such a spec, and
``capacity_keys`` and ``agent/prepare/shares.py`` name and sum a claim's shares so that it never happens.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cdi.spec import SpecError, claim_kind, finish, qualified_name
from discovery.models import Device, DeviceNode

# a device node -> the host gid a non-root container process needs to open it (cdi/nodegroup.py)
GroupOf = Callable[[DeviceNode], "int | None"]

# what a share sets besides its capacities: SYSDRA_SHARE_<key> and SYSDRA_DEVICE_<NAME>_<key>
SHARE_KEYS = ("ID", "DEVICE")
DEVICE_SHARE_KEYS = ("SHARE",)


@dataclass(frozen=True)
class ClaimDevice:
    """One CDI device of a claim: a device, or one share of it (``key`` ``<device>-<shareID>``,
    so every share gets its own CDI name), with environment of its own (the share, claim config)."""

    device: Device
    key: str
    env: tuple[str, ...] = ()
    mounts: tuple[dict, ...] = ()  # e.g. an MPS control daemon's pipe directory (prepare/mps.py)


def _env_key(text: str) -> str:
    return re.sub(r"[^A-Z0-9]", "_", text.upper())


def env_name(device_name: str) -> str:
    return "SYSDRA_DEVICE_" + _env_key(device_name)


def _clashes(keys: dict[str, str]) -> set[str]:
    """The capacities whose variables (``SYSDRA_SHARE_<K>``, ``..._<K>_VALUE``,
    ``SYSDRA_DEVICE_<NAME>_<K>``) would also be set by another capacity or by the share itself."""
    share = Counter(SHARE_KEYS)
    device = Counter(DEVICE_SHARE_KEYS)
    for k in keys.values():
        share.update((k, k + "_VALUE"))
        device[k] += 1
    return {n for n, k in keys.items() if share[k] > 1 or share[k + "_VALUE"] > 1 or device[k] > 1}


def capacity_keys(capacities: Iterable[str]) -> dict[str, str]:
    """The variable key of each capacity of a share: its name after the domain, upper-case
    (``example.com/rate`` -> ``RATE``); where that would set a variable twice (``memory`` and
    ``example.com/memory``), the whole name (``EXAMPLE_COM_MEMORY``). ValueError when even the
    whole names clash (``id``, ``Memory`` beside ``memory``, ``x`` beside ``x_value``)."""
    keys = {n: _env_key(n.rsplit("/", 1)[-1]) for n in capacities}
    while clash := _clashes(keys):  # each round gives at least one more capacity its whole name
        if all(keys[n] == _env_key(n) for n in clash):
            raise ValueError(f"capacities {', '.join(sorted(clash))} would set the same environment variable "
                             f"(the share's own are {', '.join(SHARE_KEYS + DEVICE_SHARE_KEYS)})")
        for n in clash:
            keys[n] = _env_key(n)
    return keys


def _names(env: Iterable[str]) -> list[str]:
    return [e.partition("=")[0] for e in env]


def check_unique_env(spec: dict) -> None:
    """SpecError when a device's edits set a variable twice or one the spec-level edits set, or
    when two devices of the claim set one variable (or mount one container path) differently: a
    container given both would keep one value, whichever the runtime applied last."""
    common = _names(spec.get("containerEdits", {}).get("env", ()))
    values: dict[str, tuple[str, str]] = {}
    mounts: dict[str, tuple[dict, str]] = {}
    for dev in spec["devices"]:
        edits = dev["containerEdits"]
        names = common + _names(edits.get("env", ()))
        if len(set(names)) != len(names):  # (a Counter per device only to name them)
            twice = sorted(n for n, c in Counter(names).items() if c > 1)
            raise SpecError(f"device {dev['name']}: environment variable(s) {', '.join(twice)} set twice")
        for e in edits.get("env", ()):
            name, _, value = e.partition("=")
            first = values.setdefault(name, (value, dev["name"]))
            if first[0] != value:
                raise SpecError(f"devices {first[1]} and {dev['name']} set {name} to different values "
                                f"({first[0]!r}, {value!r})")
        for m in edits.get("mounts", ()):
            first = mounts.setdefault(m["containerPath"], (m, dev["name"]))
            if first[0] != m:
                raise SpecError(f"devices {first[1]} and {dev['name']} mount different things at {m['containerPath']}")


def cdi_device_name(claim_uid: str, device_name: str) -> str:
    return f"{claim_uid}-{device_name}"


def cdi_id(driver_name: str, claim_uid: str, device_name: str) -> str:
    return qualified_name(claim_kind(driver_name), cdi_device_name(claim_uid, device_name))


def _normal(path: str) -> str:
    path = os.path.abspath(path)
    return path[1:] if path.startswith("//") else path  # POSIX keeps a leading "//"; relpath does not


def host_path(node_host_path: str, root: str) -> str:
    """A device node's path as the container runtime on the host sees it: the agent's view
    (under ``--root``, ``/host/dev/...`` in the DaemonSet) without the root. Without a
    ``hostPath`` the runtime stats the node itself and keeps its mode, owner and group."""
    path, base = _normal(node_host_path), _normal(root)  # os.path.relpath's view, a tenth its cost
    if path == base:
        return "/."
    if base == "/":
        return path
    return path[len(base):] if path.startswith(base + "/") else node_host_path


# device name -> (the device object, root, its CDI device nodes): built once per device object
# (discovery keeps an unchanged device's object across rescans), not at every prepare
_nodes: dict[str, tuple[Device, str, tuple[dict, ...]]] = {}


def _device_nodes(dev: Device, root: str) -> list[dict]:
    hit = _nodes.get(dev.name)
    if hit is None or hit[0] is not dev or hit[1] != root:
        nodes = []
        for n in dev.device_nodes:
            node = {"path": n.path}
            on_host = host_path(n.host_path, root)
            if on_host != n.path:
                node["hostPath"] = on_host
            node.update({"type": n.type, "major": n.major, "minor": n.minor})
            nodes.append(node)
        hit = _nodes[dev.name] = (dev, root, tuple(nodes))
    return [dict(n) for n in hit[2]]  # each spec its own dicts


def _device_edits(dev: Device, root: str, extra_env: tuple[str, ...] = (), mounts: tuple[dict, ...] = (),
                  group_of: GroupOf | None = None) -> dict:
    nodes = _device_nodes(dev, root)
    edits: dict = {"env": [f"{env_name(dev.name)}={dev.pci.bdf}", *extra_env]}
    if nodes:
        edits["deviceNodes"] = nodes
    gids = sorted({g for n in dev.device_nodes if (g := group_of(n))}) if group_of else []
    if gids:  # device-level: only a container given this device joins its groups (cdiVersion 0.7.0)
        edits["additionalGids"] = gids
    if mounts:
        edits["mounts"] = [dict(m) for m in mounts]
    return edits


def build_claim_spec(driver_name: str, claim_uid: str, entries: list[Device | ClaimDevice], root: str = "/",
                     extra_edits: dict | None = None, group_of: GroupOf | None = None) -> dict:
    """The finished, validated spec dict for ``entries`` (each once, in allocation order; a
    plain Device is its own key). Claim-wide lists name each device once, however many shares.
    ``extra_edits``: claim-wide edits a vendor needs once per claim (cdi/nvidia.py).
    ``group_of``: with ``cdi_additional_gids`` on, each device's ``additionalGids`` (the groups
    of its group-owned nodes, cdi/nodegroup.py); None writes no such field."""
    if not entries:
        raise ValueError("a CDI spec needs at least one device")
    cdi_devices = [e if isinstance(e, ClaimDevice) else ClaimDevice(e, e.name) for e in entries]
    devices = list({c.device.name: c.device for c in cdi_devices}.values())
    env = [f"SYSDRA_CLAIM_UID={claim_uid}", "SYSDRA_DEVICES=" + ",".join(d.name for d in devices)]
    for kind in sorted({d.kind for d in devices}):
        bdfs = ",".join(d.pci.bdf for d in devices if d.kind == kind)
        env.append(f"SYSDRA_{kind.upper()}_PCI_BUS_IDS={bdfs}")
    ifaces = [i.name for d in devices if d.nic for i in d.nic.interfaces]
    if ifaces:
        env.append("SYSDRA_NIC_INTERFACES=" + ",".join(ifaces))
    spec = {
        "kind": claim_kind(driver_name),
        "devices": [
            {"name": cdi_device_name(claim_uid, c.key), "containerEdits": _device_edits(c.device, root, c.env, c.mounts, group_of)}
            for c in cdi_devices
        ],
        "containerEdits": {"env": env},
    }
    for key, values in (extra_edits or {}).items():
        spec["containerEdits"].setdefault(key, []).extend(values)
    check_unique_env(spec)
    return finish(spec)
