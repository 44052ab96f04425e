"""AMD Instinct partition modes (discovery/partitions.py): which compute modes the kernel takes
in which memory mode, as amdgpu's ``__aqua_vanjaram_is_valid_mode`` decides (each partition
whole XCCs, memory partitions split evenly among compute partitions), and the modes a GPU lists
as available. These decide the mode pairs a GPU can run in (discovery/gpuways.py); of them, those
of its current memory mode are published and switched to at prepare (agent/prepare/partitions.py):
amdgpu applies another memory mode only at a driver reload."""

from __future__ import annotations

import os

import pytest

from discovery import gpuways
from discovery.inventory import scan
from discovery import partitions
from discovery.partitions import COMPUTE_PARTS, MEMORY_PARTS, modes_fit, parse_modes
from tests.partition_node import CPX_GPU, SPX_GPU, copy_node


def _fits(memory: str | None, xcds: int | None) -> list[str]:
    return [c for c in COMPUTE_PARTS if modes_fit(c, memory, xcds)]


def test_an_mi300x_takes_the_modes_amdgpu_takes():
    assert _fits("NPS1", 8) == ["SPX", "DPX", "QPX", "CPX"]  # not TPX: 8 XCCs do not split in three
    assert _fits(None, 8) == _fits("NPS1", 8)  # no memory mode read: NPS1's
    assert _fits("NPS2", 8) == ["DPX"]  # QPX and CPX run in NPS1 or NPS4 only
    assert _fits("NPS4", 8) == ["QPX", "CPX"]  # NPS4 takes QPX or CPX on an MI300X


def test_six_xccs_split_in_one_three_or_six():
    assert _fits("NPS1", 6) == ["SPX", "TPX", "CPX"]  # DPX needs a multiple of 4 XCCs; CPX is 6 partitions


def test_modes_follow_amdgpus_rules_per_xcc_count_and_memory_mode():
    """amdgpu (``__aqua_vanjaram_is_valid_mode``, ``__aqua_vanjaram_get_px_mode_info``): DPX needs a
    multiple of 4 XCCs, QPX two XCCs a partition, CPX is one partition per XCC; SPX runs in NPS1,
    DPX in NPS1/NPS2, QPX and CPX in NPS1/NPS4 (reference: features section 12)."""
    assert _fits("NPS1", 4) == ["SPX", "DPX", "CPX"]  # not QPX: one XCC a partition
    assert _fits("NPS4", 4) == ["CPX"]
    count = partitions.part_count
    assert [count(c, 4) for c in ("SPX", "DPX", "CPX")] == [1, 2, 4]  # an MI308X in CPX: 4 partitions
    assert count("CPX", 6) == 6 and count("CPX", 8) == 8 and count("CPX", None) == 8


def test_without_an_xcc_count_only_the_memory_mode_decides():
    assert _fits("NPS1", None) == list(COMPUTE_PARTS)
    assert _fits("NPS4", None) == ["QPX", "CPX"]


def test_available_modes_are_the_known_ones_once_in_the_kernels_order():
    assert parse_modes("spx, DPX,SPX  cpx XYZ", COMPUTE_PARTS) == ("SPX", "DPX", "CPX")
    assert parse_modes("NPS1, NPS4, NPS1", MEMORY_PARTS) == ("NPS1", "NPS4")


def test_a_current_mode_the_agent_does_not_know_is_a_problem_and_the_gpu_stays(tmp_path):
    root = copy_node(str(tmp_path / "host"))
    with open(os.path.join(root, "sys/devices/pci0000:00/0000:00:01.1/0000:05:00.0/current_compute_partition"), "w") as f:
        f.write("XPX\n")
    gpu = scan(root).by_name()[CPX_GPU]
    assert gpu.gpu.partitioning is None and "memory" in gpu.capacity
    assert any(p.what == "current_compute_partition" and "unknown mode 'XPX'" in p.reason for p in gpu.problems)


def _modes(ways: list) -> list[str | None]:
    return sorted({w.mode or "as it is" for w in ways})


@pytest.mark.parametrize("memory, published", [
    ("NPS1", ["CPX/NPS1", "DPX/NPS1", "QPX/NPS1", "SPX/NPS1"]),
    ("NPS4", ["CPX/NPS4", "QPX/NPS4", "as it is"]),  # SPX runs in NPS1 only: the whole GPU as it is, no switch
])
def test_only_the_current_memory_modes_ways_are_published(tmp_path, memory, published):
    """Every mode the GPU can run in is a way (a claim of one is recognised, and refused at prepare
    if it needs another memory mode); those of the current memory mode are published."""
    root = copy_node(str(tmp_path / "host"))
    d = os.path.join(root, "sys/bus/pci/devices/0000:27:00.0")
    for attr, value in (("current_compute_partition", "QPX" if memory == "NPS4" else "SPX"), ("current_memory_partition", memory)):
        with open(os.path.join(d, attr), "w") as f:
            f.write(value + "\n")
    gpu = scan(root).by_name()[SPX_GPU]
    other = {"CPX/NPS1", "DPX/NPS1", "QPX/NPS1", "CPX/NPS4", "QPX/NPS4"} - set(published)
    assert _modes(gpuways.ways(gpu)) == sorted({*published, *other})
    assert _modes(gpuways.published_ways(gpu, groups=True)) == published
    assert not other & set(_modes(gpuways.published_ways(gpu, groups=False)))
