"""Planning one claim, before anything is written: its allocation results mapped to devices,
its CDI spec, its checkpoint entry, and what it holds (prepare/ownership.py). Pure: reads the
inventory and the checkpoint's entries, writes nothing; a refusal is ``ClaimFailed``."""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from fractions import Fraction
from typing import Callable, Iterable

from agent.kubeletplugin.types import PreparedDevice
from agent.prepare import claimstatus, shares
from agent.prepare.allocation import ClaimFailed, Result
from agent.prepare.claimconfig import OpaqueConfig, config_for
from agent.prepare.checkpoint import COMPLETED, STARTED
from agent.prepare.metadata import store as metadata
from agent.prepare.netdevs import reserved_pods
from agent.prepare.ownership import Hold
from agent.prepare.steps import Planned
from agent.quantity import parse_quantity
from agent.settings import Settings
from cdi.claim import GroupOf, build_claim_spec, cdi_id
from cdi.nodegroup import group_reader
from discovery import gpuways
from discovery.models import Device, Inventory
from discovery.vfio import is_vfio_driver

log = logging.getLogger("agent.prepare.driver")


def fingerprint(results: list[Result]) -> str:
    """The allocation as far as prepare acts on it: each result's request, device, share, consumed
    capacity and admin access. Not the raw results: a field the API server adds or defaults after
    an upgrade (the kubelet prepares running claims again when it restarts) must not read as another
    allocation, whose re-prepare would undo the running claim's host changes first."""
    acted_on = [[r.request, r.pool, r.device, r.share_id, [list(c) for c in r.consumed], r.admin] for r in results]
    return "sha256:" + hashlib.sha256(json.dumps(acted_on).encode()).hexdigest()


def same_allocation(entry: dict, raw: list[dict], results: list[Result]) -> bool:
    """Whether ``entry`` was prepared for this allocation. Entries of sysdra 0.1.0 builds before the
    fingerprint above hold the hash of the raw results, which stays accepted."""
    recorded = entry.get("allocation")
    if recorded == fingerprint(results):
        return True
    try:
        legacy = "sha256:" + hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()
    except (RecursionError, ValueError):  # a result nested too deep to hash was never recorded so
        return False
    return recorded == legacy


def filled_in(uid: str, entry: dict, claim: dict, results: list[Result], fp: str, s: Settings, nvidia,
              inventory: Callable[[], Inventory], ways: Callable[[], dict[str, gpuways.Way]]) -> dict | None:
    """An adopted entry (prepare/recovery.py ``adopt``: from its CDI spec, the checkpoint lost; no
    allocation, no claim name) completed from the claim the kubelet prepares again, when its results
    are the devices the spec holds -> the entry, or None. Its host changes stay as they are (a MIG
    instance a running pod uses, a netdev whose records were lost); the kubelet prepares every claim
    again after a restart, and an undo and redo there would take them from the running pod."""
    if entry.get("allocation") != "" or entry.get("state") != COMPLETED:
        return None
    held = {(d["pool"], d["device"], d.get("shareID")): d for d in entry.get("devices") or ()}
    wanted = [(r.pool, r.device, r.share_id) for r in results]
    if len(held) != len(entry.get("devices") or ()) or Counter(held.keys()) != Counter(wanted):
        return None
    by_name, table = inventory().by_name(), ways()  # read only for an adopted entry: a re-prepare reads none
    names = {**by_name, **{r.device: gpuways.way_device(table[r.device]) for r in results  # partitions as planned
                           if r.device in table and table[r.device].kind != "whole"}}
    prepared = [PreparedDevice([r.request], r.pool, r.device, [*held[key]["cdiDeviceIDs"], *_nvidia_ids(nvidia, names.get(r.device))],
                               r.share_id) for r, key in zip(results, wanted)]
    # the answer as the first prepare's: the kubelet gives the pod's containers the latest answer's CDI IDs
    answered = _answered(s, claim, prepared, names, by_name)
    meta = claim["metadata"]
    log.info("claim %s (%s/%s), adopted from its CDI spec: its entry filled in from the claim, its devices and host "
             "changes kept", uid, meta["namespace"], meta["name"])
    return {**entry, "namespace": meta["namespace"], "name": meta["name"], "allocation": fp, **answered,
            "devices": [device_record(d, (), r) for d, r in zip(prepared, results)]}


def _nvidia_ids(nvidia, dev: Device | None) -> list[str]:
    return nvidia.cdi_ids(dev) if nvidia and dev is not None else []


