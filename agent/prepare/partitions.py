"""Partition devices at prepare (``--partitions``), and AMD compute/memory mode switches as
transactions (docs/partitions.md).

``plan`` maps a claim's partition devices (discovery/gpuways.py) to devices for its CDI spec
and says which GPU must switch mode first. The claim's checkpoint entry records
``partitions: {"uses": {gpu: mode}, "switch": intent}``; the PrepareStarted entry holding the
intent is saved durably before the first kernel write. ``switch`` writes the kernel's
attributes (an order whose intermediate mode is valid), waits until the kernel exposes every
partition of the new mode, and reads them afresh for the spec; any failure writes the
previous mode back and fails the claim with what went wrong. ``recover`` undoes the switch of
a claim that was still PrepareStarted at a crash (the claim is rolled back; the kubelet's
retry switches again). A mode that differs from the one another prepared claim uses on the
same GPU is refused.

The checkpoint is input: ``uses`` and ``switch`` are shape-checked before they are used,
and a GPU is named by its PCI address and found in the inventory, never used as a path."""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Callable

from agent.prepare.allocation import ClaimFailed, Result
from agent.prepare.checkpoint import COMPLETED
from discovery import gpuways
from discovery.devnodes import NodeResolver
from discovery.models import Device, Inventory, Partitioning
from discovery.partitions import COMPUTE_PARTS, MEMORY_PARTS, modes_fit, read_amd
from discovery.pci import host_dir
from discovery.sysfs import AttrError, Dir, HostFS

