"""AMD Instinct partition modes (discovery/partitions.py): which compute modes the kernel takes
in which memory mode, as amdgpu's ``__aqua_vanjaram_is_valid_mode`` decides (each partition
whole XCCs, memory partitions split evenly among compute partitions), and the modes a GPU lists
as available. These decide the mode pairs a GPU is offered in (discovery/gpuways.py) and the
order prepare changes them in (agent/prepare/partitions.py)."""

from __future__ import annotations

import os

from discovery.inventory import scan
from discovery.partitions import COMPUTE_PARTS, MEMORY_PARTS, modes_fit, parse_modes
from tests.partition_node import CPX_GPU, copy_node


def _fits(memory: str | None, xcds: int | None) -> list[str]:
    return [c for c in COMPUTE_PARTS if modes_fit(c, memory, xcds)]


def test_an_mi300x_takes_the_modes_amdgpu_takes():
    assert _fits("NPS1", 8) == ["SPX", "DPX", "QPX", "CPX"]  # not TPX: 8 XCCs do not split in three
    assert _fits(None, 8) == _fits("NPS1", 8)  # no memory mode read: NPS1's
    assert _fits("NPS2", 8) == ["DPX", "QPX", "CPX"]
    assert _fits("NPS4", 8) == ["QPX", "CPX"]  # NPS4 takes QPX or CPX on an MI300X


def test_six_xccs_split_in_one_two_or_three():
    assert _fits("NPS1", 6) == ["SPX", "DPX", "TPX"]


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
