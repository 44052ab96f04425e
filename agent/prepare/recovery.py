"""Start-up reconciliation of the driver's state: the checkpoint is the truth about what we
created; make the CDI dir, the metadata files and the host (the steps' changes: VFIO
bindings, GPU modes) match it.

Prepared-but-interrupted claims (PrepareStarted) are rolled back, their steps undone in
reverse (VFIO functions given back, a GPU's mode switch undone); prepared claims get their
files rebuilt after a reboot (device numbers change) and their steps' changes made again
(VFIO functions re-bound); orphans are removed; after a corrupt checkpoint, or for entries
rejected as invalid, claims whose spec files exist are adopted.

An entry a newer sysdra wrote (prepare/checkpoint_entries.py: fields this one does not know) stays
in the files as it is: a prepared one's known part is made good again like any other (its spec
rewritten after a reboot, the steps' changes it records redone), an interrupted prepare of it is
left to that sysdra (undoing only what this one knows of it, then dropping the entry, would lose
the rest), and while any is there nothing is swept as a leftover no entry records (its unknown
fields may record it)."""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field

from agent.fsutil import clean_stale_temps
from agent.names import is_uid
from agent.prepare import cdifiles, shares
from agent.prepare.checkpoint import COMPLETED, STARTED, Checkpoint
from agent.prepare.checkpoint_format import last_saved
from agent.prepare.checkpoint_view import Saved
from agent.prepare.claimfiles import NotRebuilt
from agent.prepare.metadata import store as metadata
from agent.prepare.steps import NotRecovered, Undone
from cdi.claim import cdi_device_name
from cdi.spec import SpecError, claim_kind

log = logging.getLogger("agent.prepare.driver")


@dataclass
class RecoveryReport:
    rolled_back: list[str] = field(default_factory=list)
    rebuilt: list[str] = field(default_factory=list)
    not_rebuilt: list[str] = field(default_factory=list)  # specs of a boot before not written again (a device gone)
    orphans_removed: list[str] = field(default_factory=list)
    metadata_rebuilt: list[str] = field(default_factory=list)
    metadata_orphans_removed: list[str] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)
    corrupt_checkpoint: str | None = None
    rejected: list[str] = field(default_factory=list)  # entries not valid records, moved aside
    boot_changed: bool = False
    kernel_changed: bool = False  # host changes undone or redone: the inventory read before recovery is stale
    host_restored: list[str] = field(default_factory=list)  # what undoing interrupted prepares put back
    salvaged: list[str] = field(default_factory=list)  # entries a damaged checkpoint still established
    from_memory: list[str] = field(default_factory=list)  # entries taken from the agent's last save instead
    netdevs_lost: list[str] = field(default_factory=list)  # adopted claims whose netdev records are lost
    foreign: list[str] = field(default_factory=list)  # entries a newer sysdra wrote, kept as written


def recover(driver, known: dict[str, dict] | None = None) -> RecoveryReport:
    """Load the checkpoint and make the CDI dir match it. Call before serving. ``known``: the
    entries as this process's last save left the files (``repair``), for a damaged checkpoint."""
    s = driver.settings
    clean_stale_temps(s.plugin_dir, prefix=".checkpoint.json")
    cdifiles.clean_our_temps(s.cdi_dir, s.driver_name)
    fresh = not os.path.lexists(driver.checkpoint_path)  # no snapshot: never saved here, or lost with its dir
    cp = driver.checkpoint = Checkpoint.load(driver.checkpoint_path)
    report = driver.recovery = RecoveryReport(corrupt_checkpoint=cp.corrupt_path, rejected=sorted(map(str, cp.rejected)))
    lost = _lost_entries(cp, known, report)
    report.foreign = sorted(cp.foreign)
    specs = cdifiles.list_claim_specs(s.cdi_dir, s.driver_name)
    _adopt_unrecorded(driver, cp, specs, lost, report, fresh)
    _sweep_orphans(driver, cp, report)  # first: a leftover must not stand where a claim's change is made again
    for uid, entry in list(cp.claims.items()):
        _recover_claim(driver, cp, uid, entry, report)
    for step in driver.steps:
        if (settle := getattr(step, "settle", None)) is not None and not cp.foreign:
            settle(cp.claims)
    _remove_orphan_files(s, cp, specs, report)
    if cp.corrupt_path or cp.rejected or report.rolled_back or report.boot_changed or report.rebuilt or cp.claims:
        cp.save()  # journals what changed (compacts only when due: a full disk must not stop the start)
        driver.saved = Saved.of(cp)
    _log_report(cp, report)
    return report


