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
