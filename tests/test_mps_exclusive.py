"""The compute mode of an MPS daemon's GPU (``nvidia_mps_exclusive``; agent/prepare/computemode.py):
EXCLUSIVE_PROCESS while the daemon runs, the mode before recorded first and set back when it stops,
kept across a daemon's restart and an agent's, never changed when the setting is off or the GPU was
exclusive already; a GPU that refuses it fails the claim and keeps nothing. The daemons run on the
stand-in control binary (tests/fake_mps_control.py), NVML is the simulated one (tests/simnvml.py) under
the agent's own NVML wrapper: no GPU's settings may change here. Root only (the shm tmpfs)."""

from __future__ import annotations

import json
import logging
import os
import signal

import psutil
import pytest

from agent.prepare.computemode import ComputeModes, DaemonModes
from agent.prepare.mps import MpsDaemons
from tests.conftest import profile_root
from tests.simnvml import SimGpu, SimNvml, open_sim
from tests.test_mps import UUID, binary, kill_daemons  # noqa: F401 - the stand-in control binary

DEFAULT, EXCLUSIVE = 0, 3


class Crash(BaseException):
    """Stands for SIGKILL between two steps: no handler of the agent's catches it."""


@pytest.fixture
def gpu():
    return SimGpu(uuid=UUID)


@pytest.fixture
def daemons(tmp_path, binary, gpu):  # noqa: F811
    nvml = open_sim(profile_root("h200-vm"), SimNvml([gpu]))
    made = []

    def make(exclusive: bool = True, nvml_on: bool = True) -> MpsDaemons:
        modes = DaemonModes(ComputeModes(lambda: nvml) if nvml_on else None, exclusive)
        d = MpsDaemons(str(tmp_path / "plugin"), binary, modes=modes)
        made.append(d)
        return d

    yield make
    kill_daemons(made)


def recorded(d: MpsDaemons) -> dict:
    with open(d.path) as f:
        return json.load(f)["daemons"]


def test_exclusive_while_the_daemon_runs_and_set_back_when_it_stops(daemons, gpu):
    d = daemons()
    assert d.reconcile({UUID}) == {}
    assert gpu.compute_mode == EXCLUSIVE and d.alive(d.state.daemons[UUID])
    assert recorded(d)[UUID]["mode_before"] == DEFAULT
    assert d.reconcile(set()) == {}
    assert gpu.compute_mode == DEFAULT and recorded(d) == {}


def test_off_the_mode_is_left_as_it_is(daemons, gpu):
    d = daemons(exclusive=False)
    assert d.reconcile({UUID}) == {}
    assert gpu.compute_mode == DEFAULT and "mode_before" not in recorded(d)[UUID]
    d.reconcile(set())
    assert gpu.compute_mode == DEFAULT


def test_a_gpu_exclusive_already_is_not_the_agents_to_set_back(daemons, gpu):
    gpu.compute_mode = EXCLUSIVE  # the operator's (nvidia-smi -c EXCLUSIVE_PROCESS)
    d = daemons()
    assert d.reconcile({UUID}) == {} and "mode_before" not in recorded(d)[UUID]
    d.reconcile(set())
    assert gpu.compute_mode == EXCLUSIVE


def test_a_prohibited_gpu_gets_prohibited_back(daemons, gpu):
    gpu.compute_mode = 2
    d = daemons()
    assert d.reconcile({UUID}) == {} and gpu.compute_mode == EXCLUSIVE
    d.reconcile(set())
    assert gpu.compute_mode == 2


def test_a_gpu_that_refuses_the_mode_fails_the_claim_and_keeps_nothing(daemons, gpu):
    gpu.unsupported.add("set_compute_mode")  # NVML's answer to a caller without root
    d = daemons()
    err = d.reconcile({UUID})[UUID]
    assert err == (f"GPU {UUID}: setting compute mode Exclusive_Process: Insufficient Permissions "
                   "(nvidia_mps_exclusive; docs/sharing.md)")
    assert recorded(d) == {} and gpu.compute_mode == DEFAULT
    assert not [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [])[-1:] == ["-f"]
                and UUID in " ".join(p.info["cmdline"] or [])]