def _lost_entries(cp: Checkpoint, known: dict[str, dict] | None, report: RecoveryReport) -> dict[str, tuple[dict, str]]:
    """The claims whose entries cannot be used -> (the entry, why): those rejected as invalid and,
    after damage, those neither the files nor ``known`` establish (``_recovered``)."""
    lost = {u: (e, f"its checkpoint entry is not valid ({why}); kept in {cp.rejected_path}")
            for u, (e, why) in cp.rejected.items()}
    if cp.salvage is not None:
        lost.update(_recovered(cp, known or {}, report))
    return lost


def _adopt_unrecorded(driver, cp: Checkpoint, specs: dict[str, str], lost: dict[str, tuple[dict, str]],
                      report: RecoveryReport, fresh: bool) -> None:
    """After a corrupt checkpoint (or for rejected entries), the claims whose spec files exist adopted.
    So are they where there is no checkpoint at all (``fresh``) and yet specs of our claims: a spec is
    written after its claim's entry, so the checkpoint went (the plugin dir wiped, ``kubelet_dir``
    changed while claims were prepared); removed as orphans, their pods' MIG instances were destroyed."""
    lost_all = cp.corrupt_path or (fresh and specs)
    if fresh and specs:
        log.error("no checkpoint at %s, yet the CDI specs of %d prepared claims are in %s (the plugin dir was wiped, or "
                  "kubelet_dir changed while claims were prepared): adopted from their specs, their devices held until "
                  "the kubelet unprepares them", driver.checkpoint_path, len(specs), driver.settings.cdi_dir)
    if lost_all or cp.rejected:
        report.adopted = adopt(driver, cp, {u: p for u, p in specs.items()
                                            if u not in cp.claims and (lost_all or u in cp.rejected)}, lost)
        report.netdevs_lost = [u for u in report.adopted if cp.claims[u].get("netdevsLost")]


def _recover_claim(driver, cp: Checkpoint, uid: str, entry: dict, report: RecoveryReport) -> None:
    """One entry: an interrupted prepare rolled back (a newer sysdra's left to it); a prepared
    claim's changes made again and its files made good (rebuilt after a reboot or a change redone)."""
    if entry["state"] == STARTED and uid in cp.foreign:
        log.warning("claim %s: a newer sysdra's prepare of it was interrupted; its entry (fields %s unknown here) "
                    "is kept for that sysdra, not rolled back; its devices stay held", uid, cp.foreign[uid].fields)
        return
    if entry["state"] == STARTED:
        if _roll_back(driver, cp, uid, entry, report):
            report.rolled_back.append(uid)
        return  # (not rolled back: keep the intent, the next start tries again)
    other_boot = not driver.boot_id or entry.get("bootID") != driver.boot_id  # none readable: maybe (agent/bootid.py)
    report.boot_changed |= other_boot
    rebuild = _make_again(driver, uid, entry, report) or other_boot
    try:
        if driver.files.ensure_spec(uid, entry, rebuild=rebuild, other_boot=other_boot):
            report.rebuilt.append(uid)
        entry["bootID"] = driver.boot_id
    except NotRebuilt as err:  # its bootID stays that of its recorded spec: the kubelet's re-prepare tries again
        log.error("%s", err)
        report.not_rebuilt.append(uid)
    if driver.files.ensure_metadata(uid, entry, rebuild=rebuild):
        report.metadata_rebuilt.append(uid)


