"""NVIDIA GPUs' own fault sources for the health monitor (agent/health/monitor.py): NVML's XID
and ECC events (agent/health/xid.py), kept across restarts (agent/health/faults.py), and the CUDA
MPS control daemons' faults from their supervisor (agent/prepare/mps_watch.py). A mixin of
``HealthMonitor``: it uses the monitor's devices, memory, round lock and checks.
"""

from __future__ import annotations

import asyncio
import logging

from agent.health.checks import Memory
from agent.health.gpumemory import RowRemapReader
from agent.health.xid import XidWatch
from discovery.inventory import device_name

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
        self.xid = xid
        return True

    def _nvidia_bound(self) -> bool:
        return any(self._known[n].pci.driver == "nvidia" for n in self._present_names)

    def _watch_late_nvml(self) -> None:
        """After a round: ask for the NVML that was not up, in a thread, the round not waiting."""
        asking = any(t.get_name() == "late-nvml" for t in self._link_checks)
        if self._nvml_missing and not asking and self._nvidia_bound():
            self._spawn(self.watch_gpu_events(), name="late-nvml")

    def _on_gpu_fault(self, bdf: str, code: str, message: str) -> None:
        """From the event thread: the GPU's fault is remembered and the GPU checked now."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._gpu_fault, bdf, code, message)

    def _gpu_fault(self, bdf: str, code: str, message: str) -> None:
        name = device_name("gpu", bdf)
        self._memory.setdefault(name, Memory()).event_fault = (code, message)
        self._spawn(self._check_and_keep(name, bdf, code, message))

    async def _check_and_keep(self, name: str, bdf: str, code: str, message: str) -> None:
        """The GPU checked now, then its fault written down (agent/health/faults.py), keyed by
        its UUID (discovery's, else NVML's), so an agent restart before the reboot keeps it."""
        await self.check_devices([name])
        dev = self._known.get(name)
        uuid = (dev.gpu.nvidia_uuid if dev is not None and dev.gpu is not None else None) or (
            self.xid.uuids.get(bdf) if self.xid is not None else None)
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
