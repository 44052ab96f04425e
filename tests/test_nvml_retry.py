"""An NVML that is not up when the agent starts (the kernel driver loads later: the GPU operator,
boot order) is opened again, backing off, once a GPU is bound to nvidia: the next scan publishes
its facts and MIG profiles, and the XID/ECC watch starts; a GPU query that failed is asked again.
A hung initialisation is never retried (discovery/nvml.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading

import pytest

from agent.health.monitor import HealthMonitor
from agent.service import scanning
from discovery import nvml as nvml_module
from discovery.inventory import scan
from discovery.nvml import Nvml, Sharing
from tests.conftest import copy_profile, profile_root
from tests.kubelet_standin import settings_for
from tests.simnvml import NVMLError, SimGpu, SimNvml, SimNvmlEvents, open_sim
from tests.simnvml_mig import SimMigNvml

BDF, GPU, DRIVER_ROOT = "0000:00:06.0", "gpu-0000-00-06-0", "/usr/local/nvidia"


def _late(base):
    class Late(base):
        """NVML_ERROR_DRIVER_NOT_LOADED until ``loaded``; ``hang``: init waits on it."""

        loaded = False
        inits = 0
        hang_init: threading.Event | None = None

        def nvmlInit(self):
            self.inits += 1
            if self.hang_init is not None:
                self.hang_init.wait()
            if not self.loaded:
                raise NVMLError(9)
            super().nvmlInit()

    return Late


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _sharing(sim, clock, timeout: float = 5.0) -> Sharing:
    return Sharing(lambda root, driver_root: Nvml._probe(root, driver_root, timeout, sim, lambda path: None), clock)


def _bind(root: str, bound: bool) -> None:
    """The GPU bound to nvidia or to no driver, as sysfs shows it (its uevent says first)."""
    d = os.path.join(root, "sys/devices/pci0000:00", BDF)
    with open(os.path.join(d, "uevent")) as f:
        lines = [ln for ln in f.read().splitlines() if not ln.startswith("DRIVER=")]
    with open(os.path.join(d, "uevent"), "w") as f:
        f.write("\n".join((["DRIVER=nvidia"] if bound else []) + lines) + "\n")
    if bound:
        os.symlink("../../../bus/pci/drivers/nvidia", os.path.join(d, "driver"))
    else:
        os.unlink(os.path.join(d, "driver"))


def test_a_failed_open_is_tried_again_after_the_backoff_and_its_success_logged_once(caplog):
    caplog.set_level(logging.INFO, logger="discovery.nvml")
    sim, clock = _late(SimNvml)(), Clock()
    shared, root = _sharing(sim, clock), profile_root("h200-vm")
    before = set(threading.enumerate())
    assert shared.get(root, DRIVER_ROOT) is None and sim.inits == 1
    assert caplog.text.count("failed to initialise") == 1
    clock.now += 5
    assert shared.get(root, DRIVER_ROOT) is None and sim.inits == 1  # backing off
    clock.now += 5
    assert shared.get(root, DRIVER_ROOT, retry=False) is None and sim.inits == 1  # no GPU bound to nvidia
    assert shared.get(root, DRIVER_ROOT) is None and sim.inits == 2
    assert caplog.text.count("failed to initialise") == 1  # the same reason again: no news
    clock.now += 19
    assert shared.get(root, DRIVER_ROOT) is None and sim.inits == 2  # doubled: 20 s
    for t in [t for t in set(threading.enumerate()) - before if t.name == "nvml"]:  # no thread left per try
        t.join(30)
        assert not t.is_alive()
    sim.loaded = True
    clock.now += 1
    nvml = shared.get(root, DRIVER_ROOT)
    assert nvml is not None and sim.inits == 3 and shared.get(root, DRIVER_ROOT) is nvml and sim.inits == 3
    assert caplog.text.count("after 2 failed tries") == 1


def test_a_hung_initialisation_is_never_tried_again():
    sim, clock = _late(SimNvml)(), Clock()
    sim.hang_init, sim.loaded = threading.Event(), True
    shared = _sharing(sim, clock, timeout=0.2)
    try:
        assert shared.get(profile_root("h200-vm"), DRIVER_ROOT) is None
        clock.now += 10_000
        assert shared.get(profile_root("h200-vm"), DRIVER_ROOT) is None and sim.inits == 1
    finally:
        sim.hang_init.set()


def test_the_scan_after_the_driver_loads_publishes_nvml_facts_and_mig_profiles(tmp_path, monkeypatch):
    """The GPU is unbound and NVML refuses when the agent starts; the driver binds it (a uevent
    rescans it) and NVML answers: that scan reads the GPU with NVML."""
    root = copy_profile(tmp_path, "h200-vm")
    _bind(root, False)
    sim, clock = _late(SimMigNvml)([SimGpu(mig_capable=True)]), Clock()
    monkeypatch.setattr(nvml_module, "SHARED", _sharing(sim, clock))
    s = settings_for(str(tmp_path), root=root, nvidia_driver_root=DRIVER_ROOT)
    sc, inv = scanning.update(None, s, None)
    assert sc.nvml is None and GPU not in inv.by_name() and sim.inits == 1
    clock.now += 60
    sc2, inv = scanning.update(sc, s, set())
    assert sc2 is sc and sim.inits == 1  # no GPU bound to nvidia: nothing to try again for
    sim.loaded = True
    _bind(root, True)
    sc3, inv = scanning.update(sc, s, {BDF})
    gpu = inv.by_name()[GPU]
    assert sc3.nvml is not None and sim.inits == 2 and gpu.gpu.nvidia.source == "nvml"
    assert len(gpu.gpu.partitioning.profiles) == 7
    assert scanning.update(sc3, s, {BDF})[0] is sc3  # kept from now on


def test_a_gpu_query_that_failed_is_asked_again_and_its_warning_given_once(caplog):
    class Flaky(SimNvml):
        fail = 2

        def nvmlDeviceGetHandleByPciBusId(self, bus_id):
            if self.fail:
                self.fail -= 1
                raise NVMLError(15)  # NVML_ERROR_GPU_IS_LOST: a GPU being reset
            return super().nvmlDeviceGetHandleByPciBusId(bus_id)

    root = profile_root("h200-vm")
    nvml = open_sim(root, Flaky())
    assert scan(root, nvml=nvml).by_name()[GPU].gpu.nvidia.source == "table"
    assert scan(root, nvml=nvml).by_name()[GPU].gpu.nvidia.source == "table"
    assert caplog.text.count(f"GPU {BDF}") == 1
    assert scan(root, nvml=nvml).by_name()[GPU].gpu.nvidia.source == "nvml"


async def _until(predicate, timeout: float = 30.0):
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


def test_the_xid_watch_starts_when_nvml_comes_up_after_the_agent(tmp_path, monkeypatch):
    root = profile_root("h200-vm")
    sim, clock = _late(SimNvmlEvents)(), Clock()
    monkeypatch.setattr(nvml_module, "SHARED", _sharing(sim, clock))
    s = settings_for(str(tmp_path), root=root, nvidia_driver_root=DRIVER_ROOT)
    inv = scan(root)
    ups = []

    async def main():
        monitor = HealthMonitor(s, lambda: inv)
        monitor.nvml_up = lambda: ups.append(1)
        await monitor.start()
        try:
            assert not await monitor.watch_gpu_events() and sim.inits == 1
            await monitor.check_now()
            monitor._watch_late_nvml()  # as a round does: backing off, so not tried
            await asyncio.gather(*monitor._link_checks)
            assert monitor.xid is None and sim.inits == 1
            sim.loaded, clock.now = True, clock.now + 10
            monitor.on_inventory(inv)  # the next round asks again
            await _until(lambda: monitor.xid is not None)
            assert sim.inits == 2 and monitor.xid.registered == [BDF] and ups == [1]
            sim.emit(BDF, sim.nvmlEventTypeXidCriticalError, 79)
            await _until(lambda: monitor.states[GPU].verdict.reason == "xid-79")
        finally:
            await monitor.stop()

    asyncio.run(main())


@pytest.mark.parametrize("nvml", [False, True])
def test_no_nvml_asked_for_when_it_is_off(tmp_path, monkeypatch, nvml):
    sim = _late(SimNvml)()
    sim.loaded = True
    monkeypatch.setattr(nvml_module, "SHARED", _sharing(sim, Clock()))
    s = settings_for(str(tmp_path), root=profile_root("h200-vm"), nvidia_driver_root=DRIVER_ROOT, nvml=nvml)
    sc, inv = scanning.update(None, s, None)
    assert (sc.nvml is not None, sim.inits) == ((True, 1) if nvml else (False, 0))


def test_the_agent_rescans_when_the_health_monitor_opens_nvml_first(tmp_path, monkeypatch):
    from agent.service.daemon import Agent

    sim, clock = _late(SimNvml)(), Clock()
    shared = _sharing(sim, clock)
    monkeypatch.setattr(nvml_module, "SHARED", shared)
    agent = Agent(settings_for(str(tmp_path), root=profile_root("h200-vm"), nvidia_driver_root=DRIVER_ROOT,
                               metrics_address=""))

    async def main():
        await agent.rescan()
        assert agent.inventory.by_name()[GPU].gpu.nvidia.source == "table"
        sim.loaded, clock.now = True, clock.now + 10
        assert shared.get(profile_root("h200-vm"), DRIVER_ROOT) is not None  # as the monitor's round
        agent._nvml_up()
        await asyncio.gather(*agent._background)
        assert agent.rescans == 2 and agent.inventory.by_name()[GPU].gpu.nvidia.source == "nvml"
        agent._nvml_up()  # the scans have it: nothing to read again
        assert not agent._background and agent.rescans == 2

    asyncio.run(main())
