"""The health rules of agent/health/checks.py called directly on copies of fixture trees: what
makes a NIC link UNHEALTHY, UNKNOWN or HEALTHY, and which fault names the taint. The monitor
and the gRPC streams over them are tests/test_health.py's."""

from __future__ import annotations

import os
import shutil

from agent.health.checks import HEALTHY, UNHEALTHY, UNKNOWN, Memory, check
from discovery.inventory import scan
from discovery.sysfs import HostFS
from tests.conftest import copy_profile, write_file
from tests.test_health import VM_GPU, VM_GPU_DIR, VM_NIC, VM_NIC_NET


def _nic(tmp_path, operstate: str, carrier: str | None):
    root = copy_profile(tmp_path, "vm-numa-none")
    write_file(root, VM_NIC_NET + "/operstate", operstate + "\n")
    if carrier is None:  # the kernel's EINVAL while the link is administratively down
        os.unlink(os.path.join(root, VM_NIC_NET, "carrier"))
    else:
        write_file(root, VM_NIC_NET + "/carrier", carrier + "\n")
    return check(HostFS(root), scan(root).by_name()[VM_NIC], Memory())


def test_link_states(tmp_path):
    v = _nic(tmp_path / "a", "lowerlayerdown", None)  # decided without the carrier
    assert (v.health, v.reason, v.message) == (UNHEALTHY, "link-down", "interface eth0 operstate lowerlayerdown")
    v = _nic(tmp_path / "b", "down", "0")  # one fault, not a second for the carrier
    assert (v.health, v.message) == (UNHEALTHY, "interface eth0 operstate down")
    assert _nic(tmp_path / "c", "unknown", None).health == UNKNOWN  # no evidence either way
    assert _nic(tmp_path / "d", "unknown", "1").health == HEALTHY
    assert _nic(tmp_path / "e", "up", "0").reason == "no-carrier"


def test_a_nic_without_interfaces_is_unknown(tmp_path):
    root = copy_profile(tmp_path, "vm-numa-none")
    shutil.rmtree(os.path.join(root, VM_NIC_NET))  # moved into a pod's network namespace
    v = check(HostFS(root), scan(root).by_name()[VM_NIC], Memory())
    assert v.health == UNKNOWN and v.message.startswith("no network interface visible")


def test_the_first_fault_names_the_taint(tmp_path):
    root = copy_profile(tmp_path, "vm-numa-none")
    gpu = scan(root).by_name()[VM_GPU]
    fs, mem = HostFS(root), Memory(driver="nvidia")
    write_file(root, VM_GPU_DIR + "/aer_dev_fatal", "TOTAL_ERR_FATAL 1\n")
    check(fs, gpu, mem, now=1000)
    write_file(root, VM_GPU_DIR + "/aer_dev_fatal", "TOTAL_ERR_FATAL 2\n")
    mem.event_fault = ("xid-79", "NVML: critical XID 79")
    v = check(fs, gpu, mem, now=1001)
    assert (v.health, v.reason) == (UNHEALTHY, "aer-fatal")
    assert v.message == "PCIe AER fatal errors increased from 1 to 2; NVML: critical XID 79"


def test_a_long_status_still_gives_a_taint_value_the_api_takes(tmp_path):
    root = copy_profile(tmp_path, "accel-gaudi")
    dev = next(d for d in scan(root).devices if d.kind == "accelerator")
    write_file(root, dev.pci.sysfs_path.lstrip("/") + "/status", "x" * 80 + "\n")
    v = check(HostFS(root), dev, Memory())
    assert (v.health, v.reason) == (UNHEALTHY, "status-" + "x" * 56)  # a label value: at most 63


def test_a_device_rebound_to_another_driver_is_unhealthy(tmp_path):
    root = copy_profile(tmp_path, "vm-numa-none")
    gpu = scan(root).by_name()[VM_GPU]
    v = check(HostFS(root), gpu, Memory(driver="vfio-pci"))  # bound to nvidia now, vfio-pci before
    assert (v.health, v.reason) == (UNHEALTHY, "driver-changed")


def test_the_nvidia_checks_are_for_nvidia_gpus_only(tmp_path):
    """A node with AMD and NVIDIA GPUs: a missing NVIDIA user-space driver is the NVIDIA GPUs'
    fault, never an AMD GPU's."""
    from discovery.nvidia_driver import DriverFiles

    root = copy_profile(tmp_path, "mi300x-partitions")
    amd = next(d for d in scan(root).devices if d.kind == "gpu")
    broken = DriverFiles(driver_root="/", version=None, errors=("no libcuda.so",))
    v = check(HostFS(root), amd, Memory(), nvidia_files=lambda: broken, nvidia_memory=lambda bdf: None)
    assert v.reason != "nvidia-userspace-driver" and "NVIDIA" not in v.message


def test_an_alveo_card_not_ready_is_unhealthy(tmp_path):
    root = copy_profile(tmp_path, "alveo")
    card = next(d for d in scan(root).devices if d.kind == "fpga")
    fs = HostFS(root)
    assert check(fs, card, Memory()).health == HEALTHY
    for bdf in {card.fpga.mgmt_bdf, card.fpga.user_bdf} - {None}:
        write_file(root, os.path.relpath(os.path.realpath(fs.path("sys/bus/pci/devices", bdf)), root) + "/ready", "0\n")
    v = check(fs, card, Memory())
    assert (v.health, v.reason) == (UNHEALTHY, "not-ready")
