"""NVIDIA XID and ECC events (agent/health/xid.py) on a simulated NVML with NVML's event API: a
critical XID or a double-bit ECC error makes the GPU unhealthy at once (and tainted with
--taint-unhealthy); an application's XID and a corrected single-bit error do not."""

from __future__ import annotations

import asyncio
import queue
import threading

import pytest

from agent.health.checks import HEALTHY, UNHEALTHY
from agent.health.monitor import HealthMonitor
from agent.health.xid import XidWatch, bus_id
from discovery.inventory import scan
from tests.conftest import profile_root
from tests.kubelet_standin import settings_for
from tests.simnvml import NVMLError, SimEvent, SimGpu, SimNvmlEvents, open_sim

BDF, GPU = "0000:00:06.0", "gpu-0000-00-06-0"


def test_bus_ids_as_the_kernel_names_them():
    assert bus_id("00000000:00:06.0") == bus_id(b"0000:00:06.0") == BDF
    assert bus_id("00000001:AF:00.0") == "0001:af:00.0" and bus_id("nonsense") is None and bus_id(None) is None
    assert bus_id("0000zz00:00:06.0") is bus_id("-1:00:06.0") is None
    assert bus_id("00000000::06.0") is bus_id("00000000:00:") is None  # an empty part: no device's name


def test_bus_ids_of_domains_above_ffff_as_discovery_names_them():
    """Intel VMD puts functions in domains from 10000 on: the kernel (and discovery) spell all
    the digits, NVML pads to eight."""
    inv = scan(profile_root("vmd-multidomain"))
    bdfs = [d.pci.bdf for d in inv.devices]
    assert "10000:02:00.0" in bdfs and "0001:41:00.0" in bdfs
    for bdf in bdfs:
        domain, rest = bdf.split(":", 1)
        assert bus_id(f"{int(domain, 16):08X}:{rest.upper()}") == bdf


def _watch(sim, ignored=(13, 31, 43, 45, 68, 109)):
    faults: queue.SimpleQueue = queue.SimpleQueue()
    nvml = open_sim(profile_root("h200-vm"), sim)
    watch = XidWatch(nvml, lambda *f: faults.put(f), ignored=ignored, wait_ms=50)
    return watch, faults


def test_faults_are_reported_and_application_errors_ignored():
    sim = SimNvmlEvents()
    watch, faults = _watch(sim)
    assert watch.start() and watch.registered == [BDF] and sim.registered == [(BDF, 0x8 | 0x2 | 0x1)]
    try:
        sim.emit(BDF, sim.nvmlEventTypeXidCriticalError, 13)  # an application's page fault
        sim.emit(BDF, sim.nvmlEventTypeSingleBitEccError)  # corrected
        sim.emit(BDF, sim.nvmlEventTypeXidCriticalError, 79)  # fell off the bus
        sim.emit(BDF, sim.nvmlEventTypeDoubleBitEccError)
        assert faults.get(timeout=30) == (BDF, "xid-79", "NVML: critical XID 79", None)
        assert faults.get(timeout=30) == (BDF, "ecc-double-bit", "NVML: uncorrectable (double-bit) ECC error", None)
        assert faults.empty() and watch.events == 4
    finally:
        watch.stop()


def test_a_gpu_nvml_refuses_leaves_the_others_watched():
    other = "0000:00:07.0"
    sim = SimNvmlEvents([SimGpu(), SimGpu(bus_id=other)], refuse={BDF})
    watch, faults = _watch(sim)
    assert watch.start() and watch.registered == [other]
    try:
        sim.emit(other, sim.nvmlEventTypeXidCriticalError, 79)
        assert faults.get(timeout=30) == (other, "xid-79", "NVML: critical XID 79", None)
    finally:
        watch.stop()


def test_the_watch_outlives_quiet_waits():
    """NVML's wait ends in a timeout whenever no event came (every few seconds on a healthy
    node): the watch waits again, and the fault that comes later is still seen."""
    sim = SimNvmlEvents()
    timeouts, quiet = [], threading.Event()
    wait = sim.nvmlEventSetWait_v2

    def counted(event_set, timeout_ms):
        try:
            return wait(event_set, timeout_ms)
        except Exception:
            timeouts.append(1)
            if len(timeouts) >= 3:
                quiet.set()
            raise

    sim.nvmlEventSetWait_v2 = counted
    watch, faults = _watch(sim)
    assert watch.start()
    try:
        assert quiet.wait(30)
        sim.emit(BDF, sim.nvmlEventTypeXidCriticalError, 79)
        assert faults.get(timeout=30) == (BDF, "xid-79", "NVML: critical XID 79", None)
    finally:
        watch.stop()