def _make_again(driver, uid: str, entry: dict, report: RecoveryReport) -> bool:
    """A prepared claim's host changes that a reboot (or someone) undid made again: whether one was."""
    made = False
    for step in driver.steps:
        if (rec := step.read(entry)) is None:
            continue
        try:  # a reboot (or someone) undid the change: the claim is still prepared
            moved = step.recover(rec)
            report.kernel_changed |= moved
            made |= moved
        except NotRecovered as err:  # kept in the entry, saved below: a later start must know
            log.error("claim %s: %s not made again: %s", uid, step.what, err)
            entry[err.key] = err.record
        except Exception as err:  # noqa: BLE001 - logged; the claim stays prepared, the kubelet's re-prepare retries
            log.error("claim %s: %s not made again: %s", uid, step.what, err)
    return made


def _remove_orphan_files(s, cp: Checkpoint, specs: dict[str, str], report: RecoveryReport) -> None:
    """CDI specs and metadata files of claims no entry records (adopted ones have entries now)."""
    for uid, path in specs.items():
        if uid not in cp.claims:
            cdifiles.remove_spec(path)
            report.orphans_removed.append(uid)
    report.metadata_orphans_removed = metadata.remove_orphans(s, cp.claims)


def _log_report(cp: Checkpoint, report: RecoveryReport) -> None:
    counts = {k: len(v) for k, v in asdict(report).items() if isinstance(v, list) and v}
    log.info("kubelet plugin state recovered: %d claims prepared%s%s%s", len(cp.claims),
             "".join(f", {n} {k.replace('_', ' ')}" for k, n in counts.items()),
             ", after a reboot" if report.boot_changed else "",
             f", corrupt checkpoint moved to {report.corrupt_checkpoint}" if report.corrupt_checkpoint else "")
    log.debug("recovery details: %s", asdict(report))


def repair(driver) -> RecoveryReport:
    """The checkpoint found unreadable while serving (by the NRI plugin or a prepare, holding the
    serialize lock): ``recover`` again, as at start, knowing the entries as this process's newest
    save left the files (the driver's or the NRI plugin's: every move of a netdev is one)."""
    report = recover(driver, last_saved(driver.checkpoint_path))
    if report.kernel_changed:  # the inventory read before is stale
        driver.hardware_changed()
    return report


def _recovered(cp: Checkpoint, known: dict[str, dict], report: RecoveryReport) -> dict[str, tuple[dict, str]]:
    """A damaged checkpoint: beside the entries its files still establish, those of the agent's
    last save (``known``: while serving, the agent's own memory) for every claim the files do not
    establish. -> the claims left uncertain: their entry before the damage, and why."""
    report.salvaged = sorted(cp.claims)
    for uid, entry in known.items():
        if uid not in cp.salvage.certain:
            cp.take(uid, dict(entry))  # a newer sysdra's entry is whole there: kept so again
            report.from_memory.append(uid)
    why = f"the checkpoint was damaged; its last readable entry is in {cp.corrupt_path}"
    return {u: (e, why) for u, e in cp.salvage.stale.items() if u not in cp.claims}


def _sweep_orphans(driver, cp: Checkpoint, report: RecoveryReport) -> None:
    """Host changes no entry knows undone (``orphans``): MIG devices left by a crash or by hand.
    Every entry is known, an interrupted prepare's too (its rollback undoes its own). What no
    claim's record needs once they are recovered (MPS daemons) is each step's ``settle``, after.
    Neither while a newer sysdra's entry is there: what its unknown fields record is not known."""
    if cp.foreign:
        log.warning("%d checkpoint entries of a newer sysdra: leftovers (MIG devices, MPS daemons) no entry records "
                    "are not cleaned up while they are there", len(cp.foreign))
        return
    for step in driver.steps:
        if (sweep := getattr(step, "orphans", None)) is None:
            continue
        try:
            found = sweep(cp.claims)
        except Exception as err:  # noqa: BLE001 - logged; the next start tries again
            log.error("%s: leftovers not cleaned up: %s", step.what, err)
            continue
        report.host_restored += found
        report.kernel_changed |= bool(found)


