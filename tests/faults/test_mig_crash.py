"""SIGKILL at every step of creating and destroying a MIG device, and of turning MIG mode off for
a claim of the whole GPU and back on: the real agent (``--partitions``) on a copy of h200-vm with
the simulated NVML (tests/simnvml_mig.py, its state in a file, so the instances and the mode
outlive the agent process as they outlive it on a GPU), a claim, the agent killed at each point,
then restarted. After every restart the GPU holds exactly the instances of the prepared claims
(none stranded) and is in the mode they need (off for a prepared whole GPU, back on once it is
gone), and the kubelet's retry prepares (or unprepares) the claim."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from agent.prepare import cdifiles
from tests.faults.harness import Node, run
from tests.simnvml import SimGpu
from tests.simnvml_mig import SimMigNvml, placement, write_mig_minors

pytestmark = pytest.mark.slow
GPU = "gpu-0000-00-06-0"
DEVICE = f"{GPU}-mig-2g-35gb-2"  # profile 14, placement (2, 2)
PREPARE = ["driver:prepare:started", "driver:mig:gi-created", "driver:mig:ci-created", "driver:prepare:specs-written",
           "driver:prepare:completed", "journal-written"]
UNPREPARE = ["driver:mig:ci-destroyed", "driver:mig:gi-destroyed", "driver:unprepare:saved"]
WHOLE_PREPARE = ["driver:prepare:started", "driver:migmode:off", "driver:prepare:specs-written",
                 "driver:prepare:completed", "journal-written"]
WHOLE_UNPREPARE = ["driver:migmode:on", "driver:unprepare:saved"]


class MigNode(Node):
    def __init__(self, tmp: str):
        super().__init__(tmp, profile="h200-vm")
        write_mig_minors(self.root)
        self.state = os.path.join(self.tmp, "nvml.json")
        self.sim = SimMigNvml([SimGpu(mig_capable=True, mig=[1, 1])], state=self.state, root=self.root)

    def command(self, cluster: str | None = None) -> list[str]:
        return super().command(cluster) + ["--partitions", "--nvidia-driver-root", "/usr/local/nvidia"]

    def start(self, env: dict | None = None, **kw):
        return super().start(env={"SYSDRA_SIMNVML": self.state, **(env or {})}, **kw)

    def expected_devices(self) -> list[str]:
        return sorted(d["name"] for s in self.read_slices() for d in s["spec"].get("devices", []))

    def mode(self) -> list[int]:
        return self.sim.nvmlDeviceGetMigMode(self.sim.gpus["0000:00:06.0"])

    def instances(self) -> list[tuple[int, int, int]]:
        """(profile, start, compute instances) of every GPU instance on the GPU now."""
        return sorted((g["profile"], g["start"], len(g["cis"])) for g in self.sim.instances().values())


def _caps(node: MigNode, uid: str) -> list[str]:
    with open(cdifiles.list_claim_specs(node.cdi_dir, "sysdra.io")[uid]) as f:
        spec = json.load(f)
    return [n["path"] for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"] if "nvidia-caps" in n["path"]]


def _crash(node: MigNode, point: str, call, env: dict | None = None) -> None:
    node.start(env={**(env or {}), "SYSDRA_FAULT_KILL_POINT": point})
    node.proc.send_signal(signal.SIGUSR1)
    time.sleep(0.05)
    with pytest.raises(Exception):
        run(call(), timeout=20)  # the agent dies in the middle
    node.proc.wait(10)
    assert node.proc.returncode == -signal.SIGKILL, node.log_tail()


def _every_point(node: MigNode, device: str, prepare: list[str], unprepare: list[str], prepared, gone,
                 env: dict | None = None) -> list[str]:
    """A claim of ``device`` killed at each point (of its unprepare: prepared first), the agent
    restarted, the host checked (``prepared(point, uid)`` or ``gone(point)``, as the checkpoint
    says), then the kubelet's retry: prepared once more, unprepared, nothing left -> the outcomes."""
    outcomes = []
    for i, point in enumerate(prepare + unprepare):
        c = node.write_claim(f"c{i}", [("gpu", device)], uid=f"00000000-0000-4000-8000-{i:012d}")
        uid = c["metadata"]["uid"]
        if point in unprepare:  # prepared first, killed while it goes
            node.start(env=env)
            assert not run(node.prepare(c)).claims[uid].error
            node.stop()
            _crash(node, point, lambda: node.unprepare(c), env)
        else:
            _crash(node, point, lambda: node.prepare(c), env)
        node.start(env=env)  # recovery
        if uid in node.check_state().claims:
            prepared(point, uid)
            outcomes.append("kept")
        else:
            gone(point)
            outcomes.append("undone")
        resp = run(node.prepare(c))
        assert not resp.claims[uid].error, resp.claims[uid].error
        prepared("retry", uid)
        assert not run(node.unprepare(c)).claims[uid].error
        gone("retry")
        node.check_clean()
        node.stop()
    assert "undone" in outcomes and "kept" in outcomes, outcomes
    return outcomes


