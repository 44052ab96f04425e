"""CUDA MPS control daemons (agent/prepare/mps.py) on a stand-in control binary
(tests/fake_mps_control.py): one per GPU that shares need, recorded before it starts, adopted
after an agent restart, restarted when it died, stopped when no share needs it; bad records are
moved aside. The real daemon's enforcement is checked on a real GPU (tests/hardware)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest

from agent.prepare.mps import MpsDaemons
from tests.conftest import REPO

UUID, OTHER = "GPU-7e3a1c52-0d4b-4f6e-9a81-2b3c4d5e6f70", "GPU-00000000-1111-2222-3333-444444444444"


@pytest.fixture
def binary(tmp_path) -> str:
    path = tmp_path / "nvidia-cuda-mps-control"
    path.write_text(f"#!{sys.executable} -u\n" + open(os.path.join(REPO, "tests", "fake_mps_control.py")).read())
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def daemons(tmp_path, binary):
    made = []

    def make(**kw) -> MpsDaemons:
        d = MpsDaemons(str(tmp_path / "plugin"), kw.pop("binary", binary), **kw)
        made.append(d)
        return d

    yield make
    kill_daemons(made)


def kill_daemons(made: list[MpsDaemons]) -> None:
    """Nothing of a test's daemons outlives it."""
    for d in made:
        for rec in list(d.state.daemons.values()):
            if d.alive(rec):
                os.kill(rec.pid, signal.SIGKILL)


def test_one_daemon_per_needed_gpu_started_adopted_and_stopped(daemons):
    d = daemons()
    assert d.reconcile({UUID}) == {}
    rec = d.state.daemons[UUID]
    assert d.alive(rec) and os.path.exists(os.path.join(d.dirs(UUID)["pipe"], "control"))
    with open(os.path.join(d.dirs(UUID)["log"], "control.log")) as f:
        assert f.read() == f"started pid {rec.pid} CUDA_VISIBLE_DEVICES={UUID}\n/dev/shm is the shm dir\n"
    with open(d.path) as f:
        assert json.load(f)["daemons"][UUID]["pid"] == rec.pid
    d.reconcile({UUID})
    assert d.state.daemons[UUID] == rec  # running: kept
    restarted = daemons()  # the agent restarted: found again from its records
    assert restarted.reconcile({UUID}) == {} and restarted.state.daemons[UUID] == rec
    restarted.reconcile(set())
    assert not psutil.pid_exists(rec.pid) or psutil.Process(rec.pid).status() == psutil.STATUS_ZOMBIE
    assert restarted.state.daemons == {} and not os.path.exists(os.path.join(restarted.base, UUID))


def test_a_dead_daemon_is_started_again(daemons):
    d = daemons()
    assert d.reconcile({UUID, OTHER}) == {}
    old, other = d.state.daemons[UUID], d.state.daemons[OTHER]
    os.kill(old.pid, signal.SIGKILL)
    psutil.Process(old.pid).wait(5)
    assert d.reconcile({UUID, OTHER}) == {}
    new = d.state.daemons[UUID]
    assert new.pid != old.pid and d.alive(new)
    assert d.state.daemons[OTHER] == other and d.alive(other)  # the live one is left alone


def test_a_record_of_another_boot_is_not_trusted(daemons):
    d = daemons()
    d.reconcile({UUID})
    live = d.state.daemons[UUID]
    # the same PID with another start: the process after a reboot that got that number
    d.state.daemons[UUID] = live.model_copy(update={"ticks": live.ticks + 360000})
    assert not d.alive(d.state.daemons[UUID])
    # ... also in a record of an agent that kept the wall-clock start time alone
    d.state.daemons[UUID] = live.model_copy(update={"started": live.started - 3600, "ticks": None})
    assert not d.alive(d.state.daemons[UUID])
    assert d.alive(live.model_copy(update={"ticks": None}))


@pytest.mark.parametrize("record", [{"uuid": "x; rm -rf /", "pid": -4}, {"uuid": UUID, "pid": 2**40}])  # no PID is above 2**22
def test_bad_records_are_moved_aside_and_never_used(tmp_path, daemons, record):
    os.makedirs(tmp_path / "plugin" / "mps")
    (tmp_path / "plugin" / "mps" / "daemons.json").write_text(json.dumps({"daemons": {UUID: record}}))
    d = daemons()
    assert d.state.daemons == {}
    assert [n for n in os.listdir(d.base) if n.startswith("daemons.json.invalid.")]
    assert d.reconcile({UUID}) == {}


