"""SIGKILL at every step of a GPU mode switch: the real agent (``--partitions
--compatibility-groups``) on a copy of mi300x-partitions with the kernel simulator running,
a claim allocated by the scheduler's allocator that needs the GPU switched, the agent killed
at each point of the switch transaction, then restarted. After every restart the GPU is in
exactly one mode with all its partitions, the claim is either prepared in the new mode or
not at all with the old mode restored, and the kubelet's retry then prepares it. Switches are of
the compute mode, within the GPU's memory mode: a claim needing another memory mode is refused
before anything is written (amdgpu applies one only at a driver reload), no request left behind."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from agent.prepare import cdifiles
from agent.tools.demo import read_slices
from fixtures.simkernel.amdgpu import AmdgpuSim
from tests.controlplane import allocate, claim_from
from tests.faults.harness import NODE, Node, run
from tests.partition_node import SPX_GPU, mode_of, part_of
from tests.partition_node import whole as whole_gpu
from tests.test_allocator import CLASSES, claim
from tests.test_partitions_allocator import gpu_bdf, req

pytestmark = pytest.mark.slow
BDF = gpu_bdf(SPX_GPU)
# (kill point, the claim's target mode): every Driver.fault point a switch passes, in order
POINTS = [
    ("driver:prepare:started", "CPX/NPS1"),  # intent on disk, nothing written to the kernel
    ("driver:partition:compute-written", "CPX/NPS1"),  # the kernel is switching
    ("driver:partition:compute-written", "QPX/NPS1"),  # the one write (the memory mode is never written)
    ("driver:partition:compute-written", "DPX/NPS1"),
    ("driver:partition:exposed", "CPX/NPS1"),  # new partitions up, no spec yet
    ("driver:prepare:specs-written", "CPX/NPS1"),  # spec written, entry still PrepareStarted
    ("driver:prepare:completed", "CPX/NPS1"),  # durable: the claim is prepared
    ("journal-written", "CPX/NPS1"),  # the intent's journal record appended, not yet synced
]


class PartitionNode(Node):
    def command(self, cluster: str | None = None) -> list[str]:
        return super().command(cluster) + ["--partitions", "--compatibility-groups"]

    def expected_devices(self) -> list[str]:
        return sorted(d["name"] for s in _slices(self.root) for d in s["spec"].get("devices", []))


def _slices(root: str) -> list[dict]:
    from agent.publish.slices import build_pool, render
    from discovery.inventory import scan

    pool = build_pool(scan(root, list_attributes=True), node_name=NODE, driver_name="sysdra.io", list_attributes=True,
                      partitions=True, compatibility_groups=True)
    return render(pool, driver_name="sysdra.io", node_name=NODE, generation=1, full_name=True)


def _claim(node: Node, name: str, mode: str) -> dict:
    c = claim_from(claim(name, req("gpu", part_of(SPX_GPU, mode))))
    (alloc,) = allocate(_slices(node.root), CLASSES, c, node=NODE)
    results = [(r["request"], r["device"]) for r in alloc["devices"]["results"]]
    return node.write_claim(name, results, uid=c["metadata"]["uid"])


def _complete(node: Node) -> str:
    """The GPU's mode, once the kernel shows every partition of it (settled)."""
    from agent.prepare.partitions import Partitions
    from discovery.inventory import scan

    parts = Partitions(node.root, lambda: scan(node.root), timeout=5)
    gpu = next(d for d in scan(node.root).devices if d.pci.bdf == BDF)
    deadline = time.monotonic() + 5
    while True:
        pt, problems = parts.read(gpu)
        want = {"SPX": 1, "DPX": 2, "QPX": 4, "CPX": 8}[pt.compute_mode]
        if len(pt.partitions) == want and not problems:
            return f"{pt.compute_mode}/{pt.memory_mode}"
        assert time.monotonic() < deadline, f"GPU stuck in {pt.compute_mode}/{pt.memory_mode} with {len(pt.partitions)} partitions"
        time.sleep(0.05)