def _answered(s: Settings, claim: dict, prepared: list[PreparedDevice], names: dict[str, Device],
              by_name: dict[str, Device]) -> dict:
    """An adopted claim's metadata record (its files rewritten where gone: under a wiped plugin dir;
    ``prepared`` get its CDI IDs) and ``status.devices``, as ``add_records`` plans them. Devices gone
    from the node have no attributes to describe: no metadata then."""
    out = {}
    if s.device_metadata and all(d.device in names for d in prepared):
        out["metadata"] = metadata.plan(s, claim, prepared, names)
    if s.claim_status:
        out["deviceStatus"] = claimstatus.build_for(s, prepared, by_name)
    return out


def device_from_record(d: dict) -> PreparedDevice:
    return PreparedDevice(d["requests"], d["pool"], d["device"], list(d["cdiDeviceIDs"]), d.get("shareID"))


def device_record(d: PreparedDevice, env: tuple[str, ...] = (), result: Result | None = None) -> dict:
    rec = {"requests": d.requests, "pool": d.pool, "device": d.device, "cdiDeviceIDs": d.cdi_ids, "shareID": d.share_id}
    if env:  # a share's or a claim config's environment, for rebuilding the spec (omitted when empty)
        rec["cdiEnv"] = list(env)
    # how the device is held (ownership.py), also after a restart; omitted when not
    if result is not None and result.admin:
        rec["adminAccess"] = True
    if result is not None and result.share_id and result.consumed:
        rec["consumedCapacity"] = dict(result.consumed)
    return rec


def entry(planned: Planned, fp: str, records: dict, steps: list, s: Settings, boot_id: str,
          spec_path: Callable[[str], str], nvidia) -> tuple[list[PreparedDevice], dict]:
    """(the claim's devices, its PrepareCompleted entry as planned): the allocation's devices and
    CDI spec, each step's record; what ``add_records`` adds once its holds are granted not yet."""
    uid, meta = planned.uid, planned.claim["metadata"]
    devices, spec, envs = devices_and_spec(s.driver_name, s.node_name, s.root, uid, planned.results, planned.names,
                                           planned.configs, nvidia, group_reader(s.cdi_additional_gids))
    return devices, {"state": COMPLETED, "namespace": meta["namespace"], "name": meta["name"], "bootID": boot_id,
                     "allocation": fp, "devices": [device_record(d, e, r) for d, e, r in zip(devices, envs, planned.results)],
                     "cdiSpec": {"path": spec_path(uid), "spec": spec} if spec else None, "metadata": None,
                     **{st.key: st.write(records[st.key]) for st in steps if st.key in records}}


def add_records(entry: dict, planned: Planned, devices: list[PreparedDevice], records: dict, s: Settings,
                earlier: dict | None) -> None:
    """What a planned ``entry`` records beside its devices: its metadata files (``earlier``: the
    claim's entry before, whose generations keep growing), the pods its netdevs go to, its
    ``status.devices``. ``devices`` get the metadata's CDI IDs."""
    if s.device_metadata:
        entry["metadata"] = meta_rec = metadata.plan(s, planned.claim, devices, planned.names)
        if meta_rec and earlier and earlier.get("metadata"):  # keep generations growing for this UID
            for base, rec in meta_rec["requests"].items():
                rec["generation"] = earlier["metadata"]["requests"].get(base, {}).get("generation", 0)
    if "netdevs" in records:  # the pods the NRI plugin gives the netdevs to (agent/nri/netdev.py)
        entry["pods"] = reserved_pods(planned.claim)
    if s.claim_status:  # KEP-4817 status.devices, written by the kubelet plugin
        entry["deviceStatus"] = claimstatus.build_for(s, devices, planned.inventory)


def started(entry: dict, step_keys: Iterable[str]) -> dict:
    """The PrepareStarted entry: what rolling back needs (paths derive from UID and names) and
    the steps' records, the intents of host changes, so the first save stays small."""
    out = {"state": STARTED, "namespace": entry["namespace"], "name": entry["name"], "bootID": entry["bootID"],
           "allocation": entry["allocation"], "devices": [], "cdiSpec": None, "metadata": None}
    out.update({k: entry[k] for k in step_keys if entry.get(k)})
    return out


