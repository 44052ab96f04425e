"""GPU partitions as a step (``--partitions``, docs/partitions.md): the claim's partition and
MIG devices for its spec, and an AMD compute mode switch when its partitions need one (never
of the memory mode: amdgpu applies that at a driver reload, agent/prepare/partitions.py).

Record (``partitions``): a ``PartitionUse``, the mode each GPU runs in for this claim and,
until the prepare completes, the switch's intent (GPU, from, to), saved durably before the
first kernel write. ``apply`` switches and reads the new mode's partitions afresh; a failure
writes the previous compute mode back. ``undo`` (a later failure, or an interrupted prepare at start)
puts the previous mode back unless a prepared claim runs the GPU in the new one. ``recover`` (at
start, on the kubelet's re-prepare) puts a prepared claim's GPU in its mode again: amdgpu comes up
in its default mode after a reboot, where partition 0 is the whole GPU and the others are gone."""

from __future__ import annotations

from typing import Callable

from agent.prepare.ownership import Hold, Ownership, entry_name
from agent.prepare.partitions import NotRestored, Partitions
from agent.prepare.records import COMPLETED, PartitionUse
from agent.prepare.steps import Planned, RecordOf, Undone
from discovery import gpuways
from discovery.models import Device


class PartitionStep(RecordOf):
    model = PartitionUse
    key = "partitions"
    what = "GPU mode switch"  # the stage named in a claim error

    def __init__(self, partitions: Partitions, changed: Callable[[], None]):
        self.partitions = partitions
        self.changed = changed  # the hardware changed: the daemon rescans and republishes

    def _others(self, claims: dict[str, dict], but: str = "") -> dict[str, tuple[str, PartitionUse]]:
        return {u: (entry_name(e), rec) for u, e in claims.items()
                if u != but and (rec := self.read(e)) is not None}

    def plan(self, planned: Planned, owners: Ownership) -> PartitionUse | None:
        devices, record = self.partitions.plan(planned.uid, planned.results, self._others(planned.others, planned.uid),
                                               planned.ways)
        planned.names = {**planned.names, **devices} if devices else planned.names
        return record

    def holds(self, record: PartitionUse) -> list[Hold]:
        return []  # each partition device is held as such (Driver.holds), with the mode it needs

    def apply(self, planned: Planned, record: PartitionUse) -> tuple[PartitionUse, dict[str, Device]]:
        if record.switch is None:
            return record, {}
        try:
            pt = self.partitions.switch(record.switch)
        finally:
            self.changed()
        return PartitionUse(uses=record.uses), self.partitions.devices_after(pt, planned.results, planned.ways)

    def undo(self, record: PartitionUse, others: dict[str, dict]) -> Undone:
        if record.switch is None:
            return Undone()
        prepared = {u: rec for u, (_, rec) in self._others(others).items() if others[u].get("state") == COMPLETED}
        try:
            note = self.partitions.undo(record.switch, prepared)
        except NotRestored as err:  # not back: the entry and its intent stay, the undo is retried
            return Undone(problems=[f"GPU {record.switch.gpu}: {err}"])
        return Undone(notes=[note] if note else [])

    def recover(self, record: PartitionUse) -> bool:
        """The claim's GPUs in its mode again (amdgpu forgets a compute mode across a reboot: partition
        0 would be the whole GPU, the others gone); ClaimFailed where that cannot be."""
        switched = [note for bdf, mode in sorted(record.uses.items()) if (note := self.partitions.ensure(bdf, mode))]
        if switched:
            self.changed()
        return bool(switched)

    def devices_now(self, record: PartitionUse, devices: dict[str, Device]) -> dict[str, Device]:
        """The partitions of the claim's GPUs, with the nodes the kernel shows now (a spec rebuilt after a
        reboot), of each GPU that runs in the claim's mode (in another, its partitions are not there)."""
        out: dict[str, Device] = {}
        for bdf, mode in record.uses.items():
            ways = [w for w in self.partitions.ways().values() if w.kind == "amd" and w.parent.pci.bdf == bdf and w.mode == mode]
            pt = self.partitions.read(ways[0].parent)[0] if ways else None
            if pt is not None and f"{pt.compute_mode}/{pt.memory_mode or 'NPS1'}" == mode:
                out.update((w.name, gpuways.way_device(w, now=pt)) for w in ways)
        return out


def gpus_in_use(entries: dict[str, dict]) -> frozenset[str]:
    """The PCI addresses of the GPUs whose partitions the (typed) checkpoint entries use."""
    return frozenset(bdf for e in entries.values() for bdf in ((e.get("partitions") or {}).get("uses") or {}))