def test_no_binary_or_a_failed_start_is_the_claims_error(daemons, monkeypatch):
    assert "no nvidia-cuda-mps-control on this node" in daemons(binary=None).reconcile({UUID})[UUID]
    monkeypatch.setattr("agent.prepare.mps_process.ProcessLauncher.start_timeout", 0.5)
    d = daemons(env={"FAKE_MPS_NO_PIPE": "1"})
    err = d.reconcile({UUID})[UUID]
    assert "did not start" in err and UUID not in d.state.daemons


def test_a_share_container_is_a_client_of_its_gpus_daemon(daemons):
    d = daemons()
    edits = d.container_edits(UUID)
    assert edits["env"] == ["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"]
    assert edits["mounts"] == [{"hostPath": d.dirs(UUID)["pipe"], "containerPath": "/tmp/nvidia-mps",
                                "options": ["rw", "nosuid", "nodev", "bind"]},
                               {"hostPath": d.dirs(UUID)["shm"], "containerPath": "/dev/shm",
                                "options": ["rw", "nosuid", "nodev", "bind"]}]


def test_another_agents_records_are_respected(daemons):
    """Two agents of a surge update share the records: what the new one stopped, the old one's
    supervisor does not start again (it reads the records the other saved)."""
    old, new = daemons(), daemons()
    assert old.reconcile({UUID}) == {}
    rec = old.state.daemons[UUID]
    assert new.reconcile({UUID}) == {} and new.state.daemons[UUID] == rec  # adopted
    new.reconcile(set())  # the last share went, through the new agent
    assert not old.dead(UUID, rec)  # the old one's view was out of date: read again
    assert old.watched() == {} and old.restart(UUID) is None
    assert UUID not in old.state.daemons and not os.path.exists(old.dirs(UUID)["pipe"])


def test_two_agents_starting_at_once_run_one_daemon(daemons):
    """The two pods of a surge update reconcile at once: the records' lock makes one start the
    daemon and the other adopt it (without it both start one, the second ending the first)."""
    import threading

    old, new = daemons(), daemons()
    go = threading.Barrier(2)
    errors: list = []

    def agent(d):
        go.wait()
        errors.append(d.reconcile({UUID}))

    threads = [threading.Thread(target=agent, args=(d,)) for d in (old, new)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [{}, {}]
    assert old.state.daemons[UUID] == new.state.daemons[UUID]
    assert serving(old.dirs(UUID)["pipe"]) == [old.state.daemons[UUID].pid]


def serving(pipe: str) -> list[int]:
    """The PIDs of the control daemons running on ``pipe``."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        try:
            if cmd[-1:] == ["-f"] and any(a.endswith("nvidia-cuda-mps-control") for a in cmd) \
                    and p.status() != psutil.STATUS_ZOMBIE and p.environ().get("CUDA_MPS_PIPE_DIRECTORY") == pipe:
                found.append(p.pid)
        except psutil.Error:  # ended meanwhile
            continue
    return found


def test_a_record_with_a_nan_start_time_is_no_process(daemons, tmp_path):
    """A start time of NaN matched any process's (no difference is >= 0.5 from it): a damaged
    record made the agent adopt, then signal, whatever process had that PID."""
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        os.makedirs(tmp_path / "plugin" / "mps")
        (tmp_path / "plugin" / "mps" / "daemons.json").write_text(
            '{"daemons": {"%s": {"uuid": "%s", "pid": %d, "started": NaN}}}' % (UUID, UUID, bystander.pid))
        d = daemons()
        d.reconcile(set())
        assert bystander.poll() is None  # never signalled
        assert d.state.daemons == {}
    finally:
        bystander.kill()
        bystander.wait()


def test_a_damaged_record_costs_only_its_own_daemon(daemons, caplog):
    """Another GPU's daemon is adopted after a restart, not ended as a stray and started again
    (its clients' work lost), when one record of the file is damaged."""
    d = daemons()
    assert d.reconcile({UUID, OTHER}) == {}
    kept = d.state.daemons[OTHER]
    with open(d.path) as f:
        doc = json.load(f)
    doc["daemons"][UUID]["pid"] = "not a pid"
    with open(d.path, "w") as f:
        json.dump(doc, f)
    restarted = daemons()
    assert restarted.state.daemons == {OTHER: kept} and "record 'GPU-7e3a" in caplog.text
    assert [n for n in os.listdir(restarted.base) if n.startswith("daemons.json.invalid.")]  # kept for the operator
    assert restarted.reconcile({UUID, OTHER}) == {}
    assert restarted.state.daemons[OTHER] == kept and restarted.alive(kept)
    assert restarted.state.daemons[UUID].pid != doc["daemons"][OTHER]["pid"]
    with open(restarted.path) as f:
        assert json.load(f)["daemons"][UUID]["pid"] == restarted.state.daemons[UUID].pid  # saved whole again
