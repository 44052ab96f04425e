"""Dynamic MIG as a step (``--partitions`` on a GPU whose NVML lists MIG profiles,
docs/partitions.md): the claim's MIG devices created at prepare, destroyed at unprepare.

Record (``mig``): one ``MigDevice`` per MIG device of the claim (GPU, profile, placement),
saved durably in the PrepareStarted entry before NVML is asked; the GPU and compute instance
IDs are added once created. ``apply`` creates them in order (a failure destroys what this
claim created: the devices done here, the one failing in ``MigDevices.create``, queued behind
its create on NVML's thread when NVML did not answer in time); ``undo`` (a later failure,
unprepare, an interrupted prepare at start) destroys them, found by placement, so a crash
between NVML's create and the checkpoint leaves nothing behind; ``recover`` creates a prepared
claim's instance again after a reboot (GPU instances do not survive one), and ``orphans``
destroys, at start, every instance of a dynamic-MIG GPU that no checkpoint entry knows.

Holds: each memory slice a placement covers, so two claims whose placements overlap are
refused before NVML is asked (defence in depth behind the allocator's counters)."""

from __future__ import annotations

import logging
import re
from typing import Callable

from agent.prepare.allocation import ClaimFailed
from agent.prepare.mig import MigDevices
from agent.prepare.ownership import Hold, Ownership
from agent.prepare.records import MigDevice
from agent.prepare.steps import NotUndone, Planned, RecordsOf, Undone
from discovery import gpuways
from discovery.attributes import _value
from discovery.models import Device

log = logging.getLogger(__name__)
Record = tuple[MigDevice, ...]
_STATIC = re.compile(r"^(.+)-mig-gi(\d+)-ci\d+$")  # an operator's instance as static MIG names it


