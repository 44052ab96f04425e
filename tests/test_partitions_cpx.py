"""CPX on a GPU of fewer than eight XCCs (an MI308X: four): amdgpu makes one partition per XCC, so
CPX is four partitions there, published, switched to and back, and restored at start after an
interrupted switch (on the simulated amdgpu, fixtures/simkernel/amdgpu.py)."""

from __future__ import annotations

import os
import time

from agent.prepare.driver import Driver
from discovery.inventory import scan
from tests.partition_node import SPX_GPU, Node, mode_of, part_of, whole
from tests.test_partitions_allocator import gpu_bdf
from tests.test_partitions_prepare import driver_for, prepare, prepare_crashing_at, ref, spec_nodes


def _four_xccs(node: Node, bdf: str = "0000:27:00.0") -> None:
    """The SPX GPU made an MI308X-like one: 4 XCCs (80 CUs) offering SPX and CPX, as amdgpu lists
    for 4 XCCs. CPX is then 4 partitions of one XCC each (the ROCm capture topology-parsing-mi308:
    4 KFD nodes of ``num_xcc 1`` per GPU; amdgpu: ``num_xcp = NUM_XCC`` in CPX)."""
    props = os.path.join(node.root, "sys/devices/virtual/kfd/kfd/topology/nodes/10/properties")
    with open(props) as f:
        text = f.read().replace("simd_count 1216", "simd_count 320").replace("num_xcc 8", "num_xcc 4")
    with open(props, "w") as f:
        f.write(text)
    with open(os.path.join(node.root, "sys/bus/pci/devices", bdf, "available_compute_partition"), "w") as f:
        f.write("SPX, CPX\n")
    node.sim = type(node.sim)(node.root, delay=node.sim.delay)
    node.inv = scan(node.root)


def test_cpx_on_a_gpu_of_four_xccs_is_four_partitions_and_switches_there_and_back(tmp_path):
    node = Node(str(tmp_path), partition_switch_timeout=1.0)
    _four_xccs(node)
    with node.sim:
        d = driver_for(node)
        bdf = gpu_bdf(SPX_GPU)
        names = [s["name"] for sl in node.slices() for s in sl["spec"].get("devices", []) if s["name"].startswith(SPX_GPU)]
        # CPX/NPS4 too is a mode of 4 XCCs, but NPS4 needs a driver reload: only the current memory mode's
        assert names == [SPX_GPU] + [f"{SPX_GPU}-cpx-nps1-{i}" for i in range(4)], names
        c = node.allocated("c", part_of(SPX_GPU, "CPX/NPS1"), count=4)
        res = prepare(d, c)
        assert not res.error, res.error
        assert mode_of(node.root, bdf) == "CPX/NPS1"
        assert sorted(n for ns in spec_nodes(d, c["metadata"]["uid"]).values() for n in ns if "render" in n) == \
            [f"/dev/dri/renderD{136 + i}" for i in range(4)]
        gpu = node.inv.by_name()[SPX_GPU]
        pt, problems = d.partitions.read(gpu)
        assert len(pt.partitions) == 4 and not problems, problems  # what the kernel shows in CPX is all of it
        # the restore of CPX (an undone switch to SPX) completes once the kernel shows its 4 partitions
        assert d.unprepare_claims([ref(c)]) == {c["metadata"]["uid"]: None}
        d.partitions._apply(gpu, ("CPX", "NPS1"), ("SPX", "NPS1"), 4)
        assert d.partitions.restore(gpu, ("CPX", "NPS1")) == "restored CPX/NPS1"


def test_an_interrupted_switch_away_from_cpx_of_four_partitions_is_undone_at_start(tmp_path):
    """An MI308X in CPX as captured (4 partitions): a claim of its whole GPU switches to SPX and the
    agent dies before the claim completes; the next start puts CPX back and says so."""
    node = Node(str(tmp_path), partition_switch_timeout=1.0)
    _four_xccs(node)
    with node.sim:
        bdf = gpu_bdf(SPX_GPU)
        d = driver_for(node)
        with open(os.path.join(node.root, "sys/bus/pci/devices", bdf, "current_compute_partition"), "w") as f:
            f.write("CPX\n")  # the node as it was found (the operator's mode)
        deadline = time.monotonic() + 5
        while not node.sim.switches and time.monotonic() < deadline:
            time.sleep(0.01)
        node.rescan()
        assert mode_of(node.root, bdf) == "CPX/NPS1"
        assert not [p for p in node.inv.by_name()[SPX_GPU].problems if p.what == "partitions"]
        w = node.allocated("w", whole(SPX_GPU))
        prepare_crashing_at(d, w, "partition:exposed")
        assert mode_of(node.root, bdf) == "SPX/NPS1"
        report = Driver(node.settings, node.inventory).recover()
        assert report.host_restored == [f"{bdf}: restored CPX/NPS1"], report
        assert report.rolled_back == [w["metadata"]["uid"]] and mode_of(node.root, bdf) == "CPX/NPS1"
