"""A prepared claim's files, driven by its checkpoint entry: the CDI spec (rebuilt from the
current inventory and the steps' view of the host when missing or after a reboot), the
KEP-5304 metadata files, and their removal. Paths derive from the claim's UID and checked
names; a path recorded in the checkpoint is removed only when it names one of our files
directly in the CDI dir."""

from __future__ import annotations

import logging
import os
from typing import Callable

from agent.fsutil import UnsafePath
from agent.names import InvalidName
from agent.prepare import cdifiles, shares
from agent.prepare.allocation import ClaimFailed
from agent.prepare.checkpoint import Checkpoint
from agent.prepare.metadata import layout, store as metadata
from agent.settings import Settings
from cdi.claim import build_claim_spec
from cdi.nodegroup import group_reader
from cdi.spec import SpecError
from discovery import gpuways
from discovery.models import Device, Inventory

log = logging.getLogger("agent.prepare.driver")


class NotRebuilt(Exception):
    """A claim's spec that cannot be rebuilt in this boot: none is written (``ensure_spec``)."""


class DevicesGone(NotRebuilt):
    """A claim's devices that are not on the node now: its spec cannot be rebuilt."""

    def __init__(self, uid: str, names: list[str]):
        super().__init__(f"claim {uid}: {', '.join(names)} not on this node since it rebooted (fallen off the bus, or "
                         "its driver not bound yet): the device numbers its CDI spec recorded in the boot before may "
                         "be another device's now, so none is written; its pods start once the device is back, or "
                         "the claim is unprepared")
        self.names = names