def test_default_settings_ignore_the_application_xids(tmp_path):
    """The XIDs ignored unless the operator says otherwise (docs/health.md): an application's own
    faults (13, 31, 43, 45, 68, 109) leave the GPU healthy; XID 79 does not."""
    s = settings_for(str(tmp_path), root=profile_root("h200-vm"))
    sim = SimNvmlEvents()
    watch, faults = _watch(sim, ignored=s.nvidia_ignored_xids)
    assert watch.start()
    try:
        for code in (13, 31, 43, 45, 68, 109, 79):
            sim.emit(BDF, sim.nvmlEventTypeXidCriticalError, code)
        assert faults.get(timeout=30) == (BDF, "xid-79", "NVML: critical XID 79", None)
        assert faults.empty() and watch.events == 7
    finally:
        watch.stop()


def test_the_operators_list_replaces_the_default():
    sim = SimNvmlEvents()
    watch, faults = _watch(sim, ignored=(79,))
    assert watch.start()
    try:
        sim.emit(BDF, sim.nvmlEventTypeXidCriticalError, 79)
        sim.emit(BDF, sim.nvmlEventTypeXidCriticalError, 13)
        assert faults.get(timeout=30) == (BDF, "xid-13", "NVML: critical XID 13", None)
    finally:
        watch.stop()


def test_an_event_not_understood_leaves_the_watch_running():
    sim = SimNvmlEvents()
    watch, faults = _watch(sim)
    assert watch.start()
    try:
        sim.queue.put(SimEvent(None, sim.nvmlEventTypeXidCriticalError, 79))  # no device NVML could name
        sim.emit(BDF, sim.nvmlEventTypeXidCriticalError, 79)
        assert faults.get(timeout=30) == (BDF, "xid-79", "NVML: critical XID 79", None)
        assert watch.events == 2
    finally:
        watch.stop()


def test_nothing_watched_when_nvml_refuses_every_gpu():
    watch, _ = _watch(SimNvmlEvents([SimGpu()], refuse={BDF}))
    assert not watch.start() and watch.registered == []


async def _until(predicate, what: str, timeout: float = 30.0):
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("ignored", [(13, 31, 43, 45, 68, 109), (79,)])
def test_a_critical_xid_makes_the_gpu_unhealthy_and_tainted(tmp_path, ignored):
    root = profile_root("h200-vm")
    s = settings_for(str(tmp_path), root=root, nvidia_driver_root="/usr/local/nvidia", taint_unhealthy=True,
                     nvidia_ignored_xids=ignored)
    inv = scan(root)
    sim = SimNvmlEvents()

    async def main():
        monitor = HealthMonitor(s, lambda: inv)
        await monitor.start()
        try:
            assert monitor.states[GPU].verdict.health == HEALTHY
            assert await monitor.watch_gpu_events(nvml=open_sim(root, sim))
            sim.emit(BDF, sim.nvmlEventTypeXidCriticalError, 79)
            if 79 in ignored:  # the operator's list: XID 79 is then no fault; a later XID 48 is
                sim.emit(BDF, sim.nvmlEventTypeXidCriticalError, 48)
            await _until(lambda: monitor.states[GPU].verdict.health == UNHEALTHY, "the fault")
            verdict = monitor.states[GPU].verdict
            code = "xid-48" if 79 in ignored else "xid-79"
            assert verdict.reason == code and "critical XID" in verdict.message
            assert [t["value"] for t in monitor.taints()[GPU]] == [code]
            await monitor.check_now()  # held: the next rounds keep it
            assert monitor.states[GPU].verdict.reason == code
        finally:
            await monitor.stop()

    asyncio.run(main())


def test_events_that_are_no_fault_are_logged_once_per_while(caplog):
    """An application looping on its page faults (XID 13) or a GPU correcting ECC errors all day:
    the first is logged, then one line per while with how many came between."""
    import logging
    import time

    from agent.health import xid

    sim = SimNvmlEvents()
    watch, faults = _watch(sim)
    now = [time.monotonic()]
    watch.clock = lambda: now[0]
    assert watch.start()
    caplog.set_level(logging.INFO, logger="agent.health.xid")
    try:
        for _ in range(50):
            sim.emit(BDF, sim.nvmlEventTypeXidCriticalError, 13)
        sim.emit(BDF, sim.nvmlEventTypeXidCriticalError, 79)
        assert faults.get(timeout=30)[1] == "xid-79"  # the events before it were handled
        lines = [r.getMessage() for r in caplog.records if "XID 13" in r.getMessage()]
        assert lines == [f"GPU {BDF}: XID 13 (an application's error, ignored)"]
        now[0] += xid.NOTE_EVERY + 1  # + 1: (t + N) - t is below N for some t in floating point
        sim.emit(BDF, sim.nvmlEventTypeXidCriticalError, 13)
        sim.emit(BDF, sim.nvmlEventTypeXidCriticalError, 79)
        assert faults.get(timeout=30)[1] == "xid-79"
        lines = [r.getMessage() for r in caplog.records if "XID 13" in r.getMessage()]
        assert lines[1] == f"GPU {BDF}: XID 13 (an application's error, ignored) (49 more in the last {xid.NOTE_EVERY + 1:.0f} s)"
    finally:
        watch.stop()