def test_sigkill_at_every_step_of_a_mig_device(tmp_path, faults):
    node = MigNode(str(tmp_path))

    def prepared(point: str, uid: str) -> None:
        assert node.instances() == [(14, 2, 1)], f"{point}: claim prepared, GPU has {node.instances()}"
        assert len(_caps(node, uid)) == 2

    def gone(point: str) -> None:
        assert node.instances() == [], f"{point}: claim gone, instances stranded: {node.instances()}\n{node.log_tail()}"

    try:
        outcomes = _every_point(node, DEVICE, PREPARE, UNPREPARE, prepared, gone)
    finally:
        node.kill()
    faults.add("Crash anywhere", "SIGKILL at every step of creating and destroying a MIG device (simulated NVML)",
               len(PREPARE + UNPREPARE),
               f"restart: the GPU holds exactly the prepared claims' MIG devices ({outcomes.count('undone')} undone, "
               f"{outcomes.count('kept')} kept); the retry prepares and unprepares it")


def test_sigkill_at_every_step_of_mig_mode_off_for_the_whole_gpu(tmp_path, faults):
    """nvidia_mig_enable: a claim of the whole GPU of a GPU in MIG mode turns it off, its
    unprepare back on. Killed anywhere, the restarted agent leaves the GPU off exactly while the
    claim is prepared."""
    node = MigNode(str(tmp_path))

    def prepared(point: str, uid: str) -> None:
        assert node.mode() == [0, 0], f"{point}: claim prepared, MIG mode {node.mode()}"

    def gone(point: str) -> None:
        assert node.mode() == [1, 1] and node.instances() == [], f"{point}: claim gone, MIG mode {node.mode()}\n{node.log_tail()}"

    try:
        outcomes = _every_point(node, GPU, WHOLE_PREPARE, WHOLE_UNPREPARE, prepared, gone, {"SYSDRA_NVIDIA_MIG_ENABLE": "true"})
    finally:
        node.kill()
    faults.add("Crash anywhere", "SIGKILL at every step of turning MIG mode off for a whole-GPU claim and back on (simulated NVML)",
               len(WHOLE_PREPARE + WHOLE_UNPREPARE),
               f"restart: MIG mode off exactly while the claim is prepared ({outcomes.count('undone')} undone, "
               f"{outcomes.count('kept')} kept); the retry prepares and unprepares it")


def test_start_up_destroys_a_stray_mig_device(tmp_path):
    """A GPU instance no checkpoint knows (left by hand or by another tool) is destroyed when the
    agent starts; the agent's own claims keep theirs."""
    node = MigNode(str(tmp_path))
    try:
        node.start()
        c = node.write_claim("mine", [("gpu", DEVICE)], uid="00000000-0000-4000-8000-000000000001")
        assert not run(node.prepare(c)).claims[c["metadata"]["uid"]].error
        node.stop()
        nv = node.sim
        h = nv.nvmlDeviceGetHandleByPciBusId("0000:00:06.0")
        gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, placement(4, 4))  # 3g.71gb
        nv.nvmlGpuInstanceCreateComputeInstance(gi, 2)
        assert node.instances() == [(9, 4, 1), (14, 2, 1)]
        node.start()
        assert node.instances() == [(14, 2, 1)]
        assert not os.path.exists(os.path.join(node.root, "proc/driver/nvidia/capabilities/gpu0/mig/gi2"))
    finally:
        node.kill()
