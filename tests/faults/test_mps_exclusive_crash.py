"""SIGKILL at every step of an MPS daemon's compute mode (``nvidia_mps_exclusive``): the real agent
(``--share gpu``) on a copy of h200-vm, its simulated ``nvidia-cuda-mps-control`` and the simulated
NVML over a state file (tests/simnvml_mig.py: the GPU's compute mode outlives the agent process, as
it outlives it on a GPU), a shared claim, the agent killed after the mode before was recorded,
after the mode changed, after the daemon started (before its PID was recorded), after the daemon
ended and after the mode went back, then restarted. After every restart a prepared claim's GPU is
EXCLUSIVE_PROCESS under a running daemon, and a gone one's is back in its mode before (Default)
with no daemon; the kubelet's retry prepares and unprepares the claim. A reboot (the driver
forgets the mode) leaves nothing to set back."""

from __future__ import annotations

import os

import psutil
import pytest

from tests.faults.harness import Node, run
from tests.faults.test_mig_crash import _crash
from tests.faults.test_mps_daemons import UID, _shared_claim, _status_until
from tests.simnvml import SimGpu
from tests.test_mps import UUID
from tests.simnvml_mig import SimMigNvml

pytestmark = pytest.mark.slow
GPU, BDF = "gpu-0000-00-06-0", "0000:00:06.0"
PREPARE = ["mps:mode-recorded", "mps:exclusive", "mps:launched"]
UNPREPARE = ["mps:ended", "mps:mode-back"]
ENV = {"SYSDRA_SHARE": "gpu", "SYSDRA_NVIDIA_MPS_EXCLUSIVE": "true"}


class MpsNode(Node):
    def __init__(self, tmp: str):
        super().__init__(tmp, profile="h200-vm")
        self.state = os.path.join(self.tmp, "nvml.json")
        self.sim = SimMigNvml([SimGpu()], state=self.state, root=self.root)

    def command(self, cluster: str | None = None) -> list[str]:
        return super().command(cluster) + ["--nvidia-driver-root", "/usr/local/nvidia"]

    def start(self, env: dict | None = None, **kw):
        return super().start(env={"SYSDRA_SIMNVML": self.state, **ENV, **(env or {})}, **kw)

    def mode(self) -> int:
        return self.sim.compute_mode(BDF)

    def daemons(self) -> list[int]:
        """The stand-in control daemons serving this node's MPS directories."""
        base = os.path.join(self.plugin_dir, "mps")
        out = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if (p.info["cmdline"] or [])[-1:] == ["-f"] and p.environ().get("CUDA_MPS_PIPE_DIRECTORY", "").startswith(base) \
                        and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p.pid)
            except psutil.Error:
                continue
        return out


def test_sigkill_at_every_step_of_the_compute_mode(tmp_path, faults):
    node = MpsNode(str(tmp_path))
    claim = _shared_claim(node, GPU)
    outcomes = []
    try:
        for point in PREPARE + UNPREPARE:
            if point in UNPREPARE:  # prepared first, killed while it goes
                node.start()
                assert not run(node.prepare(claim)).claims[UID].error
                assert node.mode() == 3
                node.stop()
                _crash(node, point, lambda: node.unprepare(claim))
            else:
                _crash(node, point, lambda: node.prepare(claim))
            node.start()  # recovery
            if UID in node.check_state().claims:
                assert node.mode() == 3 and len(node.daemons()) == 1, f"{point}: prepared, mode {node.mode()}"
                outcomes.append("kept")
            else:
                assert node.mode() == 0 and node.daemons() == [], f"{point}: gone, mode {node.mode()}\n{node.log_tail()}"
                outcomes.append("undone")
            out = run(node.prepare(claim))  # the kubelet's retry
            assert not out.claims[UID].error, out.claims[UID].error
            assert node.mode() == 3 and len(node.daemons()) == 1
            assert not run(node.unprepare(claim)).claims[UID].error
            assert node.mode() == 0 and node.daemons() == []
            node.check_clean()
            node.stop()
        # a prepare's crash undone, an unprepare's kept
        assert outcomes == ["undone"] * len(PREPARE) + ["kept"] * len(UNPREPARE), outcomes
        node.start()  # sysdra status says what the agent changed
        assert not run(node.prepare(claim)).claims[UID].error
        (pid,) = node.daemons()
        _status_until(node, f"  {UUID}: pid {pid}, serving (0 restarts in the window), Exclusive_Process (was Default)")
        assert not run(node.unprepare(claim)).claims[UID].error
        node.stop()
        # a reboot under a prepared claim: the mode is Default again, the record is another boot's
        node.start()
        assert not run(node.prepare(claim)).claims[UID].error
        node.kill()
        for pid in node.daemons():
            psutil.Process(pid).kill()
        node.sim.reboot()
        node.set_boot_id("boot-2")
        node.start()
        assert node.mode() == 3 and len(node.daemons()) == 1  # the prepared claim's daemon, exclusive again
        assert not run(node.unprepare(claim)).claims[UID].error
        assert node.mode() == 0 and node.daemons() == []
    finally:
        node.stop()
        for pid in node.daemons():
            psutil.Process(pid).kill()
    faults.add("MPS compute mode", "SIGKILL after the mode before was recorded, after EXCLUSIVE_PROCESS, after "
               "the daemon started (its record still the intent), after it ended, after the mode went back; a reboot",
               len(PREPARE + UNPREPARE) + 1,
               f"outcomes {outcomes}: every prepared claim's GPU exclusive under one daemon, every gone one's back "
               "to Default with none; the retries prepared and unprepared")
