"""An XID NVML places in one MIG instance (agent/health/xid.py, gpuevents.py; docs/health.md
"NVIDIA events"): that instance's MIG device is unhealthy and tainted, its GPU and the GPU's other
MIG devices are not; the fault is kept across restarts and cleared like a GPU's. On the simulated
NVML with MIG (tests/simnvml_mig.py: events carry the GPU and compute instance IDs as NVML's do),
under static MIG (the operator's instances) and dynamic MIG (an instance a claim made)."""

from __future__ import annotations

import asyncio
import json
import logging
import os

import pytest

from agent.fsutil import make_dirs
from agent.health.checks import HEALTHY, UNHEALTHY
from agent.health.faults import FILE, FaultStore
from agent.health.monitor import HealthMonitor
from agent.health.xid import XidWatch, mig_instance
from tests.mig_node import BDF, GPU, MigNode, profile, req
from tests.simnvml import SimEvent
from tests.test_gpu_faults import until
from tests.test_mig_prepare import driver_for
from tests.test_mig_static import layout

XID = 0x8  # nvmlEventTypeXidCriticalError
TAINT = {"key": "sysdra.io/unhealthy", "value": "xid-94", "effect": "NoSchedule"}


def test_the_instance_of_an_event():
    assert mig_instance(SimEvent(None, XID, 94)) is None  # NVML's 0xFFFFFFFF: the GPU's own
    assert mig_instance(SimEvent(None, XID, 94, 2, 1)) == (2, 1)
    assert mig_instance(SimEvent(None, XID, 94, 0, 0)) == (0, 0)
    assert mig_instance(SimEvent(None, XID, 94, 2)) is None  # a GPU instance without its compute instance
    assert mig_instance(SimEvent(None, XID, 94, 0xFFFFFFFF, 0)) is None
    assert mig_instance(SimEvent(None, XID, 94, -1, 0)) is None and mig_instance(SimEvent(None, XID, 94, "2", "1")) is None
    assert mig_instance(object()) is None  # bindings whose event data has no instance fields


def static_node(tmp_path, taint_hold: float = 0) -> MigNode:
    node = MigNode(str(tmp_path), nvidia_mig="static", taint_unhealthy=True, taint_hold=taint_hold)
    layout(node)  # gi1-ci0 (1g.18gb), gi2-ci0 and gi2-ci1 (one 3g.71gb split in two)
    make_dirs(node.settings.plugin_dir, 0o750)
    return node


@pytest.fixture
def static(tmp_path):
    return static_node(tmp_path)


async def _monitor(node: MigNode, events: bool = True) -> HealthMonitor:
    monitor = HealthMonitor(node.settings, node.inventory)
    await monitor.start()
    if events:
        assert await monitor.watch_gpu_events(nvml=node.nvml)
    return monitor


def _health(monitor: HealthMonitor) -> dict[str, tuple[str, str]]:
    return {n: (s.verdict.health, s.verdict.reason) for n, s in monitor.device_states()}


def _kept(node: MigNode) -> dict:
    return FaultStore(node.settings.plugin_dir, node.settings.root).load()


def test_watch_reports_the_instance_of_an_xid_and_none_for_ecc(static):
    import queue

    faults: queue.SimpleQueue = queue.SimpleQueue()
    watch = XidWatch(static.nvml, lambda *f: faults.put(f), ignored=(13,), wait_ms=50)
    assert watch.start()
    try:
        static.sim.emit(BDF, XID, 94, gi=2, ci=1)
        static.sim.emit(BDF, XID, 13, gi=2, ci=1)  # an application's: ignored wherever it is
        static.sim.emit(BDF, static.sim.nvmlEventTypeDoubleBitEccError, 0, gi=2, ci=1)  # the GPU's memory
        assert faults.get(timeout=30) == (BDF, "xid-94", "NVML: critical XID 94 in MIG GPU instance 2, compute instance 1", (2, 1))
        assert faults.get(timeout=30) == (BDF, "ecc-double-bit", "NVML: uncorrectable (double-bit) ECC error", None)
        assert faults.empty()
    finally:
        watch.stop()