def test_without_nvml_the_setting_fails_the_claim(daemons):
    err = daemons(nvml_on=False).reconcile({UUID})[UUID]
    assert err == f"GPU {UUID}: its compute mode needs NVML (the setting nvml is off) (nvidia_mps_exclusive; docs/sharing.md)"


def test_a_dead_daemon_started_again_keeps_the_mode_before(daemons, gpu):
    d = daemons()
    d.reconcile({UUID})
    old = d.state.daemons[UUID]
    os.kill(old.pid, signal.SIGKILL)
    psutil.Process(old.pid).wait(5)
    new = d.restart(UUID)  # the supervisor's: the GPU is exclusive now, but not by the operator
    assert new.pid != old.pid and new.mode_before == DEFAULT and gpu.compute_mode == EXCLUSIVE
    d.reconcile(set())
    assert gpu.compute_mode == DEFAULT


def test_an_agent_restarted_with_the_setting_off_still_sets_the_mode_back(daemons, gpu):
    daemons().reconcile({UUID})
    restarted = daemons(exclusive=False)
    assert restarted.reconcile({UUID}) == {}  # adopted as it runs
    assert gpu.compute_mode == EXCLUSIVE
    restarted.reconcile(set())
    assert gpu.compute_mode == DEFAULT


@pytest.mark.parametrize("point", ["mode-recorded", "exclusive", "ended", "mode-back"])
def test_a_crash_at_each_step_leaves_a_record_that_sets_the_mode_back(daemons, gpu, point):
    """Killed after the mode before was saved, after the mode changed (no daemon yet), after the
    daemon ended and after the mode went back: the next agent's reconcile stops what no claim
    needs and the GPU ends in its mode before; one whose claim still needs it runs exclusive."""
    d = daemons()

    def crash(at: str) -> None:
        if at == point:
            raise Crash(at)

    d.fault = crash
    with pytest.raises(Crash):
        d.reconcile({UUID}) if point in ("mode-recorded", "exclusive") else (d.reconcile({UUID}), d.reconcile(set()))
    again = daemons()
    assert again.reconcile({UUID}) == {}  # the claim is still there: its daemon, exclusive
    assert gpu.compute_mode == EXCLUSIVE and again.state.daemons[UUID].mode_before == DEFAULT
    again.reconcile(set())
    assert gpu.compute_mode == DEFAULT and recorded(again) == {}
    gone = daemons()  # and when the crash took the claim too: nothing left, the mode back
    gone.fault = crash
    with pytest.raises(Crash):
        gone.reconcile({UUID}) if point in ("mode-recorded", "exclusive") else (gone.reconcile({UUID}), gone.reconcile(set()))
    daemons().reconcile(set())
    assert gpu.compute_mode == DEFAULT and recorded(gone) == {}


def test_a_mode_that_cannot_be_set_back_is_said_with_the_command(daemons, gpu, caplog):
    d = daemons()
    d.reconcile({UUID})
    gpu.unsupported.add("set_compute_mode")
    with caplog.at_level(logging.ERROR, logger="agent.prepare.computemode"):
        d.reconcile(set())
    assert gpu.compute_mode == EXCLUSIVE
    assert (f"GPU {UUID}: setting compute mode Default: Insufficient Permissions: it stays Exclusive_Process "
            f"until set back (nvidia-smi -i {UUID} -c DEFAULT) or a reboot") in caplog.text


def test_a_daemon_adopted_without_its_record_says_the_mode_stays(daemons, gpu, tmp_path, caplog):
    """The records wiped with the plugin dir while the daemon ran: adopted (it serves the shares), but the
    mode before went with its record, so the GPU stays Exclusive_Process after the last share: said, with
    the command that sets it back. Before, nothing said why the GPU stayed exclusive."""
    d = daemons()
    assert d.reconcile({UUID}) == {} and gpu.compute_mode == EXCLUSIVE
    pid = d.state.daemons[UUID].pid
    os.unlink(d.path)
    again = daemons()
    assert again.reconcile({UUID}) == {} and again.state.daemons[UUID].pid == pid
    assert again.reconcile(set()) == {} and gpu.compute_mode == EXCLUSIVE
    said = [r.getMessage() for r in caplog.records if "no record" in r.getMessage()]
    assert said and f"nvidia-smi -i {UUID} -c DEFAULT" in said[0], said
