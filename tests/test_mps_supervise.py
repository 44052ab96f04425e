"""MPS control daemons supervised and found again (agent/prepare/mps_watch.py, mps_records.py) on
the simulated control binary (tests/fake_mps_control.py): a killed daemon makes its GPU
unhealthy, is started again and the GPU healthy once it answers; restarts are bounded; a daemon
prepare stops is not restarted; a PID the kernel gave to another process is never adopted or
signalled; records of another boot are cleaned, a tmpfs below them unmounted; orphans go at start."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from agent.prepare import mps_records
from agent.prepare.mps import MpsDaemons
from agent.prepare.mps_records import MpsRecord
from agent.prepare.mps_watch import RESTARTS, MpsSupervisor
from tests.conftest import REPO, require_root
from tests.test_mps import OTHER, UUID, binary, daemons  # noqa: F401 - fixtures

TIMEOUT = 15.0


class Health:
    """What the supervisor reports, as the health monitor would get it."""

    def __init__(self):
        self.events: list[tuple[str, tuple | None]] = []
        self.changed = threading.Condition()

    def __call__(self, uuid: str, fault) -> None:
        with self.changed:
            self.events.append((uuid, fault))
            self.changed.notify_all()

    def wait(self, pred, timeout: float = TIMEOUT) -> list:
        with self.changed:
            assert self.changed.wait_for(lambda: pred(self.events), timeout), self.events
            return list(self.events)


@pytest.fixture
def supervised(daemons):  # noqa: F811
    made = []

    def make(d, **kw) -> tuple[MpsSupervisor, Health]:
        health = Health()
        sup = MpsSupervisor(d, health, **{"interval": 0.5, "backoff": 0.05, **kw})
        made.append(sup)
        sup.start()
        return sup, health

    yield make
    for sup in made:
        sup.stop()


def _rounds(sup: MpsSupervisor, n: int) -> None:
    """Wait until the supervisor has done ``n`` more rounds."""
    seen, deadline = sup.rounds, time.monotonic() + TIMEOUT
    while sup.rounds < seen + n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sup.rounds >= seen + n


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def _restarts(result: str) -> float:
    return RESTARTS.values.get((result,), 0.0)


def test_a_killed_daemon_is_unhealthy_restarted_then_healthy(daemons, supervised):  # noqa: F811
    d = daemons()
    assert d.reconcile({UUID, OTHER}) == {}
    old, other = d.state.daemons[UUID], d.state.daemons[OTHER]
    before = _restarts("started")
    _, health = supervised(d)
    _kill(old.pid)
    events = health.wait(lambda ev: (UUID, None) in ev)
    assert events[0][0] == UUID and events[0][1][0] == "mps-daemon-down" and f"pid {old.pid}" in events[0][1][1]
    assert events[1:] == [(UUID, None)]  # one fault, then healthy: nothing about the other GPU
    new = d.state.daemons[UUID]
    assert new.pid != old.pid and d.alive(new) and d.answers(UUID)
    assert new.cmdline == old.cmdline and new.boot_id == old.boot_id  # the same daemon, started again
    assert d.state.daemons[OTHER] == other and d.alive(other)
    assert _restarts("started") == before + 1
    with open(os.path.join(d.dirs(UUID)["log"], "control.log")) as f:  # same dirs, same GPU
        assert [x for x in f.read().splitlines() if x.startswith("started")] == [
            f"started pid {old.pid} CUDA_VISIBLE_DEVICES={UUID}", f"started pid {new.pid} CUDA_VISIBLE_DEVICES={UUID}"]


def test_each_round_that_changed_reports_the_daemons_rows(daemons, supervised):  # noqa: F811
    """What ``sysdra status`` shows: each supervised daemon, where it runs, its state and restarts."""
    d = daemons()
    assert d.reconcile({UUID}) == {}
    old = d.state.daemons[UUID]
    reports = Health()  # its condition and list serve the rows too
    _, health = supervised(d, on_round=lambda rows: reports(None, rows))
    reports.wait(lambda ev: ev and ev[-1][1] == [{"gpu": UUID, "daemon": f"pid {old.pid}", "state": "serving", "restarts": 0}])
    _kill(old.pid)
    health.wait(lambda ev: (UUID, None) in ev)
    new = d.state.daemons[UUID]
    rows = reports.wait(lambda ev: ev[-1][1][0]["daemon"] == f"pid {new.pid}")[-1][1]
    assert rows == [{"gpu": UUID, "daemon": f"pid {new.pid}", "state": "serving", "restarts": 1}]
    count = len(reports.events)
    d.reconcile(set())
    assert reports.wait(lambda ev: len(ev) > count)[-1][1] == []  # no share: nothing supervised


def test_restarts_are_bounded(daemons, supervised, monkeypatch):  # noqa: F811
    env: dict[str, str] = {}
    d = daemons(env=env)
    assert d.reconcile({UUID}) == {}
    first = d.state.daemons[UUID]
    monkeypatch.setattr("agent.prepare.mps_process.ProcessLauncher.start_timeout", 0.3)  # starts that fail, fail fast
    env["FAKE_MPS_NO_PIPE"] = "1"  # from now on every start fails
    failed = _restarts("failed")
    sup, health = supervised(d, max_restarts=3)
    _kill(first.pid)
    events = health.wait(lambda ev: any("gave up after 3 restarts" in f[1] for _, f in ev if f))
    assert all(u == UUID and f is not None for u, f in events)  # never healthy meanwhile
    assert _restarts("failed") == failed + 3
    _rounds(sup, 3)  # past the bound: no more tries
    assert _restarts("failed") == failed + 3 and UUID not in d.state.daemons
    del env["FAKE_MPS_NO_PIPE"]  # the next prepare (or start) reconciles it
    assert d.reconcile({UUID}) == {}
    health.wait(lambda ev: ev[-1] == (UUID, None))


def test_a_daemon_prepare_stops_is_not_restarted(daemons, supervised):  # noqa: F811
    d = daemons()
    d.reconcile({UUID})
    rec = d.state.daemons[UUID]
    started = _restarts("started")
    sup, health = supervised(d)
    d.reconcile(set())  # the last share went
    assert not d.alive(rec)
    _rounds(sup, 2)  # two whole rounds after the stop
    assert health.events == [] and _restarts("started") == started and d.state.daemons == {}


def _unrelated() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_reused_pid_is_never_adopted_or_signalled(daemons):  # noqa: F811
    d = daemons()
    other = _unrelated()
    try:
        p = psutil.Process(other.pid)
        cases = [  # the recorded daemon's PID now names another process
            MpsRecord(uuid=UUID, pid=other.pid, started=p.create_time(), boot_id=d.boot_id,
                      cmdline=["nvidia-cuda-mps-control", "-f"]),  # other command line
            MpsRecord(uuid=UUID, pid=other.pid, started=p.create_time() - 50, boot_id=d.boot_id,
                      cmdline=p.cmdline()),  # other start time
            MpsRecord(uuid=UUID, pid=other.pid, started=p.create_time(), boot_id="another-boot",
                      cmdline=p.cmdline()),  # recorded in another boot
            MpsRecord(uuid=UUID, pid=other.pid, started=p.create_time(), ticks=mps_records.start_ticks(other.pid) - 1,
                      boot_id=d.boot_id, cmdline=p.cmdline()),  # other start, in ticks since boot
        ]
        for rec in cases:
            d.state.daemons = {UUID: rec}
            assert not d.alive(rec)
            assert d.reconcile({UUID}) == {}  # a daemon of its own is started
            assert d.state.daemons[UUID].pid not in (None, other.pid) and d.alive(d.state.daemons[UUID])
            assert other.poll() is None  # never signalled
            d.reconcile(set())
            assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_a_wall_clock_step_does_not_make_a_running_daemon_look_dead(daemons):  # noqa: F811
    """A record's start time in ticks since boot decides (a VM's clock corrected, NTP stepping
    it moves psutil's wall-clock start time of every process); its wall-clock time is kept
    for people."""
    d = daemons()
    assert d.reconcile({UUID}) == {}
    rec = d.state.daemons[UUID]
    assert rec.ticks == mps_records.start_ticks(rec.pid) and rec.started
    stepped = rec.model_copy(update={"started": rec.started + 3600})
    assert d.alive(stepped)
    d.state.daemons[UUID] = stepped
    assert d.reconcile({UUID}) == {} and d.state.daemons[UUID].pid == rec.pid  # adopted, not started again


def test_a_restarted_agent_adopts_the_daemon(daemons):  # noqa: F811
    first = daemons()
    first.reconcile({UUID})
    rec = first.state.daemons[UUID]
    again = daemons()  # the agent after SIGKILL: the same records, a new process
    assert again.reconcile({UUID}) == {} and again.state.daemons[UUID] == rec
    assert [p.pid for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == rec.cmdline
            and p.environ().get("CUDA_VISIBLE_DEVICES") == UUID] == [rec.pid]  # not a second one


SCRIPT = r"""
import os, sys
from agent.prepare.mps import MpsDaemons
plugin, binary, uuid = sys.argv[1:4]
d = MpsDaemons(plugin, binary, boot_id="boot-1")
assert d.reconcile({uuid}) == {}
shm = d.dirs(uuid)["shm"]  # the daemon's tmpfs, mounted by the agent
assert os.path.ismount(shm)
open(os.path.join(shm, "left"), "w").close()
os.kill(d.state.daemons[uuid].pid, 9)  # the reboot ends every process
d.alive(d.state.daemons[uuid])  # reaped
after = MpsDaemons(plugin, binary, boot_id="boot-2")
assert after.reconcile(set()) == {}
print(os.path.ismount(shm), os.path.exists(os.path.join(d.base, uuid)), after.state.daemons)
"""


def test_after_a_reboot_records_are_cleaned_and_a_tmpfs_unmounted(tmp_path, binary):  # noqa: F811
    require_root()
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", SCRIPT,
                          str(tmp_path / "plugin"), binary, UUID], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": REPO}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "{}"]


def test_after_a_reboot_a_needed_daemon_starts_afresh(daemons):  # noqa: F811
    d = daemons()
    d.reconcile({UUID})
    old = d.state.daemons[UUID]
    stale = os.path.join(d.dirs(UUID)["pipe"], "from-the-last-boot")
    open(stale, "w").close()
    _kill(old.pid)
    d.alive(old)
    rebooted = daemons(boot_id="boot-after")
    assert rebooted.reconcile({UUID}) == {}
    new = rebooted.state.daemons[UUID]
    assert new.boot_id == "boot-after" and new.pid != old.pid and rebooted.alive(new)
    assert not os.path.exists(stale)


def test_unrecorded_dirs_are_removed(daemons):  # noqa: F811
    d = daemons()
    os.makedirs(os.path.join(d.base, OTHER, "pipe"))
    os.makedirs(os.path.join(d.base, "not-a-gpu"))
    d.reconcile(set())
    assert sorted(os.listdir(d.base)) == ["daemons.lock", "not-a-gpu"]  # ours only: named after a GPU


PID_NS = r"""
import sys
from agent.prepare.mps import MpsDaemons
d = MpsDaemons(sys.argv[1], sys.argv[2])
assert d.reconcile({sys.argv[3]}) == {}
print(d.state.daemons[sys.argv[3]].pid)
"""  # then it exits: the namespace's init, so the kernel kills the daemon too


def test_daemons_of_a_pod_that_ended_are_started_again_from_records(tmp_path, binary):  # noqa: F811
    """The DaemonSet: the agent and its daemons share the container's PID namespace and end
    together; the next agent finds records naming PIDs of another namespace and starts anew."""
    require_root()
    plugin = str(tmp_path / "plugin")
    out = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", PID_NS, plugin, binary, UUID],
                         cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO}, timeout=60)
    assert out.returncode == 0, out.stderr
    inner = int(out.stdout)
    assert inner < 10  # a PID of the pod's namespace; here it names a kernel thread or nothing
    d = MpsDaemons(plugin, binary)
    assert d.state.daemons[UUID].pid == inner and not d.alive(d.state.daemons[UUID])
    try:
        assert d.reconcile({UUID}) == {}
        rec = d.state.daemons[UUID]
        assert rec.pid != inner and d.alive(rec) and d.answers(UUID)
    finally:
        d.reconcile(set())


def test_the_health_monitor_holds_a_gpu_unhealthy_while_its_daemon_is_down(tmp_path):
    """The supervisor's reports (from its thread) as the health monitor takes them: the GPU with
    that UUID is re-checked at once, Unhealthy (and tainted) while the fault holds, through full
    rounds too, and its own verdict again once the daemon is back."""
    import asyncio

    from agent.health.checks import HEALTHY, UNHEALTHY
    from agent.health.monitor import HealthMonitor
    from discovery.inventory import scan
    from tests.conftest import profile_root
    from tests.kubelet_standin import settings_for

    root = profile_root("h200-vm")
    inv = scan(root)
    gpu = next(d for d in inv.devices if d.kind == "gpu")
    s = settings_for(str(tmp_path), root=root, nvidia_driver_root="/usr/local/nvidia")

    async def until(pred):
        async with asyncio.timeout(TIMEOUT):
            while not pred():
                await asyncio.sleep(0.02)

    async def main():
        monitor = HealthMonitor(s, lambda: inv)
        await monitor.start()
        try:
            assert monitor.states[gpu.name].verdict.health == HEALTHY
            report = ("mps-daemon-down", "MPS control daemon (pid 7) died: being restarted")
            await asyncio.to_thread(monitor.gpu_daemon_fault, gpu.gpu.nvidia_uuid, report)
            await until(lambda: monitor.states[gpu.name].verdict.health == UNHEALTHY)
            assert monitor.states[gpu.name].verdict.reason == "mps-daemon-down"
            assert monitor.taints()[gpu.name][0]["value"] == "mps-daemon-down"
            await monitor.check_now()  # a full round keeps it
            assert monitor.states[gpu.name].verdict.reason == "mps-daemon-down"
            monitor.gpu_daemon_fault("GPU-00000000-0000-0000-0000-000000000000", report)  # another GPU's: not this one's
            await asyncio.to_thread(monitor.gpu_daemon_fault, gpu.gpu.nvidia_uuid, None)
            await until(lambda: monitor.states[gpu.name].verdict.health == HEALTHY)
            assert gpu.name in monitor.taints()  # held a while (docs/health.md), then gone
            monitor.clock = lambda: time.monotonic() + monitor.taint_hold
            assert gpu.name not in monitor.taints()
        finally:
            await monitor.stop()

    asyncio.run(main())


@contextlib.contextmanager
def _stray(d, binary):
    """A daemon of the GPU's pipe dir that no record names (the agent was killed between starting
    it and recording its PID: the record holds the intent only), serving; killed after, if still up."""
    pipe, logs = d.dirs(UUID)["pipe"], d.dirs(UUID)["log"]
    os.makedirs(pipe)
    os.makedirs(logs)
    stray = subprocess.Popen([binary, "-f"], env={**os.environ, "CUDA_VISIBLE_DEVICES": UUID,
                                                  "CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": logs})
    try:
        deadline = time.monotonic() + TIMEOUT
        while not os.path.exists(os.path.join(pipe, "control")) and time.monotonic() < deadline:
            time.sleep(0.02)
        d.state.daemons = {UUID: MpsRecord(uuid=UUID, boot_id=d.boot_id)}  # intent only
        yield stray
    finally:
        if stray.poll() is None:
            stray.kill()
            stray.wait()


def test_a_daemon_started_but_never_recorded_is_ended_before_another_starts(daemons, binary):  # noqa: F811
    """The next start ends that daemon (its pipe dir is the GPU's) and runs one."""
    d = daemons()
    with _stray(d, binary) as stray:
        assert d.reconcile({UUID}) == {}
        stray.wait(10)  # ended (and reaped by the agent: psutil waits for its children)
        assert not psutil.pid_exists(stray.pid)
        rec = d.state.daemons[UUID]
        assert rec.pid != stray.pid and d.alive(rec)
        assert any(d.answers(UUID) for _ in range(3))  # (a client is a Python start here: slow on a loaded machine)


def test_a_daemon_started_but_never_recorded_is_ended_when_no_share_needs_it(daemons, binary):  # noqa: F811
    """The same, but the claim was PrepareStarted: the next start rolls it back and no share needs
    the GPU. That daemon ends too, not left running with its directories removed under it."""
    d = daemons()
    with _stray(d, binary) as stray:
        assert d.reconcile(set()) == {}
        assert d.state.daemons == {} and not os.path.exists(os.path.join(d.base, UUID))
        stray.wait(10)
        assert not psutil.pid_exists(stray.pid)
