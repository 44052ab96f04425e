"""SIGKILL at every step of setting an NVIDIA time slice (``nvidia-smi compute-policy
--set-timeslice``, agent/prepare/steps/timeslice.py): the real agent on a copy of
server-2s-gpu-nic with the simulated nvidia-smi of tests/test_timeslice.py (it logs each call in
the node's root, so what the driver was told outlives the agent process, as the driver's policy
outlives it), a claim of two whole GPUs asking for the Long slice, the agent killed after the
first and the second GPU's set at prepare, after the first and second set back at unprepare, and
around the checkpoint saves, then restarted. After every restart a prepared claim's GPUs are on
Long and a gone claim's back on Default, no other GPU was ever touched, and the kubelet's retry
prepares and unprepares the claim."""

from __future__ import annotations

import json
import os
import sys

import pytest

from discovery.inventory import scan
from tests.faults.harness import DRIVER, Node, run
from tests.faults.test_mig_crash import _crash
from tests.test_timeslice import FAKE_SMI, GPU, GPU2

pytestmark = pytest.mark.slow
UID = "00000000-0000-4000-8000-0000000e5101"
# (kill point, its n-th hit): a prepare's two sets, an unprepare's two sets back
PREPARE = [("driver:prepare:started", 1), ("driver:timeslice:set", 1), ("driver:timeslice:set", 2),
           ("driver:prepare:specs-written", 1), ("driver:prepare:completed", 1)]
UNPREPARE = [("driver:timeslice:set", 1), ("driver:timeslice:set", 2), ("driver:unprepare:saved", 1)]


class SmiNode(Node):
    def __init__(self, tmp: str):
        super().__init__(tmp)
        smi = os.path.join(self.root, "usr/bin/nvidia-smi")
        with open(smi, "w") as f:
            f.write(f"#!{sys.executable}\n" + FAKE_SMI)
        os.chmod(smi, 0o755)
        by_name = scan(self.root).by_name()
        self.uuids = [by_name[GPU].gpu.nvidia_uuid, by_name[GPU2].gpu.nvidia_uuid]

    def calls(self) -> list[str]:
        try:
            with open(os.path.join(self.root, "usr/bin/smi.log")) as f:
                return f.read().splitlines()
        except FileNotFoundError:
            return []

    def slices(self) -> dict[str, int]:
        """Each GPU's time slice as the driver was last told it (GPUs never set: none)."""
        out = {}
        for line in self.calls():
            args = line.split()
            assert args[:2] == ["compute-policy", "-i"] and args[3] == "--set-timeslice", line
            out[args[2]] = int(args[4])
        return out


def ts_claim(node: Node) -> dict:
    c = node.write_claim("ts", [("gpu", GPU), ("gpu", GPU2)], uid=UID)
    c["status"]["allocation"]["devices"]["config"] = [{"source": "FromClaim", "requests": [], "opaque": {
        "driver": DRIVER, "parameters": {"apiVersion": "sysdra.io/v1alpha1", "kind": "GpuConfig",
                                         "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}}}}]
    with open(os.path.join(node.cluster, "resourceclaims", "default", "ts.json"), "w") as f:
        json.dump(c, f)
    return c


def test_sigkill_at_every_step_of_a_time_slice(tmp_path, faults):
    node = SmiNode(str(tmp_path))
    c = ts_claim(node)
    long, default = {u: 3 for u in node.uuids}, {u: 0 for u in node.uuids}

    def prepared(point: str) -> None:
        assert node.slices() == long, f"{point}: claim prepared, time slices {node.slices()}\n{node.log_tail()}"

    def gone(point: str) -> None:
        assert node.slices() in ({}, default), f"{point}: claim gone, time slices {node.slices()}\n{node.log_tail()}"

    outcomes = []
    try:
        for i, (point, nth) in enumerate(PREPARE + UNPREPARE):
            env = {"SYSDRA_FAULT_KILL_NTH": str(nth)}
            if i >= len(PREPARE):  # prepared first, killed while it goes
                node.start()
                assert not run(node.prepare(c)).claims[UID].error
                prepared("before unprepare")
                node.stop()
                _crash(node, point, lambda: node.unprepare(c), env)
            else:
                _crash(node, point, lambda: node.prepare(c), env)
            node.start()  # recovery
            if UID in node.check_state().claims:
                prepared(f"{point} #{nth}")
                outcomes.append("kept")
            else:
                gone(f"{point} #{nth}")
                outcomes.append("undone")
            resp = run(node.prepare(c))  # the kubelet's retry
            assert not resp.claims[UID].error, resp.claims[UID].error
            prepared("retry")
            assert not run(node.unprepare(c)).claims[UID].error
            assert node.slices() == default
            node.check_clean()
            node.stop()
            assert set(node.slices()) == set(node.uuids)  # nothing else was told anything
    finally:
        node.kill()
    # a prepare killed before it completed is undone; an unprepare killed before its save is kept (its retry goes on)
    assert outcomes == ["undone"] * 4 + ["kept"] * 3 + ["undone"], outcomes
    faults.add("Crash anywhere", "SIGKILL at every step of setting an NVIDIA time slice and setting it back "
               "(simulated nvidia-smi)", len(PREPARE + UNPREPARE),
               f"restart: the claim's GPUs on its slice exactly while it is prepared ({outcomes.count('undone')} undone, "
               f"{outcomes.count('kept')} kept), no other GPU touched; the retry prepares and unprepares it")
