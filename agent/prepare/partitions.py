"""Partition devices at prepare (``--partitions``), and AMD compute mode switches: the
mechanics (docs/partitions.md); prepare/steps/partition.py runs them as a step.

``plan`` maps a claim's partition devices (discovery/gpuways.py) to devices for its CDI spec
and says which GPU must switch mode first (a ``PartitionUse`` record: the modes the claim
uses, the switch's intent). ``switch`` writes ``current_compute_partition``, waits until the
kernel exposes every partition of the new mode, and reads them afresh for the spec; any
failure writes the previous compute mode back and fails the claim with what went wrong.
``undo`` puts back the compute mode a switch left (an interrupted or failed prepare), unless
a prepared claim runs the GPU in the new mode. A mode that differs from the one another
prepared claim uses on the same GPU is refused.

The memory mode (NPS) is never written: amdgpu takes a write to ``current_memory_partition``
as a request applied at the next driver reload (amdgpu_gmc_set_memory_partition: "NPS mode
change requested, please remove and reload the driver"), and the mode shown stays. A claim
whose device needs another memory mode than the GPU's is refused before anything is written;
a recorded intent of an older agent that switched it gets its compute mode back only.

A GPU is named by its PCI address (checked in the typed record) and found in the inventory,
never used as a path."""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

from agent.prepare.allocation import ClaimFailed, Result
from agent.prepare.ownership import named
from agent.prepare.records import ModeSwitch, PartitionUse
from agent.prepare.steps import NotUndone
from discovery import gpuways
from discovery.devnodes import NodeResolver
from discovery.models import Device, Inventory, Partitioning
from discovery.partitions import MEMORY_PARTS, modes_fit, part_count, read_amd
from discovery.pci import host_dir
from discovery.sysfs import AttrError, Dir, HostFS

log = logging.getLogger(__name__)
ATTRS = {"compute": "current_compute_partition"}  # never current_memory_partition: amdgpu applies it at a driver reload
POLL = 0.02
KFD_GENERATION = "sys/class/kfd/kfd/topology/generation_id"


def _mode(text: str) -> tuple[str, str]:
    """``"CPX/NPS1"`` (checked by the record) -> ("CPX", "NPS1")."""
    compute, _, memory = text.partition("/")
    return compute, memory


def memory_refusal(bdf: str, memory_now: str, mode: str) -> str:
    """Why a claim needing ``mode`` (``QPX/NPS4``) cannot run on a GPU in memory mode ``memory_now``."""
    return (f"GPU {bdf} runs {memory_now}; {mode} needs memory mode {_mode(mode)[1]}, which amdgpu applies only at a "
            "driver reload: set it on the node (amd-smi / sysfs, then reload amdgpu)")


def intent(entry: dict) -> dict | None:
    """The switch intent ``{"gpu", "from", "to"}`` of a checkpoint entry, or None."""
    rec = entry.get("partitions")
    sw = PartitionUse.model_validate(rec).switch if rec else None
    return sw.dump() if sw else None


class NotRestored(Exception):
    """The GPU's previous mode could not be written back: it is left half-switched."""


