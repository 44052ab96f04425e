"""A pod sandbox stopped without its netdev given back (agent/nri/netdev.py): its StopPodSandbox
failed (a prepare or unprepare held the plugin's lock past the runtime's deadline: containerd logs
the failure and removes the sandbox's network namespace all the same), or it stopped while the
agent was not registered (restarting, a node reboot). Such a sandbox stays in the runtime's list
until it is removed: containerd's Synchronize lists it without a network namespace (a stale one is
filtered out), and the kubelet keeps a pod's latest sandbox until a new one runs. Its NIC's netdev
is back on the host (the kernel returns a physical netdev to the host under its name in the pod)
and must get its host name back and go to the pod's next sandbox. On the real kernel, as
tests/test_nri_netdev.py (its namespaces and records); the test moves the veth back as the kernel
gives a NIC's netdev back (a veth dies with its namespace). Root only.
"""

from __future__ import annotations

import subprocess

import pytest

from agent.nri.netdev import NetdevError
from agent.nri.plugin import Pod
from agent.prepare import rtnl
from agent.prepare.metadata.update import Flock
from tests.test_nri_netdev import POD_UID, mover, nets, pod, records, run, write_checkpoint  # noqa: F401 - fixtures


def stopped_unannounced(nets) -> None:
    """The runtime stops the sandbox and removes its network namespace; the kernel gives the NIC's
    netdev back to the host under its name in the pod."""
    rtnl.move(nets.pod, "net1", nets.host, "net1")
    subprocess.run(["ip", "netns", "del", nets.names["pod"]], check=True)


@pytest.fixture
def next_netns(nets):
    """The network namespace of the pod's next sandbox."""
    name = f"{nets.names['pod']}n"
    subprocess.run(["ip", "netns", "add", name], check=True)
    yield f"/run/netns/{name}"
    subprocess.run(["ip", "netns", "del", name], check=False)


def back_on_the_host(tmp_path, nets) -> bool:
    return rtnl.has_link(nets.host, nets.nic) and not rtnl.has_link(nets.host, "net1") \
        and records(tmp_path)[0].get("state", "planned") == "planned"


def test_a_sandbox_stopped_while_the_agent_was_away_gives_its_netdev_back_at_synchronize(tmp_path, nets, next_netns):  # noqa: F811
    """The agent restarted (or the node rebooted) meanwhile; containerd lists the stopped sandbox
    without its namespace. Before, Synchronize took it for a running one: the record became
    ``moving`` (the move into the gone namespace failed), the look every 10 s skipped it, and the
    pod's every next sandbox was refused (``in pod sandbox sb1, which still runs``)."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    run(mover(tmp_path, nets).pod_started(pod(nets)))
    stopped_unannounced(nets)
    after = mover(tmp_path, nets)
    run(after.synchronized([pod(nets, netns=None)]))  # sb1, listed stopped
    run(after.reconcile())
    assert back_on_the_host(tmp_path, nets)
    run(after.pod_started(Pod("sb2", "app", "ns", POD_UID, next_netns)))
    assert rtnl.has_link(next_netns, "net1") and records(tmp_path)[0]["sandbox"] == "sb2"


def test_the_pods_sandbox_run_while_the_agent_was_away_gets_the_netdev_of_its_stopped_one(tmp_path, nets, next_netns):  # noqa: F811
    """After a reboot the kubelet ran the pod's next sandbox before the agent registered: both are
    listed at Synchronize, the stopped one without its namespace. The running one gets the netdev."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    run(mover(tmp_path, nets).pod_started(pod(nets)))
    stopped_unannounced(nets)
    run(mover(tmp_path, nets).synchronized([pod(nets, netns=None), Pod("sb2", "app", "ns", POD_UID, next_netns)]))
    assert rtnl.has_link(next_netns, "net1") and not rtnl.has_link(nets.host, "net1")
    assert records(tmp_path)[0]["state"] == "in-pod" and records(tmp_path)[0]["sandbox"] == "sb2"


def test_a_stop_that_waited_past_the_deadline_leaves_the_netdev_to_the_pods_next_sandbox(tmp_path, nets, next_netns):  # noqa: F811
    """A prepare holds the lock through the StopPodSandbox (an MPS daemon's stop, a VFIO bind's
    polls): the stop fails, the namespace goes. The kubelet's next sandbox of the pod, run right
    after, gets the netdev; before, it was refused as if the stopped one still ran."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    m = mover(tmp_path, nets, lock_timeout=0.2)
    run(m.pod_started(pod(nets)))
    with Flock(str(tmp_path / "serialize.lock"), 1.0):  # a prepare
        with pytest.raises(NetdevError, match="a prepare or unprepare holds it"):
            run(m.pod_stopped(pod(nets)))
    stopped_unannounced(nets)
    run(m.pod_started(Pod("sb2", "app", "ns", POD_UID, next_netns)))
    assert rtnl.has_link(next_netns, "net1") and not rtnl.has_link(nets.host, "net1")
    assert records(tmp_path)[0]["sandbox"] == "sb2"
    run(m.pod_removed(pod(nets)))  # the old one's removal: nothing of it left to give back
    assert rtnl.has_link(next_netns, "net1") and records(tmp_path)[0]["sandbox"] == "sb2"


def test_a_stop_that_failed_is_finished_by_the_look_with_the_hosts_name(tmp_path, nets):  # noqa: F811
    """No next sandbox (the pod deleted, its removal failing too): the look every 10 s gives the
    netdev its host name back and the claim's record says it is on the host."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    m = mover(tmp_path, nets, lock_timeout=0.2)
    run(m.pod_started(pod(nets)))
    with Flock(str(tmp_path / "serialize.lock"), 1.0):
        with pytest.raises(NetdevError):
            run(m.pod_stopped(pod(nets)))
        stopped_unannounced(nets)
        with pytest.raises(NetdevError):
            run(m.pod_removed(pod(nets)))
    run(m.reconcile())
    assert back_on_the_host(tmp_path, nets)


def test_a_container_of_the_pods_next_sandbox_waits_until_the_stopped_ones_netdev_is_in_it(tmp_path, nets, next_netns):  # noqa: F811
    """After a reboot: the pod's next sandbox ran before the agent registered, and its Synchronize
    could not have the lock (the kubelet's prepares), so the record still names the stopped sandbox.
    A container of the next one waits for the netdev, as one of a pod whose record is planned does;
    before, it was created at once without it."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    run(mover(tmp_path, nets).pod_started(pod(nets)))
    stopped_unannounced(nets)
    m = mover(tmp_path, nets, lock_timeout=0.2)
    following = Pod("sb2", "app", "ns", POD_UID, next_netns)
    with Flock(str(tmp_path / "serialize.lock"), 1.0):  # a prepare
        run(m.synchronized([pod(nets, netns=None), following]))
        with pytest.raises(NetdevError, match="cannot be used now"):
            run(m.container_created(following, "app"))
    run(m.container_created(following, "app"))  # the kubelet's next try
    assert rtnl.has_link(next_netns, "net1") and not rtnl.has_link(nets.host, "net1")
    assert records(tmp_path)[0]["state"] == "in-pod" and records(tmp_path)[0]["sandbox"] == "sb2"
