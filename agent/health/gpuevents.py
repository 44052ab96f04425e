"""NVIDIA GPUs' own fault sources for the health monitor (agent/health/monitor.py): NVML's XID
and ECC events (agent/health/xid.py), kept across restarts (agent/health/faults.py), and the CUDA
MPS control daemons' faults from their supervisor (agent/prepare/mps_watch.py). A mixin of
``HealthMonitor``: it uses the monitor's devices, memory, round lock and checks.

An XID in one MIG instance is the fault of the MIG device published for that instance (static
MIG: the instance's own device; dynamic MIG: the placement NVML says the GPU instance sits at),
found in a worker thread; its GPU and the GPU's other MIG devices stay as they are. An XID whose
instance is published as no device (no ``--partitions``, or it went meanwhile) is the GPU's.
"""

from __future__ import annotations

import asyncio
import logging

from agent.health.checks import Memory
from agent.health.gpumemory import RowRemapReader
from agent.health.xid import XidWatch
from discovery.gpuways import published_ways
from discovery.inventory import device_name
from discovery.models import Device

log = logging.getLogger("agent.health.monitor")


class GpuEvents:
    def _spawn(self, coro, name: str | None = None) -> None:
        """A check the caller does not wait for; cancelled by ``stop``."""
        task = asyncio.create_task(coro, name=name)
        self._link_checks.add(task)
        task.add_done_callback(self._link_checks.discard)

    async def watch_gpu_events(self, nvml=None) -> bool:
        """NVIDIA XID/ECC events from NVML (agent/health/xid.py) mark their GPU unhealthy at
        once. Call after ``start``; False when NVML is off, absent or refuses. An NVML not up yet
        (the driver loads after the agent) is asked for again after each round while a GPU is
        bound to nvidia (discovery/nvml.py backs off); ``nvml_up`` is called once it is."""
        s = self.settings
        if nvml is None and s.nvml:
            from discovery.nvml import Nvml

            nvml = await asyncio.to_thread(Nvml.shared, s.root, s.nvidia_driver_root, self._nvidia_bound())
            if self._nvml_missing and nvml is not None:
                self.nvml_up()
            self._nvml_missing = nvml is None
        if nvml is None:
            return False
        self.row_remaps = RowRemapReader(nvml)  # read by the rounds, whatever the events do
        xid = XidWatch(nvml, self._on_gpu_fault, ignored=s.nvidia_ignored_xids)
        if not await asyncio.to_thread(xid.start):
            return False
        self._on_nvidia = self._nvidia_bdfs() | set(xid.registered)
        self.xid = xid
        return True

    def _nvidia_bdfs(self) -> set[str]:
        return {self._known[n].pci.bdf for n in self._present_names if self._known[n].pci.driver == "nvidia"}

    def _watch_new_gpus(self) -> None:
        """After a round: GPUs the inventory shows newly bound to nvidia (hot-added, given back from
        vfio-pci) registered for their XID/ECC events, in a thread, the round not waiting."""
        if self.xid is None:
            return
        now = self._nvidia_bdfs()
        new, self._on_nvidia = sorted(now - self._on_nvidia), now
        if new:
            self._spawn(asyncio.to_thread(self.xid.add, new), name="xid-new-gpus")

    def _nvidia_bound(self) -> bool:
        return any(self._known[n].pci.driver == "nvidia" for n in self._present_names)

    def _watch_late_nvml(self) -> None:
        """After a round: ask for the NVML that was not up, in a thread, the round not waiting."""
        asking = any(t.get_name() == "late-nvml" for t in self._link_checks)
        if self._nvml_missing and not asking and self._nvidia_bound():
            self._spawn(self.watch_gpu_events(), name="late-nvml")

    def _on_gpu_fault(self, bdf: str, code: str, message: str, instance: tuple[int, int] | None = None) -> None:
        """From the event thread: the GPU's (or MIG device's) fault is remembered and checked now."""
        if self._loop is None:
            return
        if instance is None:
            self._loop.call_soon_threadsafe(self._gpu_fault, bdf, code, message)
        else:
            self._loop.call_soon_threadsafe(lambda: self._spawn(self._instance_fault(bdf, instance, code, message)))

    async def _instance_fault(self, bdf: str, instance: tuple[int, int], code: str, message: str) -> None:
        name = device_name("gpu", bdf)
        dev = self._known.get(name)
        part = await asyncio.to_thread(self._mig_device, dev, *instance) if dev is not None else None
        if part is None:
            log.warning("device %s: %s, an instance published as no device: the GPU's fault", name, message)
            self._gpu_fault(bdf, code, message)
            return
        log.warning("device %s health Unhealthy: %s", part, message)
        self.partition_faults[part] = (code, message)
        for sub in self._subscribers:
            sub.event.set()
        if uuid := self._uuid(name, bdf):
            async with self._round:
                await asyncio.to_thread(self.kept.record, uuid, bdf, code, message, part)
        else:
            log.error("device %s: fault %s not kept across restarts: its GPU's UUID is not known", part, code)

    def _mig_device(self, dev: Device, gi: int, ci: int) -> str | None:
        """The published MIG device of GPU instance ``gi``, compute instance ``ci`` (a worker thread)."""
        if not self.settings.partitions:
            return None
        ways = published_ways(dev, self.settings.compatibility_groups)
        for w in ways:
            if w.kind == "mig" and w.instance is not None and (w.instance.gi, w.instance.ci) == (gi, ci):
                return w.name
        placements = {(w.profile.id, w.start): w.name for w in ways if w.kind == "mig-placement"}
        if not placements or self.xid is None:
            return None
        for now in self.xid.nvml.mig_instances(dev.pci.bdf) or ():
            if now.gi == gi and ci in now.cis:
                return placements.get((now.profile, now.start))
        return None

    def _uuid(self, name: str, bdf: str) -> str | None:
        """The GPU's UUID as faults are kept under it: discovery's, else NVML's."""
        dev = self._known.get(name)
        return (dev.gpu.nvidia_uuid if dev is not None and dev.gpu is not None else None) or (
            self.xid.uuids.get(bdf) if self.xid is not None else None)

    def _gpu_fault(self, bdf: str, code: str, message: str) -> None:
        name = device_name("gpu", bdf)
        mem = self._memory.setdefault(name, Memory())
        mem.event_fault, mem.event_uuid = (code, message), self._uuid(name, bdf)
        self._spawn(self._check_and_keep(name, bdf, code, message))

    async def _check_and_keep(self, name: str, bdf: str, code: str, message: str) -> None:
        """The GPU checked now, then its fault written down (agent/health/faults.py), keyed by
        its UUID (discovery's, else NVML's), so an agent restart before the reboot keeps it."""
        await self.check_devices([name])
        uuid = self._uuid(name, bdf)
        if not uuid:
            log.error("device %s: fault %s not kept across restarts: the GPU's UUID is not known", name, code)
            return
        async with self._round:  # the kept faults are the rounds' too
            await asyncio.to_thread(self.kept.record, uuid, bdf, code, message)

    def gpu_daemon_fault(self, uuid: str, fault: tuple[str, str] | None) -> None:
        """From any thread: the MPS control daemon of the NVIDIA GPU ``uuid`` is down (``fault``:
        code, message) or back (None); its GPU is checked now, and stays unhealthy until back."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._daemon_fault, uuid, fault)

    def _daemon_fault(self, uuid: str, fault: tuple[str, str] | None) -> None:
        self._daemon_faults[uuid] = fault
        names = [n for n, d in self._known.items() if d.gpu is not None and d.gpu.nvidia_uuid == uuid]
        for name in names:
            self._memory.setdefault(name, Memory()).daemon_fault = fault
        if names:
            self._spawn(self.check_devices(names))
