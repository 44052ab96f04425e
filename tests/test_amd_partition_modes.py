"""AMD Instinct partition modes (discovery/partitions.py): which compute modes the kernel takes
in which memory mode, as amdgpu's ``__aqua_vanjaram_is_valid_mode`` decides (each partition
whole XCCs, memory partitions split evenly among compute partitions), and the modes a GPU lists
as available. These decide the mode pairs a GPU is offered in (discovery/gpuways.py) and the
order prepare changes them in (agent/prepare/partitions.py)."""

from __future__ import annotations

import os

from discovery.inventory import scan
from discovery import partitions
from discovery.partitions import COMPUTE_PARTS, MEMORY_PARTS, modes_fit, parse_modes
from tests.partition_node import CPX_GPU, copy_node


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
