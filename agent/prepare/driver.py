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
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

from agent.fsutil import UnsafePath, clean_stale_temps
from agent.kubeletplugin.types import ClaimRef, PreparedDevice, PrepareResult
from agent.names import InvalidName
from agent.prepare import cdifiles
from agent.prepare.allocation import ClaimFailed, Result, our_results
from agent.prepare.bootid import read_boot_id
from agent.prepare.checkpoint import COMPLETED, STARTED, Checkpoint
from agent.prepare.metadata import store as metadata
from agent.settings import Settings
from cdi.claim import build_claim_spec, cdi_device_name, cdi_id
from cdi.spec import SpecError, claim_kind
from discovery.models import Device, Inventory

log = logging.getLogger(__name__)


@dataclass
class RecoveryReport:
    rolled_back: list[str] = field(default_factory=list)
    rebuilt: list[str] = field(default_factory=list)
    orphans_removed: list[str] = field(default_factory=list)
    metadata_rebuilt: list[str] = field(default_factory=list)
    metadata_orphans_removed: list[str] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)
    corrupt_checkpoint: str | None = None
    boot_changed: bool = False


def _fingerprint(results: list[dict]) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(results, sort_keys=True).encode()).hexdigest()


def _device_from_record(d: dict) -> PreparedDevice:
    return PreparedDevice(d["requests"], d["pool"], d["device"], list(d["cdiDeviceIDs"]), d.get("shareID"))


def _started(entry: dict) -> dict:
    """The PrepareStarted entry: just what rolling back needs (the spec paths derive from
    the UID, the metadata directory from namespace/name), so the first save stays small."""
    return {"state": STARTED, "namespace": entry["namespace"], "name": entry["name"], "bootID": entry["bootID"],
            "allocation": entry["allocation"], "devices": [], "cdiSpec": None, "metadata": None}


def _record(d: PreparedDevice) -> dict:
    return {"requests": d.requests, "pool": d.pool, "device": d.device, "cdiDeviceIDs": d.cdi_ids, "shareID": d.share_id}


