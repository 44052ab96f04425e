"""AMD GPUs' compute units and SIMDs (discovery/partitions.py ``compute_units``), read from the
KFD topology as AMD's DRA driver reads it, on copies of the mi300x-partitions fixture: a GPU
whose partitions are not all exposed, or whose KFD nodes do not say, gets no count rather than
a wrong one; the published slices pass the real kube-apiserver's schema."""

from __future__ import annotations

import os
import shutil

import kubernetes_validate

from agent.publish.slices import build_pool, render
from discovery.inventory import scan
from tests.conftest import profile_root
from tests.partition_node import CPX_GPU, SPX_GPU, copy_node
from tests.test_allocator import DRIVER, NODE

KFD = "sys/class/kfd/kfd/topology/nodes"
VRAM = {CPX_GPU: "sys/devices/pci0000:00/0000:00:01.1/0000:05:00.0/mem_info_vram_total",
        SPX_GPU: "sys/devices/pci0000:20/0000:20:01.1/0000:27:00.0/mem_info_vram_total"}


def _gpus(root: str) -> dict[str, dict]:
    return {d.name: d.capacity for d in scan(root).devices if d.kind == "gpu"}


def _edit(root: str, node: str, key: str, value: str) -> None:
    path = os.path.join(root, KFD, node, "properties")
    lines = [f"{key} {value}" if line.split(" ")[0] == key else line for line in open(path).read().splitlines()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def test_both_modes_count_the_whole_gpu():
    caps = _gpus(profile_root("mi300x-partitions"))
    for gpu in (CPX_GPU, SPX_GPU):  # eight CPX nodes of 152 SIMDs, or one SPX node of 1216
        assert (caps[gpu]["computeUnits"], caps[gpu]["simdUnits"]) == ("304", "1216")


def test_a_partition_missing_from_kfd_gives_no_count(tmp_path):
    root = copy_node(str(tmp_path / "host"))
    _edit(root, "9", "simd_count", "0")  # CPX partition 7's node no longer a GPU node
    devices = scan(root).by_name()
    caps = {name: d.capacity for name, d in devices.items()}
    assert "computeUnits" not in caps[CPX_GPU] and "simdUnits" not in caps[CPX_GPU]
    assert any(p.what == "partitions" and "CPX has 8 partitions, the kernel exposes 7" in p.reason
               for p in devices[CPX_GPU].problems)
    assert caps[SPX_GPU]["computeUnits"] == "304"


def test_a_node_that_does_not_say_gives_no_count(tmp_path):
    root = copy_node(str(tmp_path / "host"))
    _edit(root, "10", "simd_per_cu", "0")  # the SPX GPU's one node
    caps = _gpus(root)[SPX_GPU]
    assert "computeUnits" not in caps and "memory" in caps  # only the count is left out


def test_a_gpu_without_kfd_nodes_gives_no_count(tmp_path):
    root = copy_node(str(tmp_path / "host"))
    shutil.rmtree(os.path.join(root, KFD))  # amdgpu without its compute driver (KFD) up
    os.unlink(os.path.join(root, os.path.dirname(VRAM[SPX_GPU]), "current_compute_partition"))  # one without partitions
    for caps in _gpus(root).values():
        assert "computeUnits" not in caps and "simdUnits" not in caps and "memory" in caps


def test_the_slices_pass_the_api_schema():
    inv = scan(profile_root("mi300x-partitions"), list_attributes=True)
    pool = build_pool(inv, node_name=NODE, driver_name=DRIVER, list_attributes=True, partitions=True, compatibility_groups=True)
    for obj in render(pool, driver_name=DRIVER, node_name=NODE, generation=1, full_name=True):
        kubernetes_validate.validate(obj, "1.37", strict=True)


def test_a_vram_size_that_is_no_size_gives_no_memory(tmp_path):
    """An unreadable size is a problem of the GPU's; a size of none (negative) is no memory."""
    root = copy_node(str(tmp_path / "host"))
    for gpu, text in ((CPX_GPU, "lots\n"), (SPX_GPU, "-5\n")):
        with open(os.path.join(root, VRAM[gpu]), "w") as f:
            f.write(text)
    devices = scan(root).by_name()
    assert "memory" not in devices[CPX_GPU].capacity and "memory" not in devices[SPX_GPU].capacity
    assert any(p.what == "memory" and "not an integer" in p.reason for p in devices[CPX_GPU].problems)
    assert devices[CPX_GPU].capacity["computeUnits"] == "304"  # the rest of the GPU stands


def _drop(root: str, node: str, key: str) -> None:
    path = os.path.join(root, KFD, node, "properties")
    lines = [line for line in open(path).read().splitlines() if line.split(" ")[0] != key]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def test_kfd_properties_missing_cost_that_fact_only(tmp_path):
    """KFD property files are input: a GPU node without ``drm_render_minor`` is no partition the
    agent can hand out (left out, with the count of exposed partitions short), and one without
    ``num_xcc`` leaves the XCC count unknown; neither costs the GPU its other details."""
    root = copy_node(str(tmp_path / "host"), "mi300x-partitions")
    _drop(root, "3", "drm_render_minor")
    _drop(root, "4", "num_xcc")
    (gpu,) = [d for d in scan(root).devices if d.name == CPX_GPU]
    pt = gpu.gpu.partitioning
    assert pt is not None and pt.compute_mode == "CPX" and len(pt.partitions) == 7 and pt.xcds is None
    reasons = [p.reason for p in gpu.problems]
    assert any("CPX has 8 partitions, the kernel exposes 7" in r for r in reasons)
    assert not any("unexpected error" in r for r in reasons)
    assert gpu.capacity.get("memory")