def test_a_failed_wait_is_followed_by_registering_again(monkeypatch, caplog):
    """NVML fails a wait (a GPU lost, the driver reloaded): the watch does not end, it registers a
    new event set (after a backoff, while NVML refuses every GPU) and the next fault is seen."""
    from agent.health import xid

    monkeypatch.setattr(xid, "RETRY_FIRST", 0.01)
    sim = SimNvmlEvents()
    wait, register = sim.nvmlEventSetWait_v2, sim.nvmlDeviceRegisterEvents
    failing = {"waits": 1, "registrations": 1}

    def flaky_wait(event_set, timeout_ms):
        if failing["waits"]:
            failing["waits"] -= 1
            raise NVMLError(15)  # NVML_ERROR_GPU_IS_LOST
        return wait(event_set, timeout_ms)

    def flaky_register(h, mask, event_set):
        if len(sim.registered) == 1 and failing["registrations"]:  # the first registering again: refused
            failing["registrations"] -= 1
            raise NVMLError(15)
        return register(h, mask, event_set)

    sim.nvmlEventSetWait_v2, sim.nvmlDeviceRegisterEvents = flaky_wait, flaky_register
    watch, faults = _watch(sim)
    first = None
    assert watch.start()
    try:
        first = watch._set
        sim.emit(BDF, sim.nvmlEventTypeXidCriticalError, 79)
        assert faults.get(timeout=30) == (BDF, "xid-79", "NVML: critical XID 79", None)
        assert watch.outages == 1 and len(sim.registered) == 2 and watch.registered == [BDF]
        assert watch._delay == xid.RETRY_FIRST  # NVML answered since: the next failure's backoff starts afresh
        assert first in sim.freed and watch._set is not first and len(sim.freed) == 2  # the old set, the empty one
    finally:
        watch.stop()
    assert "XID/ECC events not watched until NVML takes them again" in caplog.text
    assert "XID/ECC events watched again on 0000:00:06.0" in caplog.text


def test_a_gpu_bound_to_nvidia_after_the_watch_started_is_watched(tmp_path):
    """NVML manages only GPUs bound to nvidia: one hot-added, or given back from vfio-pci at a VM
    claim's unprepare, after the watch registered its GPUs is in no event set, so its XIDs were
    never seen (until a failed wait or an agent restart). The rescan that shows it on nvidia has
    it registered (by PCI address: NVML finds a GPU at its handle lookup, nvmlInit_v2)."""
    root = profile_root("server-2s-gpu-nic")
    s = settings_for(str(tmp_path), root=root, nvidia_driver_root="/", taint_unhealthy=True)
    inv = scan(root)
    first, later = inv.by_name()["gpu-0000-18-00-0"], inv.by_name()["gpu-0000-19-00-0"]
    before = inv.replace(devices=tuple(d for d in inv.devices if d is not later))
    sim = SimNvmlEvents([SimGpu(bus_id=first.pci.bdf, uuid=first.gpu.nvidia_uuid)])
    latest = {"inv": before}

    async def main():
        monitor = HealthMonitor(s, lambda: latest["inv"])
        await monitor.start()
        try:
            assert await monitor.watch_gpu_events(nvml=open_sim(root, sim, driver_root="/"))
            sim.gpus[later.pci.bdf] = SimGpu(bus_id=later.pci.bdf, uuid=later.gpu.nvidia_uuid)  # bound to nvidia
            monitor.on_inventory(inv)  # the rescan its bind's uevent starts
            await _until(lambda: later.pci.bdf in monitor.xid.registered, "the new GPU registered", timeout=10)
            sim.emit(later.pci.bdf, sim.nvmlEventTypeXidCriticalError, 79)
            await _until(lambda: monitor.states[later.name].verdict.reason == "xid-79", "the fault")
            assert monitor.xid.uuids[later.pci.bdf] == later.gpu.nvidia_uuid
            assert monitor.states[first.name].verdict.health == HEALTHY
        finally:
            await monitor.stop()

    asyncio.run(main())
