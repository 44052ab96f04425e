"""Odd values in a fixture tree cost only themselves (discovery never raises for sysfs or procfs
content): a digit ``str.isdigit`` takes and ``int`` refuses ("²"), a minor or an instance out of
range, a size past the largest quantity the API takes."""

from __future__ import annotations

import os
import re
import shutil

from discovery.inventory import scan
from tests.conftest import copy_profile
from tests.test_discovery_robustness import pristine  # noqa: F401 - a fixture


def test_an_iommu_group_named_by_a_digit_that_is_no_number_costs_only_that_value(pristine, tmp_path):
    """``str.isdigit`` is true of "²" but ``int`` refuses it: a link to a group so named is no
    group, never a ValueError out of the scan (which promises never to raise for sysfs content)."""
    root = str(tmp_path / "root")
    shutil.copytree(pristine, root, symlinks=True)
    victim = scan(root).devices[0]
    link = os.path.join(root, victim.pci.sysfs_path.lstrip("/"), "iommu_group")
    target = os.readlink(link)
    os.unlink(link)
    os.symlink(target.rsplit("/", 1)[0] + "/\u00b2", link)
    dev = scan(root).by_name()[victim.name]
    assert dev.pci.iommu_group is None and "iommuGroup" not in dev.attributes


def _gpu_details_kept(inv) -> None:
    for dev in inv.devices:
        assert not any(p.what == "details" for p in dev.problems), (dev.name, dev.problems)


def test_an_odd_line_in_proc_devices_costs_only_that_line(pristine, tmp_path):
    """One line of /proc/devices whose major is a digit ``int`` refuses: the other majors stand,
    every GPU keeps its device nodes (not each one's details lost to an unexpected error)."""
    root = str(tmp_path / "root")
    shutil.copytree(pristine, root, symlinks=True)
    before = {d.name: d.device_nodes for d in scan(root).devices}
    path = os.path.join(root, "proc/devices")
    text = open(path).read()
    open(path, "w").write(text.replace("Character devices:\n", "Character devices:\n\u00b2 odd\n"))
    inv = scan(root)
    _gpu_details_kept(inv)
    assert {d.name: d.device_nodes for d in inv.devices} == before


def test_a_device_minor_that_is_no_number_is_a_problem_not_the_gpus_details(pristine, tmp_path):
    root = str(tmp_path / "root")
    shutil.copytree(pristine, root, symlinks=True)
    victim = next(d for d in scan(root).devices if d.kind == "gpu" and d.pci.driver == "nvidia")
    path = os.path.join(root, "proc/driver/nvidia/gpus", victim.pci.bdf, "information")
    text = open(path).read()
    open(path, "w").write(re.sub(r"(?m)^Device Minor:.*$", "Device Minor: \t \u00b2", text))
    dev = scan(root).by_name()[victim.name]
    assert not any(p.what == "details" for p in dev.problems), dev.problems
    assert any(p.what == "/dev/nvidiaN" and "Device Minor" in p.reason for p in dev.problems)
    assert dev.gpu.model == victim.gpu.model and dev.capacity == victim.capacity


def test_one_kfd_nodes_odd_property_costs_no_amd_gpu_its_details(tmp_path):
    """Every AMD GPU reads all KFD topology nodes: one node's property whose value is a digit
    ``int`` refuses must not cost each GPU its device nodes and partitions."""
    root = copy_profile(tmp_path, "mi300x-partitions")
    before = {d.name: d.device_nodes for d in scan(root).devices}
    nodes = os.path.join(root, "sys/class/kfd/kfd/topology/nodes")
    name = sorted(os.listdir(nodes), key=int)[-1]
    with open(os.path.join(nodes, name, "properties"), "a") as f:
        f.write("odd_property \u00b2\n")
    inv = scan(root)
    _gpu_details_kept(inv)
    assert {d.name: d.device_nodes for d in inv.devices} == before


def test_an_alveo_instance_out_of_range_makes_no_device_node_with_a_negative_minor(tmp_path):
    """The mgmt PF's ``instance`` is the minor of /dev/xclmgmt<instance>: -1 is none
    (not /dev/xclmgmt-1 with minor -1 for the container's runtime to create)."""
    root = copy_profile(tmp_path, "alveo")
    card = next(d for d in scan(root).devices if d.kind == "fpga")
    d = os.path.join(root, card.pci.sysfs_path.lstrip("/"))
    shutil.rmtree(os.path.join(d, "xrt_mgmt"))  # the instance file alone tells it
    open(os.path.join(d, "instance"), "w").write("-1\n")
    dev = scan(root).by_name()[card.name]
    assert all(0 <= n.minor < 1 << 20 and 0 <= n.major for n in dev.device_nodes), dev.device_nodes
    assert not any("xclmgmt-" in n.path for n in dev.device_nodes)


def test_a_vram_size_past_the_largest_quantity_costs_only_the_memory_capacity(tmp_path):
    """``mem_info_vram_total`` past 2^63-1 bytes is no quantity the API takes: the GPU is published
    without its memory capacity (a problem says why), not refused as a whole by the publisher."""
    from agent.publish.slices import build_pool

    root = copy_profile(tmp_path, "mi300x-partitions")
    victim = next(d for d in scan(root).devices if "memory" in d.capacity)
    with open(os.path.join(root, victim.pci.sysfs_path.lstrip("/"), "mem_info_vram_total"), "w") as f:
        f.write(f"{2**70}\n")
    inv = scan(root)
    dev = inv.by_name()[victim.name]
    assert "memory" not in dev.capacity and any(p.what == "memory" for p in dev.problems)
    pool = build_pool(inv, node_name="node-a", driver_name="sysdra.io")
    assert pool.rejected == ()