class MigStep(RecordsOf):
    model = MigDevice
    key = "mig"
    what = "MIG device"  # the stage named in a claim error

    def __init__(self, devices: MigDevices, ways: Callable[[], dict], destroyed: Callable[[], None] = lambda: None):
        self.devices = devices
        self.ways = ways  # device name -> discovery.gpuways.Way, of the inventory now
        # after an undo destroyed instances; with partitions off the daemon rescans: the whole GPU is published again
        self.destroyed = destroyed

    def plan(self, planned: Planned, owners: Ownership) -> Record | None:
        for name in {r.device for r in planned.results if r.admin}:
            self._beside(planned, name)
        return _records(planned.ways, [r.device for r in planned.results if not r.admin])

    def _beside(self, planned: Planned, name: str) -> None:
        """Admin access to a MIG device (monitoring beside its claim): the instance that claim made,
        as it is now, in ``planned.names``; admin access makes no instance and destroys none."""
        if (found := _records(planned.ways, [name])) is None:
            return
        rec = found[0]
        if (now := self.devices.find(rec)) is None or not now.cis:
            raise ClaimFailed(f"admin access to MIG device {name}: no MIG instance is at its placement "
                              "(admin access uses the one a claim made, and makes none)")
        planned.names.update(self._device(rec, planned.names.get(name), now.gi, now.cis[0]))

    def adopted(self, names: list[str], spec: dict) -> Record | None:
        """An adopted claim's MIG devices (prepare/recovery.py: its record was lost with a
        corrupt checkpoint), known again by their placements: they hold their memory slices,
        ``orphans`` spares them and unprepare destroys them, found by placement."""
        return _records(self.ways(), names)

    def holds(self, record: Record) -> list[Hold]:
        return [Hold(r.gpu, "partition", unit=f"MIG memory slice {i}") for r in record for i in range(r.start, r.start + r.size)]

    def _device(self, rec: MigDevice, base: Device | None, gi: int, ci: int) -> dict[str, Device]:
        if base is None and (way := self.ways().get(rec.device)) is not None:
            base = gpuways.way_device(way)
        if base is None or base.gpu is None or base.gpu.nvidia_minor is None:
            return {}
        caps = self.devices.cap_nodes(base.gpu.nvidia_minor, gi, ci)
        attrs = dict(base.attributes, migGpuInstance=_value("int_", gi), migComputeInstance=_value("int_", ci))
        nodes = tuple(n for n in base.device_nodes if not n.path.startswith("/dev/nvidia-caps/")) + caps
        return {rec.device: base.replace(device_nodes=nodes, attributes=attrs)}

    def apply(self, planned: Planned, record: Record) -> tuple[Record, dict[str, Device]]:
        done: list[MigDevice] = []
        devices: dict[str, Device] = {}
        try:
            for rec in record:
                made = self.devices.create(rec)
                done.append(made)
                devices.update(self._device(made, planned.names.get(rec.device), made.gi, made.ci))
        except Exception as err:
            problems = self.undo(tuple(done), {}).problems
            if isinstance(err, NotUndone):  # the failing device's own destroy failed (MigDevices.create)
                raise NotUndone(err.err, err.problems + problems) from err.err
            if problems:
                raise NotUndone(err, problems) from err
            raise
        return tuple(done) + record[len(done):], devices

    def undo(self, record: Record, others: dict[str, dict]) -> Undone:
        undone = Undone()
        kept = placements_recorded(others)  # another claim's too (two adopted claims of one instance): the last destroys
        for rec in reversed(record):
            if (rec.gpu, rec.profile, rec.start) in kept:
                continue
            try:
                if self.devices.destroy(rec):
                    undone.notes.append(f"{rec.gpu}: MIG device {rec.device} destroyed")
            except Exception as err:  # noqa: BLE001 - the claim keeps its entry; retried
                undone.problems.append(str(err))
        if undone.notes:
            self.destroyed()
        return undone

    def recover(self, record: Record) -> bool:
        """A prepared claim's instances made again where they are gone (after a reboot)."""
        moved = False
        for rec in record:
            if (now := self.devices.find(rec)) is None or not now.cis:  # a reboot, or a crash halfway through a destroy
                log.warning("GPU %s: MIG device %s is gone or has no compute instance: creating it again", rec.gpu, rec.device)
                if now is not None:
                    self.devices.destroy(rec)
                try:
                    self.devices.create(rec)
                except NotUndone as err:  # the claim keeps its record: its unprepare destroys what is left
                    raise ClaimFailed(str(err)) from None
                moved = True
        return moved

    def devices_now(self, record: Record, devices: dict[str, Device]) -> dict[str, Device]:
        out: dict[str, Device] = {}
        for rec in record:
            if (now := self.devices.find(rec)) is not None and now.cis:
                out.update(self._device(rec, devices.get(rec.device), now.gi, now.cis[0]))
        return out

    def placed(self, name: str) -> dict[str, Device]:
        """A placement's device as its instance is now, for a spec rebuilt after a reboot of a claim
        with admin access beside the claim that made it (no record of its own); none where none is."""
        if (found := _records(self.ways(), [name])) is None or (now := self.devices.find(found[0])) is None or not now.cis:
            return {}
        return self._device(found[0], None, now.gi, now.cis[0])

    def orphans(self, entries: dict[str, dict]) -> list[str]:
        """At start (after interrupted prepares are rolled back): destroy the instances of every
        dynamic-MIG GPU that no entry records."""
        placements = [w for w in self.ways().values() if w.kind == "mig-placement"]
        gpus = {w.parent.pci.bdf: tuple(p.id for p in w.parent.gpu.partitioning.profiles) for w in placements}
        return self.devices.orphans(gpus, placements_recorded(entries), _claimed(entries, placements)) if gpus else []


def placements_recorded(entries: dict[str, dict]) -> set[tuple[str, int, int]]:
    """(GPU, profile, placement start) of every MIG device the checkpoint's entries record."""
    return {(r.gpu, r.profile, r.start) for e in entries.values() for r in map(MigDevice.model_validate, e.get(MigStep.key) or ())}


def _claimed(entries: dict[str, dict], placements: list) -> set[tuple[str, int]]:
    """(GPU's PCI address, GI ID) of ``claimed_instances``."""
    bdfs = {w.parent.name: w.parent.pci.bdf for w in placements}
    return {(bdfs[gpu], gi) for gpu, gi in claimed_instances(entries) if gpu in bdfs}


def claimed_instances(entries: dict[str, dict]) -> set[tuple[str, int]]:
    """(GPU's device name, GI ID) of the operator's instances that claims hold: prepared with
    ``nvidia_mig: static`` (``<gpu>-mig-gi<G>-ci<C>``, discovery/gpuways.py), the setting since turned dynamic."""
    found = (_STATIC.match(str(d.get("device"))) for e in entries.values() for d in e.get("devices") or ())
    return {(m[1], int(m[2])) for m in found if m}


def _records(ways: dict, names: list[str]) -> Record | None:
    out = [MigDevice(gpu=way.parent.pci.bdf, device=way.name, profile=way.profile.id, start=way.start, size=way.size)
           for name in names if (way := ways.get(name)) is not None and way.kind == "mig-placement"]
    return tuple(out) or None
