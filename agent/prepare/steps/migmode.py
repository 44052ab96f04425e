"""MIG mode off for a claim of a whole NVIDIA GPU, as a step (docs/partitions.md, "The whole
GPU of a GPU in MIG mode"): the whole GPU of a GPU in MIG mode is no CUDA device (CUDA sees MIG
devices only), so a claim of it, or of a share of it (time-slicing, MPS), needs MIG mode off.

Which GPUs: those whose NVML lists MIG profiles (discovery reads them with or without
``--partitions``). Not for a result with admin access (monitoring beside the GPU's other
claims: it takes the GPU as it is) nor for a ``VfioConfig`` device (the VM's driver owns it).

Record (``migMode``): one ``MigModeOff`` per GPU whose MIG mode is on (or pending on), or was
turned off by another claim of the whole GPU that still holds it, saved durably in
the PrepareStarted entry before NVML is asked. A GPU found off gets none: nothing to change or
give back, and the entry stays one an agent from before this step reads (it moves an entry
with a key it does not know aside, the claim's MPS and time-slice records with it; nearly every
whole-GPU claim of an H100/H200 finds MIG mode off). ``restore``: the mode the GPU is to have
was on (pending on: on now, or after the next reset), or another claim that turned it off hands
that on; an operator's off pending a reset (on now, pending off) is not. ``plan`` refuses what cannot work
before anything is written: MIG mode on without ``nvidia_mig_enable`` (the setting lets the
agent turn MIG mode on for a MIG device and off for the whole GPU), or a GPU instance on the
GPU (someone's; NVML refuses the change). ``apply`` turns it off (a mode left pending until a
GPU reset fails the claim, and is set back); ``undo`` (a later failure, unprepare, an
interrupted prepare at start) turns it back on when ``restore`` says it was and no other claim
of the whole GPU still needs it off; ``recover`` turns it off again where it is on (someone,
or a reboot that took a pending mode, turned it on under a prepared claim). Every NVML call
runs on NVML's own thread (prepare/mig.py)."""

from __future__ import annotations

from typing import Callable

from agent.prepare.claimconfig import VfioConfig, config_for
from agent.prepare.mig import MigDevices
from agent.prepare.ownership import Hold, Ownership
from agent.prepare.records import MigModeOff
from agent.prepare.steps import NotUndone, Planned, RecordsOf, Undone
from discovery.models import Device, Inventory

Record = tuple[MigModeOff, ...]


def mig_capable(dev: Device | None) -> bool:
    """A GPU whose NVML lists MIG profiles: its MIG mode can be read and changed."""
    pt = dev.gpu.partitioning if dev is not None and dev.gpu is not None else None
    return pt is not None and pt.kind == "mig" and bool(pt.profiles)


def _refused(owners: Ownership, uid: str, gpus: set[str]) -> set[str]:
    """The GPUs whose MIG devices (or vfio-pci binding) other claims hold: the claim is refused
    for that (ownership.py, after the steps plan), so NVML is not asked about them."""
    return {bdf for bdf in gpus for hs in owners.holders(bdf, but=uid).values()
            if any(h.how in ("partition", "vfio") and not h.admin for h in hs)}


class MigModeStep(RecordsOf):
    model = MigModeOff
    key = "migMode"
    what = "MIG mode"  # the stage named in a claim error

    def __init__(self, devices: MigDevices, inventory: Callable[[], Inventory]):
        self.devices = devices
        self.inventory = inventory

    def _needing(self, entries: dict[str, dict]) -> set[str]:
        """The GPUs other claims of the whole GPU need MIG mode off on."""
        return {r.gpu for e in entries.values() for r in (self.read(e) or ())}

    def plan(self, planned: Planned, owners: Ownership) -> Record | None:
        gpus = {dev.pci.bdf for r in planned.results
                if not r.admin and mig_capable(dev := planned.inventory.get(r.device))
                and not isinstance(config_for(planned.configs, r.request, dev.kind, dev.name), VfioConfig)}
        if not gpus:
            return None
        # the mode before the claims of the whole GPU: one of them that turned it off hands that on
        turned = {r.gpu for e in planned.others.values() for r in (self.read(e) or ()) if r.restore}
        out = []
        for bdf in sorted(gpus - _refused(owners, planned.uid, gpus)):
            mode = self.devices.check_off(bdf)  # ClaimFailed: on, and the agent may not or cannot turn it off
            if self.devices.needs_off(mode) or bdf in turned:  # found off: nothing to record (an older agent reads it)
                # what to give back is the mode the GPU is to have (pending): an operator's off pending a reset is kept
                out.append(MigModeOff(gpu=bdf, restore=mode is not None and mode[1] == 1 or bdf in turned))
        return tuple(out) or None

    def adopted(self, names: list[str], spec: dict) -> Record | None:
        """An adopted claim's GPUs (its record lost with a corrupt checkpoint): kept off while it
        holds them; the mode before it is unknown, so never turned back on for it."""
        by_name = self.inventory().by_name()
        gpus = sorted({dev.pci.bdf for n in names if mig_capable(dev := by_name.get(n))})
        return tuple(MigModeOff(gpu=bdf, restore=False) for bdf in gpus) or None

    def holds(self, record: Record) -> list[Hold]:
        return []  # the whole GPU is held as such (planner.device_holds)

    def apply(self, planned: Planned, record: Record) -> tuple[Record, dict[str, Device]]:
        done = 0
        try:
            for rec in record:
                self.devices.turn_off(rec.gpu)
                done += 1
        except Exception as err:  # the failing GPU's mode may be left pending off: set back too
            if (undone := self.undo(record[:done + 1], planned.others)).problems:
                raise NotUndone(err, undone.problems) from err
            raise
        return record, {}

    def undo(self, record: Record, others: dict[str, dict]) -> Undone:
        undone = Undone()
        needed = self._needing(others)
        for rec in record:
            if not rec.restore or rec.gpu in needed:
                continue
            try:
                if self.devices.turn_on(rec.gpu):
                    undone.notes.append(f"{rec.gpu}: MIG mode back on")
            except Exception as err:  # noqa: BLE001 - the claim keeps its entry; retried
                undone.problems.append(str(err))
        return undone

    def recover(self, record: Record) -> bool:
        """Off again where it is on under a prepared claim; ClaimFailed when it may not be."""
        return any([self.devices.turn_off(rec.gpu) for rec in record])

    def devices_now(self, record: Record, devices: dict[str, Device]) -> dict[str, Device]:
        return {}  # the whole GPU's nodes are the same in either mode