class Partitions:
    def __init__(self, root: str, inventory: Callable[[], Inventory], timeout: float,
                 fault: Callable[[str], None] = lambda point: None):
        self.fs = HostFS(root)
        self.inventory = inventory
        self.timeout = timeout
        self.fault = fault
        self._ways: tuple[object, dict] = (None, {})

    def ways(self, inv: Inventory | None = None) -> dict[str, gpuways.Way]:
        inv = inv if inv is not None else self.inventory()
        if self._ways[0] is not inv:  # one table per inventory
            self._ways = (inv, gpuways.by_name(inv.devices))
        return self._ways[1]

    # --- planning ----------------------------------------------------------------
    def plan(self, uid: str, results: list[Result], others: dict[str, tuple[str, PartitionUse]],
             table: dict[str, gpuways.Way]) -> tuple[dict[str, Device], PartitionUse | None]:
        """-> (device name -> device, for the partition ways among ``results``; the claim's
        record, or None). ``others``: the other claims' records (uid -> (name, record));
        ``table``: the ways of the inventory planned against. ClaimFailed on a conflict."""
        picked = [table[r.device] for r in results if r.device in table]
        if not picked:
            return {}, None
        need: dict[str, tuple[str, str]] = {}
        for way in picked:
            if way.compute is None:
                continue
            bdf = way.parent.pci.bdf
            if need.setdefault(bdf, (way.compute, way.memory)) != (way.compute, way.memory):
                raise ClaimFailed(f"devices of GPU {bdf} in two modes ({'/'.join(need[bdf])} and {way.mode}) cannot run together")
        switch = None
        fresh: dict[str, Partitioning | None] = {}
        for bdf, mode in need.items():
            text = "/".join(mode)
            users = {u: (name, rec) for u, (name, rec) in others.items() if u != uid and bdf in rec.uses}
            for other, (name, rec) in users.items():
                if rec.uses[bdf] != text:
                    raise ClaimFailed(f"GPU {bdf} runs in {rec.uses[bdf]} for prepared claim {named(other, name)}; this claim needs {text}")
            parent = next(w.parent for w in picked if w.parent.pci.bdf == bdf)
            fresh[bdf], _ = self.read(parent)  # the kernel's mode now: the inventory may predate a switch
            now = f"{fresh[bdf].compute_mode}/{fresh[bdf].memory_mode or 'NPS1'}" if fresh[bdf] else "unknown"
            if fresh[bdf] and (memory_now := fresh[bdf].memory_mode or "NPS1") != mode[1]:
                raise ClaimFailed(memory_refusal(bdf, memory_now, text))  # an old slice, a hand-made claim
            pending = any(rec.switch is not None and rec.switch.gpu == bdf for _, rec in users.values())
            if now != text and users and not pending:
                raise ClaimFailed(f"GPU {bdf} is in {now} and used by prepared claims; this claim needs {text}")
            if now != text or pending:
                if switch is not None:
                    raise ClaimFailed("one claim can switch the mode of one GPU at a time")
                # behind another claim's pending switch to the same mode: nothing to undo
                switch = ModeSwitch(gpu=bdf, from_=text if pending else now, to=text)
        devices = {w.name: gpuways.way_device(w, now=fresh.get(w.parent.pci.bdf)) for w in picked if w.kind != "whole"}
        if not need:  # MIG instances, a GPU that cannot switch: nothing to record
            return devices, None
        return devices, PartitionUse(uses={bdf: "/".join(m) for bdf, m in need.items()}, switch=switch)

    # --- the kernel's side ---------------------------------------------------------
    def _gpu(self, bdf: str) -> Device:
        dev = next((d for d in self.inventory().devices if d.pci.bdf == bdf and gpuways.partitioning(d)), None)
        if dev is None:
            raise ClaimFailed(f"GPU {bdf} is not a partitionable GPU of this node any more")
        return dev

    def read(self, gpu: Device) -> tuple[Partitioning | None, list]:
        """The GPU's partitioning as the kernel shows it now (a fresh read, nothing cached)."""
        problems: list = []
        return read_amd(self.fs, NodeResolver(self.fs), gpu.pci, Dir(host_dir(self.fs, gpu.pci)), problems), problems

    def _write(self, gpu: Device, what: str, value: str) -> None:
        path = os.path.join(host_dir(self.fs, gpu.pci), ATTRS[what])
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC)  # never creates a file
        try:
            os.write(fd, (value + "\n").encode())
        finally:
            os.close(fd)

    def generation(self) -> str | None:
        """KFD's topology generation: the kernel bumps it when partitions go and come."""
        try:
            return self.fs.read_attr(self.fs.path(KFD_GENERATION))
        except AttrError:
            return None

    def _wait(self, gpu: Device, mode: tuple[str, str], xcds: int | None, since: str | None = None) -> Partitioning:
        """Until the kernel shows ``mode`` with all its partitions; after a write (``since``:
        the generation before it) only once the topology changed, so the old partitions are
        never taken for the new ones."""
        deadline = time.monotonic() + self.timeout
        while True:
            pt, problems = self.read(gpu)
            if pt is not None and (pt.compute_mode, pt.memory_mode or "NPS1") == mode and not problems \
                    and len(pt.partitions) == part_count(mode[0], xcds) and (since is None or self.generation() != since):
                return pt
            if time.monotonic() >= deadline:
                seen = f"{pt.compute_mode}/{pt.memory_mode} with {len(pt.partitions)} partitions" if pt else "no partitions"
                raise TimeoutError(f"the kernel shows {seen} after {self.timeout:g} s" +
                                   (f" ({problems[0].what}: {problems[0].reason})" if problems else ""))
            time.sleep(POLL)

    def _apply(self, gpu: Device, start: tuple[str, str], target: tuple[str, str], xcds: int | None) -> Partitioning:
        """Write ``target``'s compute mode (``target`` is of the memory mode ``start`` is in: the
        memory mode is never written), then wait until the kernel shows it."""
        if start[1] != target[1]:
            raise ClaimFailed(memory_refusal(gpu.pci.bdf, start[1], "/".join(target)))
        if start[0] != target[0]:
            since = self.generation()
            self._write(gpu, "compute", target[0])
            self.fault("partition:compute-written")
            return self._wait(gpu, target, xcds, since)
        return self._wait(gpu, target, xcds)

    def switch(self, sw: ModeSwitch) -> Partitioning:
        """Put the GPU in ``sw.to`` (the intent is in the checkpoint already) -> its
        partitions then. On failure the previous mode is restored and ClaimFailed says why."""
        gpu = self._gpu(sw.gpu)
        target, before = _mode(sw.to), _mode(sw.from_)
        pt, _ = self.read(gpu)
        start = (pt.compute_mode, pt.memory_mode or "NPS1") if pt and pt.compute_mode else before
        if before == target and start != target:  # it waited for another claim's switch, which did not happen
            raise ClaimFailed(f"GPU {sw.gpu} is in {'/'.join(start)}, not {sw.to}: the switch this claim waited for failed")
        try:
            got = self._apply(gpu, start, target, pt.xcds if pt else None)
            self.fault("partition:exposed")
            log.info("GPU %s switched from %s to %s", sw.gpu, "/".join(start), sw.to)
            return got
        except (OSError, TimeoutError) as err:
            why = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            failed = ClaimFailed(f"switching GPU {sw.gpu} from {sw.from_} to {sw.to} failed: {why}")
            try:
                restored = self.restore(gpu, before)
            except NotRestored as nr:  # half-switched: the intent stays recorded, the undo is retried
                raise NotUndone(failed, [f"GPU {sw.gpu}: {nr}"]) from None
            raise ClaimFailed(f"{failed}; {restored}") from None

    def restore(self, gpu: Device, mode: tuple[str, str]) -> str:
        """Back to ``mode``'s compute mode -> what happened, for the claim's error or the log;
        NotRestored when the kernel did not take it. A GPU in another memory mode than ``mode``'s
        (an older agent's intent, which wrote it) gets the compute mode back where it runs in the
        memory mode now: the memory mode is the operator's (a driver reload applies it)."""
        pt, _ = self.read(gpu)
        now = (pt.compute_mode, pt.memory_mode or "NPS1") if pt and pt.compute_mode else mode
        xcds = pt.xcds if pt else None
        target, note = mode, ""
        if now[1] != mode[1]:
            note = (f"; memory mode {mode[1]} is the operator's: the GPU runs {now[1]}, and amdgpu applies "
                    "another only at a driver reload")
            if not modes_fit(mode[0], now[1], xcds):
                log.warning("GPU %s: %s not restored: %s does not run in %s", gpu.pci.bdf, "/".join(mode), mode[0], now[1])
                return f"{'/'.join(mode)} not restored: {mode[0]} does not run in {now[1]}{note}"
            target = (mode[0], now[1])
        try:
            self._apply(gpu, now, target, xcds)
        except (OSError, TimeoutError) as err:
            log.error("GPU %s: restoring %s failed: %s", gpu.pci.bdf, "/".join(target), err)
            raise NotRestored(f"restoring {'/'.join(target)} failed too: {err}") from None
        return f"restored {'/'.join(target)}{note}"

    def ensure(self, bdf: str, mode: str) -> str | None:
        """A prepared claim's GPU in ``mode`` again where the kernel shows another (after a reboot
        amdgpu comes up in its default compute mode) -> what was done, None when nothing was
        needed. ClaimFailed where it cannot be (another memory mode: a driver reload's; the switch
        failing): the claim's pods must not run on the GPU as it is."""
        gpu = self._gpu(bdf)
        pt, _ = self.read(gpu)
        target = _mode(mode)
        if pt is None or not pt.compute_mode:
            raise ClaimFailed(f"GPU {bdf}: its partition mode cannot be read; its prepared claims need {mode}")
        now = (pt.compute_mode, pt.memory_mode or "NPS1")
        if now == target and len(pt.partitions) == part_count(target[0], pt.xcds):
            return None
        try:
            self._apply(gpu, now, target, pt.xcds)  # ClaimFailed for another memory mode, before any write
        except (OSError, TimeoutError) as err:
            why = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            raise ClaimFailed(f"GPU {bdf} is in {'/'.join(now)}; switching it back to {mode}, which its prepared "
                              f"claims run it in, failed: {why}") from None
        log.warning("GPU %s was in %s (a reboot, or someone): switched back to %s for its prepared claims",
                    bdf, "/".join(now), mode)
        return f"{bdf}: {'/'.join(now)} -> {mode}"

    def devices_after(self, pt: Partitioning, results: list[Result], table: dict[str, gpuways.Way]) -> dict[str, Device]:
        """Devices of the claim's partition ways (of ``table``, the ways planned with: a rescan
        during the switch may not show them) with the nodes the kernel exposes now."""
        return {r.device: gpuways.way_device(table[r.device], now=pt) for r in results
                if r.device in table and table[r.device].kind != "whole"}

    def undo(self, sw: ModeSwitch, others: dict[str, PartitionUse]) -> str | None:
        """A switch of a prepare that did not complete: the GPU back in ``sw.from_``, unless a
        prepared claim (``others``) runs it in the new mode. -> what was done, for the report;
        NotRestored when the GPU stays in another mode (the caller keeps the intent and retries)."""
        if sw.from_ == sw.to or any(rec.uses.get(sw.gpu) == sw.to for rec in others.values()):
            return None
        try:
            gpu = self._gpu(sw.gpu)
        except ClaimFailed as err:
            # gone from the node (unplugged, its driver unbound): nothing here to write back, and the
            # mode it comes back in is the kernel's; the next claim's plan reads it afresh. Retrying
            # would only keep the claim's entry, and fail its unprepare, for as long as it is away.
            return str(err)
        pt, _ = self.read(gpu)
        before, asked = _mode(sw.from_), _mode(sw.to)
        # an older agent's intent that wrote the memory mode: amdgpu keeps it as a request for the
        # next driver reload, which no write of the agent's takes back (the current mode is skipped)
        pending = f"; memory mode {asked[1]} may be pending for the next driver reload: the operator's" \
            if asked[1] != before[1] else ""
        if pt is not None and (pt.compute_mode, pt.memory_mode or "NPS1") == before \
                and len(pt.partitions) == part_count(pt.compute_mode, pt.xcds):
            return f"{sw.gpu}: {sw.from_} kept{pending}" if pending else None
        if pt is not None and (pt.memory_mode or "NPS1") != before[1]:
            pending = ""  # the GPU runs another memory mode than before: restore says so
        result = self.restore(gpu, before)
        log.warning("GPU %s: interrupted switch to %s undone: %s%s", sw.gpu, sw.to, result, pending)
        return f"{sw.gpu}: {result}{pending}"