log = logging.getLogger(__name__)
ATTRS = {"compute": "current_compute_partition", "memory": "current_memory_partition"}
_BDF = re.compile(r"^[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
POLL = 0.02
KFD_GENERATION = "sys/class/kfd/kfd/topology/generation_id"


def _mode(text: object) -> tuple[str, str] | None:
    """``"CPX/NPS1"`` -> ("CPX", "NPS1"); None unless both are known modes."""
    if not isinstance(text, str):
        return None
    compute, _, memory = text.partition("/")
    return (compute, memory) if compute in COMPUTE_PARTS and memory in MEMORY_PARTS else None


def uses(entry: dict) -> dict[str, str]:
    """The GPUs (PCI address -> mode) a checkpoint entry says its claim runs in; bad items ignored."""
    rec = entry.get("partitions")
    got = rec.get("uses") if isinstance(rec, dict) else None
    if not isinstance(got, dict):
        return {}
    return {k: v for k, v in got.items() if isinstance(k, str) and _BDF.match(k) and _mode(v)}


def intent(entry: dict) -> dict | None:
    """A checked switch intent ``{"gpu", "from", "to"}`` of an entry, or None."""
    rec = entry.get("partitions")
    sw = rec.get("switch") if isinstance(rec, dict) else None
    if not (isinstance(sw, dict) and isinstance(sw.get("gpu"), str) and _BDF.match(sw["gpu"])
            and _mode(sw.get("from")) and _mode(sw.get("to"))):
        return None
    return sw


class Partitions:
    def __init__(self, root: str, inventory: Callable[[], Inventory], timeout: float,
                 fault: Callable[[str], None] = lambda point: None):
        self.fs = HostFS(root)
        self.inventory = inventory
        self.timeout = timeout
        self.fault = fault
        self._ways: tuple[object, dict] = (None, {})

    def ways(self) -> dict[str, gpuways.Way]:
        inv = self.inventory()
        if self._ways[0] is not inv:  # one table per inventory
            self._ways = (inv, gpuways.by_name(inv.devices))
        return self._ways[1]

    # --- planning ----------------------------------------------------------------
    def plan(self, uid: str, results: list[Result], claims: dict[str, dict]) -> tuple[dict[str, Device], dict | None]:
        """-> (device name -> device, for the partition ways among ``results``; the record for
        the claim's checkpoint entry, or None). ClaimFailed on a conflict."""
        table = self.ways()
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
            others = {u: e for u, e in claims.items() if u != uid and bdf in uses(e)}
            for other, e in others.items():
                if uses(e)[bdf] != text:
                    raise ClaimFailed(f"GPU {bdf} runs in {uses(e)[bdf]} for prepared claim {e.get('namespace')}/{e.get('name')} "
                                      f"({other}); this claim needs {text}")
            parent = next(w.parent for w in picked if w.parent.pci.bdf == bdf)
            fresh[bdf], _ = self.read(parent)  # the kernel's mode now: the inventory may predate a switch
            now = f"{fresh[bdf].compute_mode}/{fresh[bdf].memory_mode or 'NPS1'}" if fresh[bdf] else "unknown"
            pending = any((intent(e) or {}).get("gpu") == bdf for e in others.values())
            if now != text and others and not pending:
                raise ClaimFailed(f"GPU {bdf} is in {now} and used by prepared claims; this claim needs {text}")
            if now != text or pending:
                if switch is not None:
                    raise ClaimFailed("one claim can switch the mode of one GPU at a time")
                # behind another claim's pending switch to the same mode: nothing to undo
                switch = {"gpu": bdf, "from": text if pending else now, "to": text}
        devices = {w.name: gpuways.way_device(w, now=fresh.get(w.parent.pci.bdf)) for w in picked if w.kind != "whole"}
        if not need:  # MIG instances, a GPU that cannot switch: nothing to record
            return devices, None
        record: dict = {"uses": {bdf: "/".join(m) for bdf, m in need.items()}}
        if switch:
            record["switch"] = switch
        return devices, record

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

    def _wait(self, gpu: Device, mode: tuple[str, str], since: str | None = None) -> Partitioning:
        """Until the kernel shows ``mode`` with all its partitions; after a write (``since``:
        the generation before it) only once the topology changed, so the old partitions are
        never taken for the new ones."""
        deadline = time.monotonic() + self.timeout
        while True:
            pt, problems = self.read(gpu)
            if pt is not None and (pt.compute_mode, pt.memory_mode or "NPS1") == mode and not problems \
                    and len(pt.partitions) == COMPUTE_PARTS[mode[0]] and (since is None or self.generation() != since):
                return pt
            if time.monotonic() >= deadline:
                seen = f"{pt.compute_mode}/{pt.memory_mode} with {len(pt.partitions)} partitions" if pt else "no partitions"
                raise TimeoutError(f"the kernel shows {seen} after {self.timeout:g} s" +
                                   (f" ({problems[0].what}: {problems[0].reason})" if problems else ""))
            time.sleep(POLL)

    def _apply(self, gpu: Device, start: tuple[str, str], target: tuple[str, str], xcds: int | None) -> Partitioning:
        """Write ``target`` in an order whose intermediate mode the kernel accepts, then wait."""
        steps = []
        if start[0] != target[0]:
            steps.append(("compute", target[0]))
        if start[1] != target[1]:
            steps.insert(0 if not modes_fit(target[0], start[1], xcds) else 1, ("memory", target[1]))
        now = list(start)
        for what, value in steps:
            since = self.generation()
            self._write(gpu, what, value)
            self.fault(f"partition:{what}-written")
            now[0 if what == "compute" else 1] = value
            self._wait(gpu, (now[0], now[1]), since)
        return self._wait(gpu, target)

    def switch(self, sw: dict) -> Partitioning:
        """Put the GPU in ``sw["to"]`` (the intent is in the checkpoint already) -> its
        partitions then. On failure the previous mode is restored and ClaimFailed says why."""
        gpu = self._gpu(sw["gpu"])
        target, before = _mode(sw["to"]), _mode(sw["from"])
        pt, _ = self.read(gpu)
        start = (pt.compute_mode, pt.memory_mode or "NPS1") if pt and pt.compute_mode else before
        if before == target and start != target:  # it waited for another claim's switch, which did not happen
            raise ClaimFailed(f"GPU {sw['gpu']} is in {'/'.join(start)}, not {sw['to']}: the switch this claim waited for failed")
        try:
            got = self._apply(gpu, start, target, pt.xcds if pt else None)
            self.fault("partition:exposed")
            log.info("GPU %s switched from %s to %s", sw["gpu"], "/".join(start), sw["to"])
            return got
        except (OSError, TimeoutError) as err:
            why = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            restored = self.restore(gpu, before)
            raise ClaimFailed(f"switching GPU {sw['gpu']} from {sw['from']} to {sw['to']} failed: {why}; {restored}") from None

    def restore(self, gpu: Device, mode: tuple[str, str]) -> str:
        """Back to ``mode`` -> what happened, for the claim's error or the log."""
        pt, _ = self.read(gpu)
        now = (pt.compute_mode, pt.memory_mode or "NPS1") if pt and pt.compute_mode else mode
        try:
            self._apply(gpu, now, mode, pt.xcds if pt else None)
        except (OSError, TimeoutError) as err:
            log.error("GPU %s: restoring %s failed: %s", gpu.pci.bdf, "/".join(mode), err)
            return f"restoring {'/'.join(mode)} failed too: {err}"
        return f"restored {'/'.join(mode)}"

    def devices_after(self, pt: Partitioning, results: list[Result]) -> dict[str, Device]:
        """Devices of the claim's partition ways with the nodes the kernel exposes now."""
        table = self.ways()
        return {r.device: gpuways.way_device(table[r.device], now=pt) for r in results
                if r.device in table and table[r.device].kind != "whole"}

    # --- start-up ------------------------------------------------------------------
    def recover(self, entry: dict, claims: dict[str, dict]) -> str | None:
        """A PrepareStarted entry about to be rolled back: undo its switch, unless a prepared
        claim runs the GPU in the new mode. -> what was done, for the recovery report."""
        sw = intent(entry)
        if sw is None or sw["from"] == sw["to"]:
            return None
        if any(uses(e).get(sw["gpu"]) == sw["to"] for e in claims.values() if e.get("state") == COMPLETED):
            return None
        try:
            gpu = self._gpu(sw["gpu"])
        except ClaimFailed as err:
            return str(err)
        pt, _ = self.read(gpu)
        if pt is not None and (pt.compute_mode, pt.memory_mode or "NPS1") == _mode(sw["from"]) \
                and len(pt.partitions) == COMPUTE_PARTS[pt.compute_mode]:
            return None
        result = self.restore(gpu, _mode(sw["from"]))
        log.warning("GPU %s: interrupted switch to %s undone: %s", sw["gpu"], sw["to"], result)
        return f"{sw['gpu']}: {result}"
