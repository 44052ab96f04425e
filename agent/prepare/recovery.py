"""Start-up reconciliation of the driver's state: the checkpoint is the truth about what we
created; make the CDI dir, the metadata files and the kernel (VFIO bindings) match it.

Prepared-but-interrupted claims (PrepareStarted) are rolled back, including giving VFIO
functions back; prepared claims get their files rebuilt after a reboot (device numbers
change) and their VFIO functions re-bound; orphans are removed; after a corrupt checkpoint,
claims whose spec files exist are adopted."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

from agent.fsutil import clean_stale_temps
from agent.prepare import cdifiles, shares, vfio
from agent.prepare.checkpoint import COMPLETED, STARTED, Checkpoint
from agent.prepare.metadata import store as metadata
from agent.prepare.vfio import VfioError
from cdi.claim import cdi_device_name
from cdi.spec import SpecError, claim_kind

log = logging.getLogger("agent.prepare.driver")


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
    kernel_changed: bool = False  # VFIO functions moved: the inventory read before recovery is stale
    modes_restored: list[str] = field(default_factory=list)  # GPU mode switches undone (prepare/partitions.py)


def recover(driver) -> RecoveryReport:
    """Load the checkpoint and make the CDI dir match it. Call before serving."""
    s = driver.settings
    clean_stale_temps(s.plugin_dir, prefix=".checkpoint.json")
    cdifiles.clean_our_temps(s.cdi_dir, s.driver_name)
    cp = driver.checkpoint = Checkpoint.load(driver.checkpoint_path)
    report = driver.recovery = RecoveryReport(corrupt_checkpoint=cp.corrupt_path)
    specs = cdifiles.list_claim_specs(s.cdi_dir, s.driver_name)
    if cp.corrupt_path:
        report.adopted = adopt(driver, cp, specs)
    for uid, entry in list(cp.claims.items()):
        if entry["state"] == STARTED:
            if entry.get("vfio"):
                report.kernel_changed = True
                if vfio.restore_all(driver.kernel, entry["vfio"]):
                    log.error("claim %s: VFIO functions not given back yet; retried at the next start", uid)
                    continue  # keep the intent: the next start tries again
            if driver.partitions and (undone := driver.partitions.recover(entry, cp.claims)):
                report.modes_restored.append(undone)
                report.kernel_changed = True
            del cp.claims[uid]
            driver.remove_files(entry, uid, entry.get("namespace", ""), entry.get("name", ""))
            report.rolled_back.append(uid)
            continue
        rebooted = entry.get("bootID") != driver.boot_id
        report.boot_changed |= rebooted
        if entry.get("vfio"):
            try:  # a reboot (or someone) gave the functions back: the claim is still prepared
                moved = vfio.ensure_bound(driver.kernel, entry["vfio"])
                report.kernel_changed |= moved
                rebooted |= moved
            except VfioError as err:
                log.error("claim %s: VFIO functions not on vfio-pci: %s", uid, err)
        if driver.ensure_spec(uid, entry, rebuild=rebooted):
            report.rebuilt.append(uid)
        if driver.ensure_metadata(uid, entry, rebuild=rebooted):
            report.metadata_rebuilt.append(uid)
        entry["bootID"] = driver.boot_id
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

def adopt(driver, cp: Checkpoint, specs: dict[str, str]) -> list[str]:
    """After a corrupt checkpoint, keep claims whose valid spec files exist as prepared:
    running containers still reference them and the kubelet will unprepare them."""
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
        cp.claims[uid] = {"state": COMPLETED, "namespace": "", "name": "", "bootID": driver.boot_id,
                          "allocation": "", "devices": devices, "cdiSpec": {"path": path, "spec": spec}}
        adopted.append(uid)
    return adopted
