"""AMD memory modes (NPS) at prepare, on the simulated amdgpu as the kernel behaves
(fixtures/simkernel/amdgpu.py, ``nps_reload``): amdgpu takes a write to
``current_memory_partition`` as a request applied at the next driver reload
(amdgpu_gmc_set_memory_partition: "NPS mode change requested, please remove and reload the
driver"), and the mode shown stays. So the agent never writes it: only the compute modes of the
GPU's current memory mode are published and switched to, a claim needing another memory mode
fails saying what to do, and an older agent's recorded switch gets its compute mode back only."""

from __future__ import annotations

import os
import time

import pytest

from agent.prepare.partitions import memory_refusal
from agent.prepare.records import ModeSwitch
from tests.controlplane import Unschedulable
from tests.kubelet_standin import claim as hand_claim
from tests.partition_node import SPX_GPU, Node, mode_of, part_of
from tests.test_partitions_allocator import gpu_bdf
from tests.test_partitions_prepare import driver_for, prepare
from tests.test_vfio_inuse import wait_until

BDF = gpu_bdf(SPX_GPU)


def _write(node: Node, attr: str, value: str) -> None:
    with open(os.path.join(node.root, "sys/bus/pci/devices", BDF, attr), "w") as f:
        f.write(value + "\n")


def _settle(node: Node, mode: str) -> None:
    """Until the simulator has switched the GPU to ``mode`` (its switch recorded, all partitions up)."""
    wait_until(lambda: mode_of(node.root, BDF) == mode and node.sim.switches[-1:] == [(BDF, *mode.split("/"))]
               and node.sim.gpus[BDF].shown is None, f"switching to {mode}", timeout=5)
    time.sleep(0.05)  # the simulator's stamps taken


def _reloaded_in(node: Node, compute: str, memory: str) -> None:
    """The GPU as a driver reload with a memory mode request leaves it (the operator's doing)."""
    node.sim.nps_reload = False
    _write(node, "current_compute_partition", compute)
    _settle(node, f"{compute}/NPS1")
    _write(node, "current_memory_partition", memory)
    _settle(node, f"{compute}/{memory}")
    node.sim.nps_reload = True
    node.rescan()


def test_a_memory_mode_switch_that_needs_a_driver_reload_leaves_no_request_behind(tmp_path):
    """amdgpu takes a write to current_memory_partition as a request applied at the next driver
    reload (amdgpu_gmc.c: "NPS mode change requested, please remove and reload the driver"); the
    mode shown stays. A claim needing another memory mode cannot be switched at prepare: it fails
    before any write, and the GPU is not left with that mode pending for its next reload."""
    node = Node(str(tmp_path), partition_switch_timeout=0.5)
    with node.sim:
        assert node.sim.nps_reload  # as the kernel, by default
        d = driver_for(node)
        with pytest.raises(Unschedulable):  # not published: only a slice of before, or a hand-made claim, names it
            node.allocated("q4", part_of(SPX_GPU, "QPX/NPS4"))
        c = hand_claim("q4", [("gpu", f"{SPX_GPU}-qpx-nps4-0")])
        err = prepare(d, c).error
        assert err == memory_refusal(BDF, "NPS1", "QPX/NPS4") == (
            "GPU 0000:27:00.0 runs NPS1; QPX/NPS4 needs memory mode NPS4, which amdgpu applies only at a driver "
            "reload: set it on the node (amd-smi / sysfs, then reload amdgpu)"), err
        assert mode_of(node.root, BDF) == "SPX/NPS1" and node.sim.switches == []
        assert node.sim.gpus[BDF].requested_nps in (None, "NPS1"), "NPS4 is applied at the next driver reload"
        assert c["metadata"]["uid"] not in d.checkpoint.claims