def test_an_xid_in_a_static_instance_is_that_mig_devices_alone(static):
    one, split0, split1 = f"{GPU}-mig-gi1-ci0", f"{GPU}-mig-gi2-ci0", f"{GPU}-mig-gi2-ci1"

    async def main():
        monitor = await _monitor(static)
        try:
            static.sim.emit(BDF, XID, 94, gi=2, ci=1)
            await until(lambda: (static.inv.devices[0].gpu.nvidia_uuid, split1) in _kept(static))
            assert _health(monitor)[split1] == (UNHEALTHY, "xid-94")
            assert _health(monitor)[one] == _health(monitor)[split0] == (HEALTHY, "")  # its sibling CI too
            assert monitor.states[GPU].verdict.health == HEALTHY  # the GPU (not published whole) is well
            assert monitor.snapshot()[split1][0] == UNHEALTHY
            assert monitor.taints() == {split1: [TAINT]}
            taints = monitor.taints()
            static.sim.emit(BDF, XID, 79)  # then the GPU's own: every MIG device of it says the GPU's
            await until(lambda: monitor.states[GPU].verdict.reason == "xid-79")
            assert {_health(monitor)[n] for n in (one, split0, split1)} == {(UNHEALTHY, "xid-79")}
            return taints
        finally:
            await monitor.stop()

    taints = asyncio.run(main())
    published = {d["name"]: d for s in static.slices(taints) for d in s["spec"].get("devices", ())}
    assert published[split1]["taints"] == [TAINT]
    assert "taints" not in published[one] and "taints" not in published[split0]
    mine, gpus = json.load(open(os.path.join(static.settings.plugin_dir, FILE)))["faults"]
    assert mine["partition"] == split1 and mine["bdf"] == BDF and mine["reason"] == "xid-94"
    assert "partition" not in gpus and gpus["reason"] == "xid-79"  # the GPU's, as before MIG devices had faults


def test_an_instances_fault_outlives_a_restart_and_is_cleared_by_name(static, caplog):
    split1 = f"{GPU}-mig-gi2-ci1"

    async def fault():
        monitor = await _monitor(static)
        try:
            static.sim.emit(BDF, XID, 94, gi=2, ci=1)
            await until(lambda: any(p == split1 for _, p in _kept(static)))
        finally:
            await monitor.stop()

    async def restarted():
        monitor = await _monitor(static, events=False)  # no event comes again: the file says it
        try:
            before = _health(monitor)[split1], monitor.taints()
            store = FaultStore(static.settings.plugin_dir, static.settings.root)
            assert store.clear(f"{GPU}-mig-gi1-ci0") == []  # another MIG device's name: not this one
            assert [f.device for f in store.clear(split1)] == [split1]
            caplog.set_level(logging.INFO, logger="agent.health.faults")
            await monitor.check_now()
            return before, _health(monitor)[split1], monitor.taints()
        finally:
            await monitor.stop()

    asyncio.run(fault())
    before, after, taints = asyncio.run(restarted())
    assert before == ((UNHEALTHY, "xid-94"), {split1: [TAINT]})
    assert after == (HEALTHY, "") and taints == {}
    assert f"device {split1}" in caplog.text and "fault xid-94 cleared" in caplog.text


def test_clearing_the_gpu_clears_its_instances_faults(static):
    """A GPU reset (nvidia-smi -r) resets its instances: `sysdra health clear <gpu>` takes theirs too."""
    store = FaultStore(static.settings.plugin_dir, static.settings.root)
    uuid = static.inv.devices[0].gpu.nvidia_uuid
    store.record(uuid, BDF, "xid-94", "NVML: critical XID 94 in MIG GPU instance 2, compute instance 1", f"{GPU}-mig-gi2-ci1")
    store.record(uuid, BDF, "xid-79", "NVML: critical XID 79")
    assert sorted(f.device for f in store.clear(GPU)) == [GPU, f"{GPU}-mig-gi2-ci1"]
    assert store.load() == {}


def test_an_xid_in_a_dynamic_mig_device_is_that_placements_alone(tmp_path):
    """Dynamic MIG: the claim's instance, made at prepare, is found at its placement through NVML."""
    node = MigNode(str(tmp_path), taint_unhealthy=True, taint_hold=0)
    make_dirs(node.settings.plugin_dir, 0o750)
    d = driver_for(node)
    c = node.allocated("a", req("m", profile("3g.71gb")))
    res = d.prepare_claims([c])[c["metadata"]["uid"]]
    assert not res.error, res.error
    (dev,) = [r.device for r in res.devices]
    ((gi, made),) = node.sim.instances().items()

    async def main():
        monitor = await _monitor(node)
        try:
            node.sim.emit(BDF, XID, 94, gi=int(gi), ci=int(next(iter(made["cis"]))))
            await until(lambda: any(p == dev for _, p in _kept(node)))
            health = _health(monitor)
            assert health[dev] == (UNHEALTHY, "xid-94") and health[GPU] == (HEALTHY, "")
            assert [n for n, h in health.items() if h[0] == UNHEALTHY] == [dev]  # no other placement
            assert monitor.taints() == {dev: [TAINT]}
        finally:
            await monitor.stop()

    asyncio.run(main())


