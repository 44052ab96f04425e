"""An NVIDIA GPU's memory repairs (agent/health/gpumemory.py) in the health monitor's rounds, on
the H200 fixture node with the simulated NVML: a pending row remap taints the GPU until a reset
applies it, a failed one taints it with its own reason (NoExecute where the operator says so), a
GPU without row remapping is asked once, and NVML's answers are input."""

from __future__ import annotations

import asyncio
import logging

import pytest

from agent.health.checks import HEALTHY, UNHEALTHY
from agent.health.gpumemory import RowRemapReader
from agent.health.monitor import HealthMonitor
from discovery.inventory import scan
from tests.conftest import copy_profile
from tests.kubelet_standin import settings_for
from tests.simnvml import SimGpu, SimNvmlEvents, open_sim

BDF, GPU = "0000:00:06.0", "gpu-0000-00-06-0"


@pytest.fixture
def node(tmp_path):
    root = copy_profile(tmp_path, "h200-vm")
    return settings_for(str(tmp_path), root=root, nvidia_driver_root="/usr/local/nvidia", nvml=False,
                        taint_unhealthy=True, taint_hold=0, health_interval=0.05)


async def _until(predicate, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


async def _monitor(s, gpu: SimGpu) -> tuple[HealthMonitor, SimNvmlEvents]:
    inv, sim = scan(s.root), SimNvmlEvents([gpu])
    monitor = HealthMonitor(s, lambda: inv)
    await monitor.start()
    assert await monitor.watch_gpu_events(nvml=open_sim(s.root, sim))
    return monitor, sim


def test_a_pending_remap_taints_the_gpu_until_a_reset_applies_it(node):
    async def main():
        gpu = SimGpu(remapped_rows=(0, 1, 1, 0))
        monitor, _ = await _monitor(node, gpu)
        try:
            await _until(lambda: monitor.states[GPU].verdict.reason == "row-remap-pending")
            v = monitor.states[GPU].verdict
            assert v.health == UNHEALTHY and "1 rows remapped for uncorrectable errors" in v.message
            assert "reset it" in v.message
            assert monitor.taints()[GPU] == [{"key": "sysdra.io/unhealthy", "value": "row-remap-pending", "effect": "NoSchedule"}]
            gpu.remapped_rows = (0, 1, 0, 0)  # the reset applied it: the spare row serves
            await _until(lambda: monitor.states[GPU].verdict.health == HEALTHY)
            assert GPU not in monitor.taints()
        finally:
            await monitor.stop()

    asyncio.run(main())


def test_a_failed_remap_has_its_own_reason_and_the_operators_effect(node):
    async def main():
        s = node.replace(taint_effects={"row-remap-failure": "NoExecute"})
        monitor, _ = await _monitor(s, SimGpu(remapped_rows=(3, 512, 0, 1)))
        try:
            await _until(lambda: monitor.states[GPU].verdict.reason == "row-remap-failure")
            assert "replacing the GPU" in monitor.states[GPU].verdict.message
            assert monitor.taints()[GPU][0]["effect"] == "NoExecute"
        finally:
            await monitor.stop()

    asyncio.run(main())


def test_a_gpu_without_row_remapping_is_asked_once(node, caplog):
    caplog.set_level(logging.INFO, logger="agent.health.gpumemory")
    gpu = SimGpu(unsupported={"remapped_rows"})
    sim = SimNvmlEvents([gpu])
    reader = RowRemapReader(open_sim(node.root, sim))
    assert reader.read(BDF) is None and reader.read(BDF) is None
    assert sim.calls.count(BDF) == 1 and BDF in reader.unsupported
    assert "no row remapping" in caplog.text and "WARNING" not in caplog.text


@pytest.mark.parametrize("answer", [(0, -1, 0, 0), (0, 0, True, 0), (0, 0, 0), "pending", None])
def test_nvml_answers_are_input(node, answer):
    reader = RowRemapReader(open_sim(node.root, SimNvmlEvents([SimGpu(remapped_rows=answer)])))
    assert reader.read(BDF) is None


def test_without_nvml_no_signal(node):
    assert RowRemapReader(None).read(BDF) is None