def devices_and_spec(driver: str, node: str, root: str, uid: str, results: list[Result], names: dict[str, Device],
                     configs: list[OpaqueConfig] = (), nvidia=None,
                     group_of: GroupOf | None = None) -> tuple[list[PreparedDevice], dict | None, list[tuple[str, ...]]]:
    """Map allocation results to devices -> (response devices, CDI spec, each device's own
    environment). One CDI device per result: a share is its own (prepare/shares.py).
    ``nvidia`` (prepare/nvidia.py): the user-space driver's edits, or NVIDIA's own CDI IDs.
    ``group_of``: the groups of group-owned device nodes (``cdi_additional_gids``, cdi/nodegroup.py)."""
    entries = []
    for r in results:
        if r.pool != node:
            raise ClaimFailed(f"device {r.device!r} is allocated from pool {r.pool!r}, not this node's pool {node!r}")
        dev = names.get(r.device)
        if dev is None:
            raise ClaimFailed(f"device {r.device!r} (request {r.request!r}) is not on this node any more")
        if why := gpuways.whole_unusable(dev):  # not published (a slice from before its instances were made)
            raise ClaimFailed(f"device {r.device!r} (request {r.request!r}): {why}")
        entries.append((dev, r, config_for(configs, r.request, dev.kind, dev.name)))
    picked: dict[str, shares.ClaimDevice] = {}
    prepared, envs = [], []
    for (dev, r, _), cd in zip(entries, shares.claim_devices(entries)):  # a claim's shares of a device described together
        if nvidia:
            cd = nvidia.with_mps(cd, r.share_id)
        picked.setdefault(cd.key, cd)
        ids = [cdi_id(driver, uid, cd.key), *(nvidia.cdi_ids(dev) if nvidia else ())]
        prepared.append(PreparedDevice([r.request], r.pool, dev.name, ids, r.share_id))
        envs.append(cd.env)
    if not picked:
        return prepared, None, envs
    cds = list(picked.values())
    shares.one_mps_gpu(cds)
    edits = nvidia.claim_edits([c.device for c in cds]) if nvidia else None
    return prepared, build_claim_spec(driver, uid, cds, root, edits, group_of), envs


# a device -> the capacities its shares are accounted against (None: it is not published shared)
Capacities = Callable[[Device], "dict[str, Fraction] | None"]


def device_holds(entry: dict, by_name: dict[str, Device], ways: dict[str, gpuways.Way],
                 capacities: Capacities = lambda dev: None) -> list[Hold]:
    """What an entry's devices hold: whole devices, shares (with what they consume),
    partitions and MIG instances (by their GPU), with admin access or not. A share of a device
    not published shared here holds it whole; one on vfio-pci holds the rest of its IOMMU group
    too (``_group_holds``). Devices no longer on the node hold nothing. The entry passed its typed check (records.py): its quantities parse."""
    out, members = [], []
    for d in entry.get("devices") or ():
        name, admin = d.get("device"), d.get("adminAccess") is True
        way = ways.get(name)
        if way is not None and way.kind != "whole":
            out.append(Hold(way.parent.pci.bdf, "partition", unit=name, mode=way.mode, admin=admin))
        elif (dev := by_name.get(name)) is not None and dev.pci is not None:
            if is_vfio_driver(dev.pci.driver):  # its container gets the IOMMU group: the rest of it held too,
                members.extend(_group_holds(dev, by_name))
                admin = False  # and admin access holds it whole: the group opens once (docs/vfio.md)
            caps = capacities(dev) if d.get("shareID") else None
            if caps is None:
                out.append(Hold(dev.pci.bdf, "exclusive", unit=name, admin=admin))
                continue
            consumed = tuple((k, parse_quantity(q)) for k, q in sorted((d.get("consumedCapacity") or {}).items()))
            out.append(Hold(dev.pci.bdf, "shared", unit=name, admin=admin, consumed=consumed, capacity=tuple(sorted(caps.items()))))
    return out + members  # the devices' own first: a refusal names the device the claim asked for


def _group_holds(dev: Device, by_name: dict[str, Device]) -> list[Hold]:
    """The other functions of the IOMMU group of ``dev``, a function on vfio-pci given as it is (no
    ``VfioConfig``: docs/vfio.md, "Which class"): its spec gives ``/dev/vfio/<group>``, the whole
    group, as a VM claim's does, so the claim holds them as the VFIO step's holds do: a second
    claim of a member would hand its container the same group (it opens once: that VM fails, or
    both share it)."""
    group = dev.pci.iommu_group
    return [] if group is None else [
        Hold(o.pci.bdf, "vfio", unit=f"{dev.pci.bdf}'s IOMMU group {group}") for o in by_name.values()
        if o.pci is not None and o.pci.iommu_group == group and o.pci.bdf != dev.pci.bdf]
