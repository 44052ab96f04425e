"""``nvidia_mps_pod`` turned on or off at a restart while shares are prepared (agent/prepare/mps.py):
a daemon the other launcher started keeps serving the shares' running containers, supervised and
ended as what it is (a process of the agent's, a pod of its own), and the daemons started from
then on are the new launcher's. Before, its record was taken for a dead daemon of the new kind: its
pipe's control file removed under the shares, a new daemon started beside it, the old one never
stopped. The processes are the stand-in control binary (tests/fake_mps_control.py), the pods the
real kube-apiserver's (tests/test_mps_pods.py: no kubelet runs them). Root only."""

from __future__ import annotations

import os

import psutil

from agent.prepare.mps import MpsDaemons
from agent.prepare.mps_pods import pod_name
from agent.prepare.mps_records import MpsRecord
from tests.test_mps import UUID, binary, kill_daemons  # noqa: F401 - fixtures
from tests.test_mps_pods import chart, force_delete, kubelet_dir, plugin  # noqa: F401 - fixtures


def test_a_process_daemon_keeps_serving_when_pods_are_turned_on(apiserver, chart, plugin, binary):
    before = MpsDaemons(str(plugin), binary)
    try:
        assert before.reconcile({UUID}) == {}
        rec = before.state.daemons[UUID]
        launcher = chart.launcher(plugin)
        launcher.start_timeout = 1.0  # no kubelet runs a pod here
        after = MpsDaemons(str(plugin), binary, launcher=launcher)  # the restart with nvidia_mps_pod
        assert after.reconcile({UUID}) == {}
        assert after.state.daemons[UUID] == rec and after.alive(rec) and after.alive_all({UUID: rec}) == {UUID: True}
        assert os.path.exists(os.path.join(after.dirs(UUID)["pipe"], "control"))  # the shares' daemon answers
        assert chart.api.get(pod_name(UUID)) is None
        after.reconcile(set())  # the last share gone: the process ends as a process does
        assert not psutil.pid_exists(rec.pid) or psutil.Process(rec.pid).status() == psutil.STATUS_ZOMBIE
        assert after.state.daemons == {} and not os.path.exists(os.path.join(after.base, UUID))
    finally:
        kill_daemons([before])
        force_delete(apiserver, UUID)


def test_a_pods_daemon_keeps_serving_when_pods_are_turned_off(tmp_path, binary):
    """Its pod's daemon is a process of the node the agent sees (the DaemonSet's hostPID, systemd):
    taken as the process it is, not killed as a stray under the shares' running containers."""
    plugin = str(tmp_path / "plugin")
    pods = MpsDaemons(plugin, binary)  # stands for the pod's daemon: a process serving the GPU's pipe
    try:
        assert pods.reconcile({UUID}) == {}
        serving = pods.state.daemons[UUID]
        pods.state.daemons[UUID] = MpsRecord(uuid=UUID, pod_uid="0b0c7c8e-1111-4222-8333-444455556666", boot_id="")
        pods._save()
        after = MpsDaemons(plugin, binary)  # the restart without nvidia_mps_pod
        assert after.reconcile({UUID}) == {}
        rec = after.state.daemons[UUID]
        assert rec.pid == serving.pid and after.alive(rec) and rec.pod_uid is None
        assert os.path.exists(os.path.join(after.dirs(UUID)["pipe"], "control"))
        after.reconcile(set())
        assert not psutil.pid_exists(serving.pid) or psutil.Process(serving.pid).status() == psutil.STATUS_ZOMBIE
        assert after.state.daemons == {}
    finally:
        kill_daemons([pods])
        if psutil.pid_exists(serving.pid):
            psutil.Process(serving.pid).kill()


def test_the_supervisor_of_an_agent_without_pods_adopts_the_pod_another_agent_started(tmp_path, binary):
    """A surge update that turns pods on: the new agent's pod serves the GPU (its record says so) while
    the old agent, without pod settings, still supervises it. Before, the old agent took the pod's
    record for a dead daemon: it killed the pod's daemon as a stray and started its own."""
    plugin = str(tmp_path / "plugin")
    old = MpsDaemons(plugin, binary)
    try:
        assert old.reconcile({UUID}) == {}
        serving = old.state.daemons[UUID]
        new = MpsDaemons(plugin, binary)  # writes the record as the new agent's pod has it
        new.state.daemons[UUID] = MpsRecord(uuid=UUID, pod_uid="0b0c7c8e-1111-4222-8333-444455556666", boot_id="")
        new._save()
        assert old.restart(UUID) is None  # the old agent's supervisor, finding its record changed
        assert old.state.daemons[UUID].pid == serving.pid and old.alive(old.state.daemons[UUID])
    finally:
        kill_daemons([old])
        if psutil.pid_exists(serving.pid):
            psutil.Process(serving.pid).kill()


def test_a_pods_daemon_of_the_namespace_of_before_keeps_serving(apiserver, chart, plugin, binary):
    """``nvidia_mps_pod.namespace`` changed at a restart: the record's pod is not in the agent's
    namespace now, and its daemon (a process of the node the agent sees: the chart's hostPID) serves
    the GPU's pipe. It is adopted as that process and ended with the last share; its pod stays until
    deleted by hand (the chart's Role gives the agent no right in the namespace of before). Before,
    it was taken for a dead daemon: its pipe's control file removed under the shares, a pod started
    beside it in the new namespace, and it was never stopped."""
    pods = MpsDaemons(str(plugin), binary)  # stands for the old pod's daemon: a process serving the GPU's pipe
    serving = None
    try:
        assert pods.reconcile({UUID}) == {}
        serving = pods.state.daemons[UUID]
        pods.state.daemons[UUID] = MpsRecord(uuid=UUID, pod_uid="0b0c7c8e-1111-4222-8333-444455556666", boot_id=None)
        pods._save()
        launcher = chart.launcher(plugin)
        launcher.start_timeout = 1.0  # no kubelet runs a pod here
        after = MpsDaemons(str(plugin), binary, launcher=launcher)  # the restart, pods in the chart's namespace
        assert after.reconcile({UUID}) == {}
        rec = after.state.daemons[UUID]
        assert rec.pid == serving.pid and after.alive(rec) and chart.api.get(pod_name(UUID)) is None
        assert os.path.exists(os.path.join(after.dirs(UUID)["pipe"], "control"))
        after.reconcile(set())
        assert not psutil.pid_exists(serving.pid) or psutil.Process(serving.pid).status() == psutil.STATUS_ZOMBIE
    finally:
        kill_daemons([pods])
        if serving is not None and psutil.pid_exists(serving.pid):
            psutil.Process(serving.pid).kill()
        force_delete(apiserver, UUID)