def _roll_back(driver, cp: Checkpoint, uid: str, entry: dict, report: RecoveryReport) -> bool:
    """An interrupted prepare: its steps undone in reverse, its files removed. False (the entry
    kept) when a step could not put the host back."""
    others = {u: e for u, e in cp.claims.items() if u != uid}
    for step in reversed(driver.steps):
        if (rec := step.read(entry)) is None:
            continue
        try:
            undone = step.undo(rec, others)
        except Exception as err:  # noqa: BLE001 - logged; retried at the next start
            undone = Undone(problems=[str(err)])
        report.kernel_changed |= bool(undone.problems or undone.notes)
        if undone.problems:
            log.error("claim %s: %s not undone yet (%s); retried at the next start", uid, step.what, "; ".join(undone.problems))
            if undone.record is not None:  # what is left to undo (a VFIO write pending): saved with the recovery
                cp.claims[uid] = {**entry, step.key: step.write(undone.record)}
            return False
        report.host_restored += undone.notes
    del cp.claims[uid]
    driver.files.remove(entry, uid, entry.get("namespace", ""), entry.get("name", ""))
    return True


def adopt(driver, cp: Checkpoint, specs: dict[str, str],
          lost: dict[str, tuple[object, str]] | None = None) -> list[str]:
    """After a corrupt checkpoint, keep claims whose valid spec files exist as prepared:
    running containers still reference them and the kubelet will unprepare them. ``lost``: uid ->
    (its entry that cannot be used, why): one that had netdevs keeps its pods, to be refused."""
    kind = claim_kind(driver.settings.driver_name)
    adopted = []
    for uid, path in specs.items():
        try:
            spec = cdifiles.read_spec(path)
        except SpecError as err:
            log.error("removing unreadable CDI spec %s", err)
            continue  # left as orphan: removed below
        prefix = cdi_device_name(uid, "")
        devices = [
            {"requests": [], "pool": driver.settings.node_name, **shares.split_key(d["name"][len(prefix):]),
             "cdiDeviceIDs": [f"{kind}={d['name']}"]}
            for d in spec["devices"] if d["name"].startswith(prefix)
        ]
        entry = cp.claims[uid] = {"state": COMPLETED, "namespace": "", "name": "", "bootID": driver.boot_id,
                                  "allocation": "", "devices": devices, "cdiSpec": {"path": path, "spec": spec},
                                  **_netdevs_lost(uid, *(lost or {}).get(uid, (None, "")))}
        for step in driver.steps:  # what a step can tell again from the devices and spec (MIG placements, MPS daemons)
            if (known := getattr(step, "adopted", None)) is not None and (rec := known([d["device"] for d in devices], spec)):
                entry[step.key] = step.write(rec)
        adopted.append(uid)
    return adopted


def _netdevs_lost(uid: str, entry: object, why: str) -> dict:
    """An adopted claim's mark when the entry it lost had netdevs: where they are cannot be told
    (in a pod or back on the host), so its pods are refused (agent/nri/netdev.py) and nothing moves."""
    if not isinstance(entry, dict) or not entry.get("netdevs"):
        return {}
    pods = entry.get("pods")
    pods = [p for p in pods if isinstance(p, str) and is_uid(p)] if isinstance(pods, list) else []
    log.error("claim %s (%s/%s): its netdev records are lost: %s. Its pods (%s) are refused until it is unprepared; "
              "its netdevs are not moved", uid, str(entry.get("namespace"))[:80], str(entry.get("name"))[:80], why,
              ", ".join(pods) or "none known")
    return {"pods": pods, "netdevsLost": why[:1024]}