class Driver:
    def __init__(self, settings: Settings, inventory: Callable[[], Inventory]):
        self.settings = settings
        self.inventory = inventory
        self.checkpoint_path = os.path.join(settings.plugin_dir, "checkpoint.json")
        self.checkpoint: Checkpoint | None = None
        self.boot_id = read_boot_id(settings.root)
        self.fault: Callable[[str], None] = lambda point: None

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

    def _plan(self, uid: str, results: list[Result], by_name: dict[str, Device]) -> tuple[list[PreparedDevice], dict | None]:
        """Map our allocation results to inventory devices -> (response devices, CDI spec)."""
        picked: dict[str, Device] = {}
        prepared = []
        for r in results:
            if r.pool != self.settings.node_name:
                raise ClaimFailed(f"device {r.device!r} is allocated from pool {r.pool!r}, not this node's pool {self.settings.node_name!r}")
            dev = by_name.get(r.device)
            if dev is None:
                raise ClaimFailed(f"device {r.device!r} (request {r.request!r}) is not on this node any more")
            picked.setdefault(dev.name, dev)
            ids = [cdi_id(self.settings.driver_name, uid, dev.name)]
            prepared.append(PreparedDevice([r.request], r.pool, dev.name, ids, r.share_id))
        if not picked:
            return prepared, None
        return prepared, build_claim_spec(self.settings.driver_name, uid, list(picked.values()), self.settings.root)

    # --- prepare / unprepare ---------------------------------------------------
    def prepare_claims(self, claims: list[dict]) -> dict[str, PrepareResult]:
        cp = self._cp()
        before = dict(cp.claims)  # what the checkpoint file holds; entries are replaced, not mutated
        out: dict[str, PrepareResult] = {}
        todo: list[str] = []
        by_name: dict[str, Device] | None = None
        changed: set[str] = set()  # entries to journal (Checkpoint.save appends only these)
        plans: dict[str, dict] = {}  # uid -> the PrepareCompleted entry, in the checkpoint once its files exist
        for claim in claims:
            meta = claim["metadata"]  # checked by the plugin: identity equals the request's
            uid = meta["uid"]
            try:
                raw, results = our_results(claim, self.settings.driver_name)
            except ClaimFailed as err:
                out[uid] = PrepareResult(error=str(err))
                continue
            fp = _fingerprint(raw)
            entry = cp.claims.get(uid)
            if entry and entry["state"] == COMPLETED and entry.get("allocation") == fp:
                # idempotent re-prepare: same answer, files present (a rewrite changes the entry)
                if self._ensure_spec(uid, entry) | metadata.ensure_claim(self.settings, uid, entry):
                    changed.add(uid)
                out[uid] = PrepareResult([_device_from_record(d) for d in entry["devices"]])
                continue
            if entry:  # half-prepared or allocation changed: undo before redoing
                self._remove_files(entry, uid, entry.get("namespace", ""), entry.get("name", ""))
                del cp.claims[uid]
                changed.add(uid)
            try:
                if by_name is None:
                    by_name = self.inventory().by_name()
                devices, spec = self._plan(uid, results, by_name)
                meta_rec = metadata.plan(self.settings, claim, devices, by_name) if self.settings.device_metadata else None
            except (ClaimFailed, SpecError, InvalidName, UnsafePath) as err:
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
                "bootID": self.boot_id, "allocation": fp, "devices": [_record(d) for d in devices],
                "cdiSpec": {"path": self._spec_path(uid), "spec": spec} if spec else None,
                "metadata": meta_rec,
            }
            cp.claims[uid] = _started(plans[uid])
            out[uid] = PrepareResult(devices)
            todo.append(uid)
            changed.add(uid)
        if not todo:
            if changed and (err := self._save(cp, before, changed)):
                for uid in out:
                    out[uid] = PrepareResult(error=err)
            return out
        if err := self._save(cp, before, changed, durable=False):  # PrepareStarted: see Checkpoint.save
            # nothing written yet; memory is back to what the file says
            for uid in todo:
                out[uid] = PrepareResult(error=err)
            return out
        self.fault("prepare:started")
        for uid in todo:
            entry = plans[uid]
            what = "CDI spec"
            try:
                if entry["cdiSpec"]:  # built by cdi.spec.finish in _plan just now: already valid
                    cdifiles.write_spec(entry["cdiSpec"]["path"], entry["cdiSpec"]["spec"], check=False)
                what = "device metadata"
                metadata.write_claim(self.settings, uid, entry)
            except (OSError, SpecError, InvalidName, UnsafePath) as err:
                self._remove_files(entry, uid, entry["namespace"], entry["name"])
                del cp.claims[uid]
                out[uid] = PrepareResult(error=f"writing {what}: {err}")
                continue
            cp.claims[uid] = entry
        self.fault("prepare:specs-written")
        started = {uid: _started(plans[uid]) for uid in todo if uid in cp.claims}
        if err := self._save(cp, {**cp.claims, **started}, todo):
            # the file still says PrepareStarted: undo the files so a retry starts clean
            for uid, entry in started.items():
                self._remove_files(entry, uid, entry["namespace"], entry["name"])
                out[uid] = PrepareResult(error=err)
            return out
        self.fault("prepare:completed")
        return out

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
        before = dict(cp.claims)
        removed = {c.uid: cp.claims.pop(c.uid, None) for c in claims}
        if any(removed.values()) and (err := self._save(cp, before, removed)):
            return {c.uid: err for c in claims}  # files kept: the kubelet retries unprepare
        self.fault("unprepare:saved")
        out: dict[str, str | None] = {}
        for ref in claims:
            try:
                self._remove_files(removed[ref.uid], ref.uid, ref.namespace, ref.name)
                out[ref.uid] = None
            except OSError as err:
                out[ref.uid] = f"removing CDI spec or device metadata: {err}"
        self.fault("unprepare:done")
        return out

    def _remove_files(self, entry: dict | None, uid: str, namespace: str, name: str) -> None:
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

    def _ensure_spec(self, uid: str, entry: dict, rebuild: bool = False) -> bool:
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
            by_name = self.inventory().by_name()
            devs = list({d["device"]: by_name[d["device"]] for d in entry["devices"]}.values())
            content = build_claim_spec(self.settings.driver_name, uid, devs, self.settings.root)
        except (KeyError, SpecError, ValueError) as err:
            log.warning("claim %s: rebuilding CDI spec from the recorded one (%s)", uid, err)
        cdifiles.write_spec(spec["path"], content)
        spec["spec"] = content
        return True

    def _ensure_metadata(self, uid: str, entry: dict, rebuild: bool) -> bool:
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
    def recover(self) -> RecoveryReport:
        """Load the checkpoint and make the CDI dir match it. Call before serving."""
        s = self.settings
        clean_stale_temps(s.plugin_dir, prefix=".checkpoint.json")
        cdifiles.clean_our_temps(s.cdi_dir, s.driver_name)
        cp = self.checkpoint = Checkpoint.load(self.checkpoint_path)
        report = RecoveryReport(corrupt_checkpoint=cp.corrupt_path)
        specs = cdifiles.list_claim_specs(s.cdi_dir, s.driver_name)
        if cp.corrupt_path:
            report.adopted = self._adopt(cp, specs)
        for uid, entry in list(cp.claims.items()):
            if entry["state"] == STARTED:
                del cp.claims[uid]
                self._remove_files(entry, uid, entry.get("namespace", ""), entry.get("name", ""))
                report.rolled_back.append(uid)
                continue
            rebooted = entry.get("bootID") != self.boot_id
            report.boot_changed |= rebooted
            if self._ensure_spec(uid, entry, rebuild=rebooted):
                report.rebuilt.append(uid)
            if self._ensure_metadata(uid, entry, rebuild=rebooted):
                report.metadata_rebuilt.append(uid)
            entry["bootID"] = self.boot_id
        for uid, path in specs.items():
            if uid not in cp.claims:
                cdifiles.remove_spec(path)
                report.orphans_removed.append(uid)
        report.metadata_orphans_removed = metadata.remove_orphans(s, cp.claims)
        if cp.corrupt_path or report.rolled_back or report.boot_changed or report.rebuilt or cp.claims:
            cp.save()  # journals what changed (compacts only when due: a full disk must not stop the start)
        counts = {k: len(v) for k, v in asdict(report).items() if isinstance(v, list) and v}
        log.info("kubelet plugin state recovered: %d claims prepared%s%s%s", len(cp.claims),
                 "".join(f", {n} {k.replace('_', ' ')}" for k, n in counts.items()),
                 ", after a reboot" if report.boot_changed else "",
                 f", corrupt checkpoint moved to {report.corrupt_checkpoint}" if report.corrupt_checkpoint else "")
        log.debug("recovery details: %s", asdict(report))
        return report

    def _adopt(self, cp: Checkpoint, specs: dict[str, str]) -> list[str]:
        """After a corrupt checkpoint, keep claims whose valid spec files exist as prepared:
        running containers still reference them and the kubelet will unprepare them."""
        kind = claim_kind(self.settings.driver_name)
        adopted = []
        for uid, path in specs.items():
            try:
                spec = cdifiles.read_spec(path)
            except SpecError as err:
                log.error("removing unreadable CDI spec %s", err)
                continue  # left as orphan: removed below
            prefix = cdi_device_name(uid, "")
            devices = [
                {"requests": [], "pool": self.settings.node_name, "device": d["name"][len(prefix):],
                 "cdiDeviceIDs": [f"{kind}={d['name']}"], "shareID": None}
                for d in spec["devices"] if d["name"].startswith(prefix)
            ]
            cp.claims[uid] = {"state": COMPLETED, "namespace": "", "name": "", "bootID": self.boot_id,
                              "allocation": "", "devices": devices, "cdiSpec": {"path": path, "spec": spec}}
            adopted.append(uid)
        return adopted