def test_sigkill_at_every_step_of_a_mode_switch(tmp_path, faults):
    node = PartitionNode(str(tmp_path), profile="mi300x-partitions")
    sim = AmdgpuSim(node.root, delay=0.05).start()
    outcomes = []
    try:
        for i, (point, mode) in enumerate(POINTS):
            assert mode_of(node.root, BDF) == "SPX/NPS1"
            c = _claim(node, f"c{i}", mode)
            uid = c["metadata"]["uid"]
            node.start(env={"SYSDRA_FAULT_KILL_POINT": point})
            node.proc.send_signal(signal.SIGUSR1)
            time.sleep(0.05)
            with pytest.raises(Exception):
                run(node.prepare(c), timeout=20)  # the agent dies in the middle
            node.proc.wait(10)
            assert node.proc.returncode == -signal.SIGKILL, node.log_tail()
            node.start()  # recovery
            node.wait_slices_converge()  # republished (partitions included), no write in flight
            cp = node.check_state()
            settled = _complete(node)
            if uid in cp.claims:
                assert settled == mode, f"{point}: claim prepared, GPU in {settled}"
                outcomes.append("kept")
            else:
                assert settled == "SPX/NPS1", f"{point}: claim rolled back, GPU left in {settled}\n{node.log_tail()}"
                outcomes.append("undone")
            # the kubelet retries: prepared in the claim's mode, with that mode's render node
            resp = run(node.prepare(c))
            assert not resp.claims[uid].error, resp.claims[uid].error
            assert _complete(node) == mode
            with open(cdifiles.list_claim_specs(node.cdi_dir, "sysdra.io")[uid]) as f:
                spec = json.load(f)
            nodes = [n["path"] for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]]
            assert nodes == ["/dev/dri/renderD136", "/dev/kfd"], nodes
            assert not run(node.unprepare(c)).claims[uid].error
            node.check_clean()
            node.stop()
            # back to SPX for the next trial, as a whole-GPU claim would leave it
            with open(os.path.join(node.root, "sys/bus/pci/devices", BDF, "current_compute_partition"), "w") as f:
                f.write("SPX\n")
            time.sleep(0.3)
            assert _complete(node) == "SPX/NPS1"
        # a claim of another memory mode (a slice of before a driver reload, a hand-made claim): refused
        # before any write, and amdgpu is left no NPS4 request for its next reload
        node.start()
        c = node.write_claim("nps4", [("gpu", f"{SPX_GPU}-qpx-nps4-0")], uid="00000000-0000-4000-8000-00000000004e")
        err = run(node.prepare(c)).claims[c["metadata"]["uid"]].error
        assert "runs NPS1; QPX/NPS4 needs memory mode NPS4, which amdgpu applies only at a driver reload" in err, err
        assert _complete(node) == "SPX/NPS1" and sim.gpus[BDF].requested_nps is None
        node.check_clean()
        node.stop()
    finally:
        node.kill()
        sim.stop()
    assert "undone" in outcomes and "kept" in outcomes, outcomes
    faults.add("Crash anywhere", "SIGKILL at every step of a GPU mode switch at prepare (simulated amdgpu)", len(POINTS),
               f"restart: claim prepared in the new mode or rolled back with the old mode restored "
               f"({outcomes.count('undone')} undone, {outcomes.count('kept')} kept); the retry prepares it")


class CountersOnlyNode(Node):
    def command(self, cluster: str | None = None) -> list[str]:
        return super().command(cluster) + ["--partitions"]


def test_the_running_agent_republishes_after_a_switch(tmp_path):
    """Without compatibility groups only the current mode is published: a whole-GPU claim on
    the CPX GPU switches it to SPX, and the agent's slices then drop its CPX partitions."""
    node = CountersOnlyNode(str(tmp_path), profile="mi300x-partitions")
    sim = AmdgpuSim(node.root, delay=0.05).start()
    try:
        node.start()
        cpx = [f"gpu-0000-05-00-0-cpx-nps1-{i}" for i in range(8)]
        # the pool as the scheduler takes it: a publish deletes, updates and creates its slices one
        # by one, and while it is under way the files show part of a pool (read_slices gives [])
        names = lambda: {d["name"] for s in read_slices(node.cluster) for d in s["spec"].get("devices", [])}  # noqa: E731
        deadline = time.monotonic() + 10
        while not set(cpx) <= names():
            assert time.monotonic() < deadline, names()
            time.sleep(0.05)
        c = claim_from(claim("whole", req("gpu", whole_gpu("gpu-0000-05-00-0"))))
        from agent.publish.slices import build_pool, render
        from discovery.inventory import scan

        pool = build_pool(scan(node.root, list_attributes=True), node_name=NODE, driver_name="sysdra.io", list_attributes=True,
                          partitions=True)
        (alloc,) = allocate(render(pool, driver_name="sysdra.io", node_name=NODE, generation=1, full_name=True), CLASSES, c, node=NODE)
        c = node.write_claim("whole", [(r["request"], r["device"]) for r in alloc["devices"]["results"]], uid=c["metadata"]["uid"])
        resp = run(node.prepare(c))
        assert not resp.claims[c["metadata"]["uid"]].error, resp.claims[c["metadata"]["uid"]].error
        assert mode_of(node.root, "0000:05:00.0") == "SPX/NPS1"
        deadline = time.monotonic() + 10
        while (got := names()) & set(cpx) or "gpu-0000-05-00-0" not in got:
            assert time.monotonic() < deadline, f"not republished after the switch: {sorted(got)}"
            time.sleep(0.05)
    finally:
        node.stop()
        sim.stop()