def test_the_simulated_amdgpu_only_requests_a_memory_mode(tmp_path):
    """What the refusal rests on: a memory mode written is requested, never shown, and the current
    one written back leaves the request pending (amdgpu_gmc_set_memory_partition)."""
    node = Node(str(tmp_path))
    with node.sim:
        _write(node, "current_memory_partition", "NPS4")
        wait_until(lambda: node.sim.gpus[BDF].requested_nps is not None, "no NPS request", timeout=5)
        _write(node, "current_memory_partition", "NPS1")
        time.sleep(0.1)
        assert mode_of(node.root, BDF) == "SPX/NPS1" and node.sim.gpus[BDF].requested_nps == "NPS4"
        assert node.sim.switches == []


def test_a_gpu_reloaded_in_nps4_offers_and_switches_its_compute_modes_only(tmp_path):
    """A GPU the operator put in NPS4 (a driver reload): its NPS4 partitions are published, QPX and
    CPX, and the whole GPU as it is (SPX runs in NPS1 only); a compute switch works within NPS4, and
    a claim of an NPS1 partition (a slice of before the reload) is refused."""
    node = Node(str(tmp_path))
    with node.sim:
        _reloaded_in(node, "QPX", "NPS4")
        names = sorted(d["name"] for s in node.slices() for d in s["spec"].get("devices", []) if d["name"].startswith(SPX_GPU))
        assert names == [SPX_GPU] + [f"{SPX_GPU}-cpx-nps4-{i}" for i in range(8)] + [f"{SPX_GPU}-qpx-nps4-{i}" for i in range(4)]
        d = driver_for(node)
        switched = len(node.sim.switches)
        old = hand_claim("old", [("gpu", f"{SPX_GPU}-dpx-nps1-0")])
        assert prepare(d, old).error.startswith("GPU 0000:27:00.0 runs NPS4; DPX/NPS1 needs memory mode NPS1")
        c = node.allocated("c", part_of(SPX_GPU, "CPX/NPS4"), count=8)
        assert not prepare(d, c).error
        _settle(node, "CPX/NPS4")  # (the simulator records a switch once its partitions are up)
        assert [s[1:] for s in node.sim.switches[switched:]] == [("CPX", "NPS4")]
        assert node.sim.gpus[BDF].requested_nps is None


def test_an_older_agents_switch_of_the_memory_mode_gets_its_compute_mode_back(tmp_path):
    """An intent recorded by an agent that wrote the memory mode (undone at start or by a retry):
    the compute mode is restored where it runs in the memory mode the GPU shows, and the memory
    mode is said to be the operator's; nothing is written to current_memory_partition."""
    node = Node(str(tmp_path))
    with node.sim:
        d = driver_for(node)
        # the kernel kept NPS4 as a request: QPX/NPS1 shown, SPX back in NPS1
        _write(node, "current_memory_partition", "NPS4")
        _write(node, "current_compute_partition", "QPX")
        _settle(node, "QPX/NPS1")
        note = d.partitions.undo(ModeSwitch(gpu=BDF, from_="SPX/NPS1", to="QPX/NPS4"), {})
        assert note == f"{BDF}: restored SPX/NPS1; memory mode NPS4 may be pending for the next driver reload: the operator's"
        _settle(node, "SPX/NPS1")
        assert node.sim.gpus[BDF].requested_nps == "NPS4"
        # the GPU reloaded in NPS4 (or an older kernel switched it): QPX back in NPS4, not NPS1
        _reloaded_in(node, "CPX", "NPS4")
        note = d.partitions.undo(ModeSwitch(gpu=BDF, from_="QPX/NPS1", to="CPX/NPS4"), {})
        assert note == (f"{BDF}: restored QPX/NPS4; memory mode NPS1 is the operator's: the GPU runs NPS4, and amdgpu "
                        "applies another only at a driver reload")
        _settle(node, "QPX/NPS4")
        # SPX does not run in NPS4: nothing to restore, nothing retried for ever
        switched = len(node.sim.switches)
        note = d.partitions.undo(ModeSwitch(gpu=BDF, from_="SPX/NPS1", to="QPX/NPS4"), {})
        assert note.startswith(f"{BDF}: SPX/NPS1 not restored: SPX does not run in NPS4; memory mode NPS1 is the operator's")
        assert mode_of(node.root, BDF) == "QPX/NPS4" and len(node.sim.switches) == switched