def test_an_instance_published_as_no_device_is_the_gpus_fault(tmp_path, caplog):
    """Without --partitions the GPU is the device a claim got; an instance the layout no longer
    has (gone between the XID and its lookup) is no device either: the GPU takes the fault."""
    for partitions, gi in ((False, 2), (True, 7)):
        node = MigNode(str(tmp_path / f"p{partitions}"), nvidia_mig="static", partitions=partitions)
        layout(node)
        make_dirs(node.settings.plugin_dir, 0o750)

        async def main():
            monitor = await _monitor(node)
            try:
                node.sim.emit(BDF, XID, 94, gi=gi, ci=0)
                await until(lambda: monitor.states[GPU].verdict.reason == "xid-94")
                assert [p for _, p in _kept(node)] == [None]
                if partitions:  # every MIG device of the GPU is no healthier than it
                    assert {h for n, h in _health(monitor).items() if n.startswith(GPU)} == {(UNHEALTHY, "xid-94")}
            finally:
                await monitor.stop()

        asyncio.run(main())
    assert "an instance published as no device: the GPU's fault" in caplog.text


def test_another_gpu_hotplugged_into_the_slot_does_not_get_an_instances_fault(static):
    """As tests/test_gpu_faults.py's hotplug test, for a MIG device's own fault: another GPU (another
    UUID) put in the slot while the agent runs has MIG devices of the same names; they do not get
    the old GPU's instance fault (a restart would not give it to them either)."""
    split1 = f"{GPU}-mig-gi2-ci1"
    inv = static.inv
    gpu = inv.by_name()[GPU]
    without = inv.replace(devices=tuple(d for d in inv.devices if d.name != GPU))
    other = inv.replace(devices=tuple(d.replace(gpu=d.gpu.replace(nvidia_uuid="GPU-00000000-1111-2222-3333-444444444444"))
                                      if d.name == GPU else d for d in inv.devices))
    current = [inv]

    async def main():
        monitor = HealthMonitor(static.settings, lambda: current[0])
        await monitor.start()
        try:
            assert await monitor.watch_gpu_events(nvml=static.nvml)
            static.sim.emit(BDF, XID, 94, gi=2, ci=1)
            await until(lambda: (gpu.gpu.nvidia_uuid, split1) in _kept(static))
            assert _health(monitor)[split1] == (UNHEALTHY, "xid-94")
            monitor.on_inventory(without)
            await monitor.check_now()
            monitor.on_inventory(other)
            await monitor.check_now()
            return _health(monitor)[split1], monitor.taints()
        finally:
            await monitor.stop()

    health, taints = asyncio.run(main())
    assert health == (HEALTHY, "") and split1 not in taints


def test_an_instances_taint_is_held_after_its_fault_is_cleared_as_a_gpus_is(tmp_path):
    """``taint_hold`` (docs/health.md): a device that recovers keeps its taint a while; a MIG
    device whose own fault is cleared is no exception (it stays on the node), until the hold ends."""
    node, split1 = static_node(tmp_path, taint_hold=60), f"{GPU}-mig-gi2-ci1"

    async def main():
        monitor = await _monitor(node)
        try:
            node.sim.emit(BDF, XID, 94, gi=2, ci=1)
            await until(lambda: any(p == split1 for _, p in _kept(node)))
            await monitor.check_now()
            assert monitor.taints() == {split1: [TAINT]}
            assert [f.device for f in FaultStore(node.settings.plugin_dir, node.settings.root).clear(split1)] == [split1]
            await monitor.check_now()
            assert _health(monitor)[split1] == (HEALTHY, "") and monitor.taints() == {split1: [TAINT]}  # held
            real = monitor.clock
            monitor.clock = lambda: real() + monitor.taint_hold
            assert monitor.taints() == {}
        finally:
            await monitor.stop()

    asyncio.run(main())