class ClaimFiles:
    def __init__(self, settings: Settings, inventory: Callable[[], Inventory], steps: list,
                 checkpoint: Callable[[], Checkpoint | None], nvidia=None, ways: Callable[[], dict] = dict):
        self.settings, self.inventory, self.steps, self.checkpoint = settings, inventory, steps, checkpoint
        self.nvidia = nvidia  # prepare/nvidia.py: the NVIDIA user-space driver's claim-wide edits
        self.ways = ways  # device name -> discovery.gpuways.Way, of the inventory now

    def spec_path(self, uid: str) -> str:
        return cdifiles.claim_spec_path(self.settings.cdi_dir, self.settings.driver_name, uid)

    def claim_spec(self, uid: str, entry: dict, by_name: dict[str, Device]) -> dict:
        """The claim's CDI spec from the inventory, each device as the steps' host changes show
        it now (VFIO functions: their group nodes). DevicesGone for devices no longer there."""
        # a partition way is not in the inventory by name: its step gives it (dynamic MIG, an AMD partition)
        devices = {d["device"]: by_name[d["device"]] for d in entry["devices"] if d["device"] in by_name}
        for step in self.steps:
            if (rec := step.read(entry)) is not None:
                devices.update(step.devices_now(rec, devices))
        ways = self.ways()
        for name in {d["device"] for d in entry["devices"]} - devices.keys():
            if (way := ways.get(name)) is not None and way.kind == "mig":  # static MIG: the instance as scanned now
                devices[name] = gpuways.way_device(way)
            elif way is not None and way.kind == "mig-placement":  # admin access beside the claim that made it
                for placed in (p for step in self.steps if (p := getattr(step, "placed", None)) is not None):
                    devices.update(placed(name))
        if gone := sorted({d["device"] for d in entry["devices"]} - devices.keys()):
            raise DevicesGone(uid, gone)
        recorded = [(shares.recorded(devices[d["device"]], d), d.get("shareID")) for d in entry["devices"]]
        if self.nvidia:
            served = (entry.get("mps") or {}).get("gpus") or ()
            recorded = [(self.nvidia.with_mps(c, share, served), share) for c, share in recorded]
        devs = list({c.key: c for c, _ in recorded}.values())
        edits = self.nvidia.claim_edits([c.device for c in devs]) if self.nvidia else None
        return build_claim_spec(self.settings.driver_name, uid, devs, self.settings.root, edits,
                                group_reader(self.settings.cdi_additional_gids))

    def remove(self, entry: dict | None, uid: str, namespace: str, name: str) -> None:
        """The claim spec, the metadata specs and the metadata directory (which is keyed by
        namespace/name: kept if another prepared claim, a recreated one, uses it)."""
        self._remove_spec(entry, uid)
        cp = self.checkpoint()
        shared = cp is not None and any(
            u != uid and (e.get("namespace"), e.get("name")) == (namespace, name) for u, e in cp.claims.items())
        metadata.remove_claim(self.settings, uid, namespace, name, keep_dir=shared,
                              requests=((entry or {}).get("metadata") or {}).get("requests") or ())

    def _remove_spec(self, entry: dict | None, uid: str) -> None:
        # The uid's own spec path, also for unknown claims (e.g. adopted after a corrupt checkpoint).
        cdifiles.remove_spec(self.spec_path(uid))
        recorded = ((entry or {}).get("cdiSpec") or {}).get("path")
        if recorded and recorded != self.spec_path(uid):
            if cdifiles.is_ours(self.settings.cdi_dir, self.settings.driver_name, recorded, uid):
                cdifiles.remove_spec(recorded)
            elif self._before(recorded, uid):  # cdi_dir changed while the claim was prepared: its files there go
                old = os.path.dirname(recorded)
                log.info("claim %s: its CDI specs in %s (cdi_dir before it changed) removed", uid, old)
                for path in [recorded, *layout.list_specs(old, self.settings.driver_name).get(uid, ())]:
                    cdifiles.remove_spec(path)
            else:  # a checkpoint we did not write: not ours to delete
                log.warning("claim %s: leaving %s (recorded in the checkpoint, not our file in %s)",
                            uid, recorded, self.settings.cdi_dir)

    def _before(self, recorded: object, uid: str) -> bool:
        """Whether a recorded spec path is this claim's spec by its name, in another absolute dir: the
        cdi_dir of before (the checkpoint is input: a path of any other name is never removed)."""
        return (isinstance(recorded, str) and os.path.isabs(recorded) and os.path.normpath(recorded) == recorded
                and os.path.basename(recorded) == os.path.basename(self.spec_path(uid)))

    def ensure_spec(self, uid: str, entry: dict, rebuild: bool = False, other_boot: bool = False) -> bool:
        """Write a completed claim's spec if missing, unreadable or ``rebuild``; True if written.
        ``other_boot``: the recorded spec is of a boot before (its device numbers mean nothing now):
        never written again; where it cannot be rebuilt, the spec is removed and NotRebuilt raised
        (DevicesGone for a device gone)."""
        spec = entry.get("cdiSpec")
        if not spec:
            return False
        if spec["path"] != self.spec_path(uid):  # never write where the checkpoint says: derive it
            self._remove_spec(entry, uid)
            spec["path"] = self.spec_path(uid)
            rebuild = True
        if not rebuild and not other_boot:
            try:
                if cdifiles.read_spec(spec["path"]) == spec["spec"]:
                    return False
                # valid, yet not what was written (a flipped byte can name another device): written again
                log.warning("claim %s: CDI spec %s differs from the one recorded: written again", uid, spec["path"])
            except SpecError:
                pass
        content = spec["spec"]
        try:  # rebuild from the current inventory: device numbers can change across reboots
            content = self.claim_spec(uid, entry, self.inventory().by_name())
        except Exception as err:  # noqa: BLE001 - a device gone, a step's view unreadable
            if other_boot:  # never the numbers of a boot before: they may name another claim's device now
                cdifiles.remove_spec(spec["path"])
                if isinstance(err, NotRebuilt):
                    raise
                raise NotRebuilt(f"claim {uid}: its CDI spec cannot be rebuilt since the node rebooted: {err}") from err
            log.warning("claim %s: rebuilding CDI spec from the recorded one (%s)", uid, err)  # this boot's numbers
        try:
            cdifiles.write_spec(spec["path"], content)
        except OSError as err:  # (a directory where the file should be): this claim's alone, the others go on
            log.error("claim %s: cannot rewrite its CDI spec: %s", uid, err)
            return False
        spec["spec"] = content
        return True

    def again(self, uid: str, entry: dict, moved: bool, boot_id: str) -> tuple[bool, dict]:
        """A re-prepare's spec: rebuilt where a step made its change again (``moved``), or where the
        recorded spec is of a boot before (not rebuilt at start: a device was gone) -> (whether the
        entry changed, the entry: a new one taking this boot). ClaimFailed while it cannot be rebuilt."""
        other_boot = entry.get("bootID") != boot_id
        try:
            written = self.ensure_spec(uid, entry, rebuild=moved or other_boot, other_boot=other_boot)
        except NotRebuilt as err:
            raise ClaimFailed(str(err)) from None
        return written or other_boot, ({**entry, "bootID": boot_id} if other_boot else entry)

    def ensure_metadata(self, uid: str, entry: dict, rebuild: bool) -> bool:
        """Missing metadata files are rewritten (higher generation); after a reboot all, from the inventory."""
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
