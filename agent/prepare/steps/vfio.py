"""VFIO passthrough as a step (docs/vfio.md): a claim whose config asks for it (``VfioConfig``)
gets its PCI functions moved to vfio-pci and given back on unprepare.

Record (``vfio``): one ``VfioFunction`` per function, its original driver and
``driver_override``, in the PrepareStarted entry, durably, before the first kernel write. A
failure at any point gives every function of the claim back; start-up recovery gives back the
functions of a claim that was being prepared and re-binds those of a prepared claim after a
reboot (the kernel forgets bindings), after the checks of a prepare. Unprepare gives the
functions back *before* the claim leaves the checkpoint, so a crash in between is repaired by
the kubelet's retry; a give-back whose write does not return leaves the record ``pending``
(``Undone.record``). A function held by another claim in any way, or one of its IOMMU group's,
is refused (ownership.py), and the claim holds the rest of the group too; so is a NIC whose
netdev the host uses, unless the node and the claim allow it (prepare/hostuse.py)."""

from __future__ import annotations

import functools
import logging
from typing import Callable

from agent.prepare import hostuse, vfio
from agent.prepare.ownership import Hold, Ownership
from agent.prepare.records import VfioFunction
from agent.prepare.steps import NotRecovered, NotUndone, Planned, RecordsOf, Undone
from agent.prepare.vfio_kernel import KernelError, PciKernel
from discovery.models import Device, Inventory

Record = tuple[VfioFunction, ...]
log = logging.getLogger(__name__)


class VfioStep(RecordsOf):
    model = VfioFunction
    key = "vfio"
    what = "VFIO binding"  # the stage named in a claim error

    def __init__(self, root: str, driver_name: str, kernel: PciKernel, fault: Callable[[str], None], inventory: Callable[[], Inventory],
                 host_netns: Callable[[], str] = lambda: "/proc/self/ns/net", allow_host_in_use: bool = False):
        self.root, self.driver_name, self.kernel, self.fault = root, driver_name, kernel, fault
        self.host_netns, self.allow_host_in_use = host_netns, allow_host_in_use  # whose netdevs the host uses
        self.inventory = inventory  # for an adopted claim's functions

    def plan(self, planned: Planned, owners: Ownership) -> Record | None:
        configs = vfio.functions(planned.claim, self.driver_name, planned.results, planned.inventory, planned.names)
        if not configs:
            return None
        in_use = {bdf for bdf in owners.held() if owners.holders(bdf, but=planned.uid)}
        return tuple(vfio.plan(self.root, self.kernel, list(configs), in_use,
                               lambda bdf: self._host_uses(bdf, configs[bdf].allowHostInUse)))

    def _host_uses(self, bdf: str, claim_allows: bool) -> str | None:
        netns = functools.partial(hostuse.namespace, self.root, self.host_netns)
        return vfio.host_used(self.root, netns, bdf, self.allow_host_in_use, claim_allows)

    def adopted(self, names: list[str], spec: dict) -> Record | None:
        """An adopted claim's functions (prepare/recovery.py, its record lost) that the agent's bind moved:
        on vfio-pci with its ``driver_override``. Their unprepare gives them to the kernel's match."""
        by_name = self.inventory().by_name()
        bdfs = sorted({dev.pci.bdf for n in names if (dev := by_name.get(n)) is not None and dev.pci is not None})
        try:
            out = [VfioFunction(bdf=bdf, group=group, probe=True) for bdf in bdfs if self.kernel.present(bdf)
                   and self.kernel.driver(bdf) == self.kernel.override(bdf) == vfio.VFIO_DRIVER
                   and (group := self.kernel.group(bdf)) is not None]
        except KernelError as err:  # the claim stays adopted; its functions are left as they are
            log.error("VFIO: the functions of an adopted claim not read (%s): they stay on vfio-pci after it", err)
            return None
        return tuple(out) or None

    def holds(self, record: Record) -> list[Hold]:
        """Each function and the rest of its IOMMU group (bridges aside): the VM has the group."""
        own = {r.bdf: Hold(r.bdf, "vfio") for r in record}
        members = {}
        for r in record:
            group, others = vfio.group_members(self.kernel, r)
            members.update({m: Hold(m, "vfio", unit=f"{r.bdf}'s IOMMU group {group}") for m in others if m not in own})
        return [*own.values(), *members.values()]

    def apply(self, planned: Planned, record: Record) -> tuple[Record, dict[str, Device]]:
        try:
            vfio.bind_all(self.kernel, list(record), self.fault)
            return record, self.devices_now(record, {r.device: planned.inventory[r.device] for r in planned.results
                                                     if r.device in planned.inventory})
        except vfio.VfioError as err:  # all given back (again: idempotent); one still away keeps the claim's entry
            now = tuple(err.records) if err.records is not None else record  # a write still in the kernel: pending
            if (undone := self.undo(now, {})).problems:
                kept = undone.record if undone.record is not None else now
                raise NotUndone(err, undone.problems, kept if kept != record else None) from err
            raise

    def devices_now(self, record: Record, devices: dict[str, Device]) -> dict[str, Device]:
        """The claim's ``devices`` that are bound, with the nodes a VFIO user opens, as the kernel
        shows them now."""
        held = {r.bdf for r in record}
        return {name: vfio.with_vfio_nodes(self.root, dev) for name, dev in devices.items() if dev.pci.bdf in held}

    def undo(self, record: Record, others: dict[str, dict]) -> Undone:
        back = vfio.restore_all(self.kernel, list(record), self.fault)
        now = tuple(back.records)  # a give-back whose write did not return: pending, kept so on disk
        return Undone(problems=back.problems, notes=[] if back.problems else back.notes, record=now if now != record else None)

    def recover(self, record: Record) -> bool:
        # the claim's allowHostInUse is not in its record: a netdev the host uses now refuses the
        # re-bind where the node does not allow it (the claim could not have); where it does, it is not looked at
        host_uses = (lambda bdf: None) if self.allow_host_in_use else (lambda bdf: self._host_uses(bdf, False))
        try:
            return vfio.ensure_bound(self.root, self.kernel, list(record), self.fault, host_uses)
        except vfio.VfioError as err:
            if err.records is None or (now := tuple(err.records)) == record:
                raise
            raise NotRecovered(err, self.key, self.write(now)) from None
