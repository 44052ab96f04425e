"""A GPU replaced in its slot while the agent runs (hot-swapped; a VM host's GPU detached and
another attached at the same address) is another device under the same name (the PCI
address): it must not inherit the old GPU's health history (a fatal-AER hold of 5 minutes) nor
its held taint (``taint_hold``). The same GPU that comes back keeps its taint, as documented."""

from __future__ import annotations

import asyncio
import os

import pytest

from agent.health.checks import HEALTHY, UNHEALTHY
from agent.health.monitor import HealthMonitor
from discovery.inventory import scan
from tests.conftest import copy_profile, write_file
from tests.kubelet_standin import settings_for
from tests.test_gpu_faults import GPU, UUID

AER = "sys/bus/pci/devices/0000:00:06.0/aer_dev_fatal"
OTHER = "GPU-00000000-1111-2222-3333-444444444444"


def aer(root: str, fatal: int) -> None:
    write_file(root, AER, f"Undefined 0\nTOTAL_ERR_FATAL {fatal}\n")


@pytest.fixture
def faulty(tmp_path):
    """(root, monitor, inventory) with the H200 UNHEALTHY (its fatal AER counter grew) and tainted."""
    root = copy_profile(tmp_path, "h200-vm")
    s = settings_for(str(tmp_path), root=root, nvidia_driver_root="/usr/local/nvidia", nvml=False,
                     taint_unhealthy=True, taint_hold=60)
    aer(root, 0)
    inv = scan(root)
    assert inv.by_name()[GPU].gpu.nvidia_uuid == UUID
    monitor = HealthMonitor(s, lambda: inv)
    asyncio.run(monitor.check_now())
    assert monitor.snapshot()[GPU][0] == HEALTHY, monitor.snapshot()[GPU]
    aer(root, 1)
    asyncio.run(monitor.check_now())
    assert monitor.snapshot()[GPU][2] == "aer-fatal" and monitor.taints()[GPU][0]["value"] == "aer-fatal"
    return root, monitor, inv


def swapped(root: str, monitor: HealthMonitor, inv, uuid: str) -> None:
    """The GPU unplugged (a round sees it gone), then a GPU with ``uuid`` plugged into the slot."""
    without = inv.replace(devices=tuple(d for d in inv.devices if d.name != GPU))
    away = os.path.join(root, "gone")
    os.rename(os.path.join(root, "sys/devices/pci0000:00/0000:00:06.0"), away)
    monitor.on_inventory(without)
    asyncio.run(monitor.check_now())
    assert monitor.snapshot()[GPU][0] == UNHEALTHY
    os.rename(away, os.path.join(root, "sys/devices/pci0000:00/0000:00:06.0"))
    aer(root, 0)  # a new function's counters start at 0
    gpu = inv.by_name()[GPU]
    monitor.on_inventory(inv.replace(devices=tuple(d.replace(gpu=gpu.gpu.replace(nvidia_uuid=uuid)) if d.name == GPU else d
                                                   for d in inv.devices)))
    asyncio.run(monitor.check_now())


def test_another_gpu_in_the_slot_has_no_history(faulty):
    root, monitor, inv = faulty
    swapped(root, monitor, inv, OTHER)
    assert monitor.snapshot()[GPU][0] == HEALTHY, monitor.snapshot()[GPU]
    assert GPU not in monitor.taints()


def test_the_same_gpu_back_keeps_its_taint(faulty):
    root, monitor, inv = faulty
    swapped(root, monitor, inv, UUID)
    assert monitor.taints()[GPU][0]["value"] in ("aer-fatal", "gone")
