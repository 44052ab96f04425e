"""Device logic behind the kubelet plugin: allocation -> inventory devices -> CDI spec.

Prepare is two-phase in the checkpoint so a crash at any point is repaired at the
next start (``recover``):

1. small ``PrepareStarted`` entries saved (not durably)       - crash: rolled back at start
2. CDI specs and metadata files written atomically            - crash: rolled back at start
3. full ``PrepareCompleted`` entries saved durably            - crash: claim stays prepared

Unprepare saves the checkpoint without the claim first, then removes the specs and
metadata; a crash in between leaves orphans that ``recover`` (or the kubelet's retry)
deletes. ``fault`` is a test hook called at each of these points.

Claims and the checkpoint are input: our allocation results are checked before anything is
recorded (``allocation.py``), names are checked before they become paths, and the only
files written or removed are our own, at paths derived from the claim UID (a path recorded
in the checkpoint is removed only if it names one of our files in the CDI dir).

KEP-5304 metadata (``settings.device_metadata``) lives in ``agent/prepare/metadata``; the claim's
checkpoint entry keeps what is needed to rewrite it, including the last generation.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Callable, Iterable

from agent.fsutil import UnsafePath
from agent.kubeletplugin.types import ClaimRef, PreparedDevice, PrepareResult
from agent.names import InvalidName
from agent.prepare import cdifiles, claimstatus, recovery, shares, vfio
from agent.prepare.recovery import RecoveryReport
from agent.prepare.allocation import ClaimFailed, Result, our_results
from agent.prepare.claimconfig import OpaqueConfig, config_for, opaque_configs
from agent.prepare.bootid import read_boot_id
from agent.prepare.netdevs import plan_netdevs, reserved_pods
from agent.prepare.checkpoint import COMPLETED, STARTED, Checkpoint
from agent.prepare.metadata import store as metadata
from agent.prepare.nvidia import NvidiaDriver
from agent.prepare.partitions import Partitions
from agent.prepare.vfio import VfioError
from agent.prepare.vfio_kernel import KernelError, PciKernel
from agent.settings import Settings
from cdi.claim import build_claim_spec, cdi_id
from cdi.spec import SpecError
from discovery.models import Device, Inventory

log = logging.getLogger(__name__)


def _fingerprint(results: list[dict]) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(results, sort_keys=True).encode()).hexdigest()


def _device_from_record(d: dict) -> PreparedDevice:
    return PreparedDevice(d["requests"], d["pool"], d["device"], list(d["cdiDeviceIDs"]), d.get("shareID"))


def _started(entry: dict) -> dict:
    """The PrepareStarted entry: just what rolling back needs (the spec paths derive from
    the UID, the metadata directory from namespace/name), so the first save stays small."""
    started = {"state": STARTED, "namespace": entry["namespace"], "name": entry["name"], "bootID": entry["bootID"],
               "allocation": entry["allocation"], "devices": [], "cdiSpec": None, "metadata": None}
    if entry.get("vfio"):  # the intent of a kernel change: what to give back if we crash
        started["vfio"] = entry["vfio"]
    if entry.get("partitions"):  # a GPU mode switch's intent (prepare/partitions.py)
        started["partitions"] = entry["partitions"]
    return started


def _record(d: PreparedDevice, env: tuple[str, ...] = ()) -> dict:
    rec = {"requests": d.requests, "pool": d.pool, "device": d.device, "cdiDeviceIDs": d.cdi_ids, "shareID": d.share_id}
    if env:  # a share's or a claim config's environment, for rebuilding the spec (omitted when empty)
        rec["cdiEnv"] = list(env)
    return rec


class Driver:
    def __init__(self, settings: Settings, inventory: Callable[[], Inventory]):
        self.settings = settings
        self.inventory = inventory
        self.checkpoint_path = os.path.join(settings.plugin_dir, "checkpoint.json")
        self.checkpoint: Checkpoint | None = None
        self.boot_id = read_boot_id(settings.root)
        self.kernel = PciKernel(settings.root)
        self.recovery: RecoveryReport | None = None  # of the last recover()
        self.fault: Callable[[str], None] = lambda point: None
        self.hardware_changed: Callable[[], None] = lambda: None  # the daemon rescans and republishes
        self.recorded_status = claimstatus.RecordedStatus(lambda: self.checkpoint)  # for the status writer
        self.nvidia = NvidiaDriver(settings.root, settings.nvidia_driver_root, settings.nvidia_cdi_spec, settings.cdi_dir,
                                   settings.cdi_host_root)
        self.partitions = Partitions(settings.root, inventory, settings.partition_switch_timeout,
                                     fault=lambda point: self.fault(point)) if settings.partitions else None

    # --- helpers -------------------------------------------------------------
    def _cp(self) -> Checkpoint:
        if self.checkpoint is None:
            self.recover()
        else:  # called under the serialize lock: another process may have saved meanwhile
            self.checkpoint.reload_if_changed()
        assert self.checkpoint is not None
        return self.checkpoint

    def _spec_path(self, uid: str) -> str:
        return cdifiles.claim_spec_path(self.settings.cdi_dir, self.settings.driver_name, uid)

    def _plan(self, uid: str, results: list[Result], by_name: dict[str, Device],
              configs: list[OpaqueConfig] = ()) -> tuple[list[PreparedDevice], dict | None, list[tuple[str, ...]]]:
        """Map our allocation results to inventory devices -> (response devices, CDI spec, each
        device's own environment). One CDI device per result: a share is its own (prepare/shares.py)."""
        picked: dict[str, shares.ClaimDevice] = {}
        prepared, envs = [], []
        for r in results:
            if r.pool != self.settings.node_name:
                raise ClaimFailed(f"device {r.device!r} is allocated from pool {r.pool!r}, not this node's pool {self.settings.node_name!r}")
            dev = by_name.get(r.device)
            if dev is None:
                raise ClaimFailed(f"device {r.device!r} (request {r.request!r}) is not on this node any more")
            cd = shares.claim_device(dev, r, config_for(configs, r.request, dev.kind, dev.name))
            picked.setdefault(cd.key, cd)
            ids = [cdi_id(self.settings.driver_name, uid, cd.key), *self.nvidia.cdi_ids(dev)]
            prepared.append(PreparedDevice([r.request], r.pool, dev.name, ids, r.share_id))
            envs.append(cd.env)
        if not picked:
            return prepared, None, envs
        cds = list(picked.values())
        return prepared, build_claim_spec(self.settings.driver_name, uid, cds, self.settings.root,
                                          self.nvidia.claim_edits([c.device for c in cds])), envs

    def _claim_spec(self, uid: str, entry: dict, by_name: dict[str, Device]) -> dict:
        """The claim's CDI spec from the inventory; VFIO functions get the nodes they have now."""
        held = {rec["bdf"] for rec in entry.get("vfio") or ()}
        devs = []
        for d in entry["devices"]:
            dev = by_name[d["device"]]
            devs.append(shares.recorded(vfio.with_vfio_nodes(self.settings.root, dev) if dev.pci.bdf in held else dev, d))
        devs = list({c.key: c for c in devs}.values())
        return build_claim_spec(self.settings.driver_name, uid, devs, self.settings.root,
                                self.nvidia.claim_edits([c.device for c in devs]))

    # --- prepare / unprepare ---------------------------------------------------
    def prepare_claims(self, claims: list[dict]) -> dict[str, PrepareResult]:
        cp = self._cp()
        before = dict(cp.claims)  # what the checkpoint file holds; entries are replaced, not mutated
        out: dict[str, PrepareResult] = {}
        todo: list[str] = []
        by_name: dict[str, Device] | None = None
        changed: set[str] = set()  # entries to journal (Checkpoint.save appends only these)
        plans: dict[str, dict] = {}  # uid -> the PrepareCompleted entry, in the checkpoint once its files exist
        planned: dict[str, tuple] = {}  # uid -> (results, devices by name, configs): what a mode switch re-plans from
        for claim in claims:
            meta = claim["metadata"]  # checked by the plugin: identity equals the request's
            uid = meta["uid"]
            try:
                raw, results = our_results(claim, self.settings.driver_name)
                configs = opaque_configs(claim, self.settings.driver_name)
            except ClaimFailed as err:
                out[uid] = PrepareResult(error=str(err))
                continue
            fp = _fingerprint(raw)
            entry = cp.claims.get(uid)
            if entry and entry["state"] == COMPLETED and entry.get("allocation") == fp:
                # idempotent re-prepare: same answer, files present (a rewrite changes the entry)
                try:
                    if entry.get("vfio") and vfio.ensure_bound(self.kernel, entry["vfio"], self.fault):
                        self.ensure_spec(uid, entry, rebuild=True)  # new group nodes
                except VfioError as err:
                    out[uid] = PrepareResult(error=str(err))
                    continue
                if self.ensure_spec(uid, entry) | metadata.ensure_claim(self.settings, uid, entry):
                    changed.add(uid)
                out[uid] = PrepareResult([_device_from_record(d) for d in entry["devices"]], status=entry.get("deviceStatus"))
                continue
            if entry:  # half-prepared or allocation changed: undo before redoing
                if entry.get("vfio") and (problems := vfio.restore_all(self.kernel, entry["vfio"])):
                    out[uid] = PrepareResult(error="giving VFIO functions back failed: " + "; ".join(problems))
                    continue
                self.remove_files(entry, uid, entry.get("namespace", ""), entry.get("name", ""))
                del cp.claims[uid]
                changed.add(uid)
            try:
                if by_name is None:
                    by_name = self.inventory().by_name()
                extra, part_rec = self.partitions.plan(uid, results, cp.claims) if self.partitions else ({}, None)
                names = {**by_name, **extra} if extra else by_name
                devices, spec, envs = self._plan(uid, results, names, configs)
                vfio_recs = vfio.claim_records(self.settings, self.kernel, claim, results, by_name,
                                               {u: e for u, e in cp.claims.items() if u != uid})
                meta_rec = metadata.plan(self.settings, claim, devices, names) if self.settings.device_metadata else None
            except (ClaimFailed, SpecError, InvalidName, UnsafePath, VfioError, KernelError) as err:
                out[uid] = PrepareResult(error=str(err))
                continue
            except Exception as err:  # a bug on one claim's data stays that claim's error
                log.exception("claim %s: planning failed", uid)
                out[uid] = PrepareResult(error=f"internal error: {err}")
                continue
            if meta_rec and entry and entry.get("metadata"):  # keep generations growing for this UID
                for base, rec in meta_rec["requests"].items():
                    rec["generation"] = entry["metadata"]["requests"].get(base, {}).get("generation", 0)
            plans[uid] = {
                "state": COMPLETED, "namespace": meta["namespace"], "name": meta["name"],
                "bootID": self.boot_id, "allocation": fp, "devices": [_record(d, e) for d, e in zip(devices, envs)],
                "cdiSpec": {"path": self._spec_path(uid), "spec": spec} if spec else None,
                "metadata": meta_rec,
            }
            if vfio_recs:
                plans[uid]["vfio"] = vfio_recs
            elif netdevs := plan_netdevs(devices, names):  # given to the pod by agent/nri/netdev.py
                plans[uid].update(netdevs=netdevs, pods=reserved_pods(claim))
            if part_rec:
                plans[uid]["partitions"] = part_rec
            planned[uid] = (results, names, configs)
            if self.settings.claim_status:  # KEP-4817 status.devices, written by the kubelet plugin
                plans[uid]["deviceStatus"] = claimstatus.build_for(self.settings, devices, by_name)
            cp.claims[uid] = _started(plans[uid])
            out[uid] = PrepareResult(devices, status=plans[uid].get("deviceStatus"))
            todo.append(uid)
            changed.add(uid)
        if not todo:
            if changed and (err := self._save(cp, before, changed)):
                for uid in out:
                    out[uid] = PrepareResult(error=err)
            return out
        # PrepareStarted (see Checkpoint.save); durable when it records a kernel change to undo
        switching = any((plans[uid].get("partitions") or {}).get("switch") for uid in todo)
        hardware = switching or any(plans[uid].get("vfio") for uid in todo)
        if err := self._save(cp, before, changed, durable=hardware):
            # nothing written yet; memory is back to what the file says
            for uid in todo:
                out[uid] = PrepareResult(error=err)
            return out
        self.fault("prepare:started")
        for uid in todo:
            entry = plans[uid]
            if (entry.get("partitions") or {}).get("switch"):
                try:
                    out[uid] = self._switch_mode(uid, entry, *planned[uid])
                except (ClaimFailed, SpecError) as err:
                    del cp.claims[uid]
                    out[uid] = PrepareResult(error=str(err))
                    continue
            what = "CDI spec"
            try:
                if entry.get("vfio"):
                    what = "VFIO binding"
                    vfio.bind_all(self.kernel, entry["vfio"], self.fault)
                    entry["cdiSpec"]["spec"] = self._claim_spec(uid, entry, by_name)
                    what = "CDI spec"
                if entry["cdiSpec"]:  # built by cdi.spec.finish in _plan just now: already valid
                    cdifiles.write_spec(entry["cdiSpec"]["path"], entry["cdiSpec"]["spec"], check=False)
                what = "device metadata"
                metadata.write_claim(self.settings, uid, entry)
            except (OSError, SpecError, InvalidName, UnsafePath, VfioError) as err:
                if entry.get("vfio") and what != "VFIO binding":  # bind_all restores on its own failures
                    vfio.restore_all(self.kernel, entry["vfio"], self.fault)
                self.remove_files(entry, uid, entry["namespace"], entry["name"])
                del cp.claims[uid]
                out[uid] = PrepareResult(error=f"{what}: {err}")
                continue
            cp.claims[uid] = entry
        if switching:
            self.hardware_changed()
        self.fault("prepare:specs-written")
        started = {uid: _started(plans[uid]) for uid in todo if uid in cp.claims}
        if err := self._save(cp, {**cp.claims, **started}, todo):
            # the file still says PrepareStarted: undo the files so a retry starts clean
            for uid, entry in started.items():
                if entry.get("vfio"):
                    vfio.restore_all(self.kernel, entry["vfio"], self.fault)
                self.remove_files(entry, uid, entry["namespace"], entry["name"])
                out[uid] = PrepareResult(error=err)
            return out
        self.fault("prepare:completed")
        return out

    def _switch_mode(self, uid: str, entry: dict, results: list[Result], names: dict[str, Device],
                     configs: list[OpaqueConfig]) -> PrepareResult:
        """The GPU mode switch the entry records (its intent is on disk), then the claim's
        devices and spec from the partitions the kernel exposes afterwards."""
        pt = self.partitions.switch(entry["partitions"]["switch"])
        fresh = {**names, **self.partitions.devices_after(pt, results)}
        devices, spec, envs = self._plan(uid, results, fresh, configs)
        entry["devices"] = [_record(d, e) for d, e in zip(devices, envs)]
        entry["cdiSpec"] = {"path": self._spec_path(uid), "spec": spec} if spec else None
        entry["partitions"] = {"uses": entry["partitions"]["uses"]}
        return PrepareResult(devices)

    def _save(self, cp: Checkpoint, fallback: dict[str, dict], changed: Iterable[str], durable: bool = True) -> str | None:
        """Save the ``changed`` entries; on failure put ``fallback`` (what the files still
        hold) back in memory so memory never claims more than disk, and return the
        per-claim error text."""
        try:
            cp.save(durable=durable, changed=changed)
        except OSError as err:
            cp.claims = fallback
            log.error("checkpoint %s not saved: %s", cp.path, err)
            return f"saving checkpoint: {err}"
        return None

    def unprepare_claims(self, claims: list[ClaimRef]) -> dict[str, str | None]:
        cp = self._cp()
        out: dict[str, str | None] = {}
        for ref in claims:  # functions go back before the claim leaves the checkpoint (a crash: retried)
            entry = cp.claims.get(ref.uid)
            if entry and entry.get("vfio") and (problems := vfio.restore_all(self.kernel, entry["vfio"], self.fault)):
                out[ref.uid] = "giving VFIO functions back to their drivers failed: " + "; ".join(problems)
        claims = [c for c in claims if c.uid not in out]
        before = dict(cp.claims)
        removed = {c.uid: cp.claims.pop(c.uid, None) for c in claims}
        if any(removed.values()) and (err := self._save(cp, before, removed)):
            return {**out, **{c.uid: err for c in claims}}  # files kept: the kubelet retries unprepare
        self.fault("unprepare:saved")
        for ref in claims:
            try:
                self.remove_files(removed[ref.uid], ref.uid, ref.namespace, ref.name)
                out[ref.uid] = None
            except OSError as err:
                out[ref.uid] = f"removing CDI spec or device metadata: {err}"
        self.fault("unprepare:done")
        return out

    def remove_files(self, entry: dict | None, uid: str, namespace: str, name: str) -> None:
        """The claim spec, the metadata specs and the metadata directory (which is keyed by
        namespace/name: kept if another prepared claim, a recreated one, uses it)."""
        self._remove_spec(entry, uid)
        cp = self.checkpoint
        shared = cp is not None and any(
            u != uid and (e.get("namespace"), e.get("name")) == (namespace, name) for u, e in cp.claims.items())
        metadata.remove_claim(self.settings, uid, namespace, name, keep_dir=shared)

    def _remove_spec(self, entry: dict | None, uid: str) -> None:
        # The uid's own spec path, also for unknown claims (e.g. adopted after a corrupt checkpoint).
        cdifiles.remove_spec(self._spec_path(uid))
        recorded = ((entry or {}).get("cdiSpec") or {}).get("path")
        if recorded and recorded != self._spec_path(uid):
            if cdifiles.is_ours(self.settings.cdi_dir, self.settings.driver_name, recorded):
                cdifiles.remove_spec(recorded)
            else:  # another CDI dir, or a checkpoint we did not write: not ours to delete
                log.warning("claim %s: leaving %s (recorded in the checkpoint, not our file in %s)",
                            uid, recorded, self.settings.cdi_dir)

    def ensure_spec(self, uid: str, entry: dict, rebuild: bool = False) -> bool:
        """Write a completed claim's spec if missing, unreadable or ``rebuild``; True if written."""
        spec = entry.get("cdiSpec")
        if not spec:
            return False
        if spec["path"] != self._spec_path(uid):  # never write where the checkpoint says: derive it
            self._remove_spec(entry, uid)
            spec["path"] = self._spec_path(uid)
            rebuild = True
        if not rebuild:
            try:
                cdifiles.read_spec(spec["path"])
                return False
            except SpecError:
                pass
        content = spec["spec"]
        try:  # rebuild from the current inventory: device numbers can change across reboots
            content = self._claim_spec(uid, entry, self.inventory().by_name())
        except (KeyError, SpecError, ValueError, VfioError, KernelError, ClaimFailed) as err:
            log.warning("claim %s: rebuilding CDI spec from the recorded one (%s)", uid, err)
        cdifiles.write_spec(spec["path"], content)
        spec["spec"] = content
        return True

    def ensure_metadata(self, uid: str, entry: dict, rebuild: bool) -> bool:
        """Missing metadata files/specs are rewritten with a higher generation; after a
        reboot all of them, with device data from the current inventory."""
        if not entry.get("metadata"):
            return False
        if rebuild:
            try:
                metadata.refresh_devices(self.settings, entry, self.inventory().by_name())
            except Exception as err:  # keep the recorded device data
                log.warning("claim %s: metadata keeps the recorded device data (%s)", uid, err)
        try:
            return metadata.ensure_claim(self.settings, uid, entry, rebuild=rebuild)
        except (OSError, SpecError, InvalidName, UnsafePath) as err:
            log.error("claim %s: cannot rewrite device metadata: %s", uid, err)
            return False

    # --- start-up reconciliation ----------------------------------------------
    def recover(self) -> "RecoveryReport":
        """Load the checkpoint and make the CDI dir (and the kernel) match it. Call before serving."""
        return recovery.recover(self)
