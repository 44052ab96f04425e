"""Pod sandboxes that started while the agent was not registered with the runtime (containerd
restarted and ran a pod's sandbox before the agent was back; the agent restarting): no
RunPodSandbox comes for them. The next Synchronize moves their claims' netdevs in, and a container
of such a pod is created only once they are there (agent/nri/netdev.py ``_late``,
``container_created``). On the real kernel, as tests/test_nri_netdev.py (its namespaces and
records). Root only.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import threading

import pytest

from agent.nri.netdev import NetdevError
from agent.nri.plugin import Pod
from agent.prepare.metadata.update import Flock, UpdateError
from tests.test_nri_netdev import POD_UID, mover, nets, pod, records, run, where, write_checkpoint  # noqa: F401 - fixtures


def test_a_sandbox_that_started_unseen_gets_its_netdev_at_synchronize(tmp_path, nets, caplog):
    """Before, the record stayed ``planned``: the pod ran for good without its NIC."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    with caplog.at_level(logging.WARNING):
        run(mover(tmp_path, nets).synchronized([pod(nets)]))
    assert where(nets) == (False, True)
    assert records(tmp_path)[0]["state"] == "in-pod" and records(tmp_path)[0]["sandbox"] == "sb1"
    assert "started while the agent was not registered" in caplog.text


def test_a_synchronize_that_cannot_have_the_lock_moves_it_at_the_next_look(tmp_path, nets):
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    m = mover(tmp_path, nets, lock_timeout=0.2)
    with Flock(str(tmp_path / "serialize.lock"), 1.0):  # a prepare
        run(m.synchronized([pod(nets)]))
        assert where(nets) == (True, False)
    run(m.reconcile())
    assert where(nets) == (False, True)


def test_a_container_of_such_a_pod_waits_for_its_netdev(tmp_path, nets):
    """Synchronized while a prepare held the lock: the pod's containers would start without the
    netdev. Their creation is refused while the lock is held, and moves it in once it is free."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    m = mover(tmp_path, nets, lock_timeout=0.2)
    with Flock(str(tmp_path / "serialize.lock"), 1.0):
        run(m.synchronized([pod(nets)]))
        with pytest.raises(NetdevError, match="cannot be used now"):
            run(m.container_created(pod(nets), "app"))
        assert where(nets) == (True, False)
    run(m.container_created(pod(nets), "app"))
    assert where(nets) == (False, True) and records(tmp_path)[0]["sandbox"] == "sb1"
    locked = []
    m._locked = lambda *args, **kw: locked.append(args)
    run(m.container_created(pod(nets), "sidecar"))  # its netdev is in: answered from the look
    assert locked == []


def test_a_container_of_a_pod_without_netdevs_never_waits_for_the_lock(tmp_path, nets):
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    m = mover(tmp_path, nets, lock_timeout=0.2)
    other = Pod("sb9", "web", "ns", "11111111-2222-4333-8444-555555555555", nets.pod)
    with Flock(str(tmp_path / "serialize.lock"), 1.0):
        run(m.container_created(other, "web"))
    assert where(nets) == (True, False)


def test_a_rejected_entry_holds_only_its_own_pods_containers(tmp_path, nets):
    """A claim's entry that fails its checks: its pod's container is refused (never half-served);
    every other container of the node is answered without waiting for the lock."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic, mtu=12)
    m = mover(tmp_path, nets, lock_timeout=0.2)
    other = Pod("sb9", "web", "ns", "11111111-2222-4333-8444-555555555555", nets.pod)
    with Flock(str(tmp_path / "serialize.lock"), 1.0):
        run(m.container_created(other, "web"))
        with pytest.raises(NetdevError, match="cannot be used now"):
            run(m.container_created(pod(nets), "app"))
    with pytest.raises(NetdevError, match="not valid"):
        run(m.container_created(pod(nets), "app"))


def test_a_stopped_sandbox_of_the_pod_is_not_the_one(tmp_path, nets):
    """The runtime lists stopped sandboxes too (their network namespace gone)."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    stopped = Pod("sb0", "app", "ns", POD_UID, "/run/netns/sdt-gone-namespace")
    run(mover(tmp_path, nets).synchronized([stopped, pod(nets)]))
    assert where(nets) == (False, True) and records(tmp_path)[0]["sandbox"] == "sb1"


def test_two_running_sandboxes_of_the_pod_get_nothing(tmp_path, nets, caplog):
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    subprocess.run(["ip", "netns", "add", f"{nets.names['pod']}2"], check=True)
    try:
        second = Pod("sb2", "app", "ns", POD_UID, f"{nets.pod}2")
        run(mover(tmp_path, nets).synchronized([pod(nets), second]))
    finally:
        subprocess.run(["ip", "netns", "del", f"{nets.names['pod']}2"], check=False)
    assert where(nets) == (True, False) and records(tmp_path)[0].get("state", "planned") == "planned"
    assert "2 running sandboxes" in caplog.text


def test_a_host_network_pod_that_started_unseen_has_its_containers_refused(tmp_path, nets, caplog):
    """At Synchronize a sandbox still being created is listed without its network namespace, as a
    host-network pod is: nothing is said of it there (its RunPodSandbox follows). A host-network
    pod's containers are refused, as its sandbox would have been."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    m = mover(tmp_path, nets)
    with caplog.at_level(logging.WARNING):
        run(m.synchronized([pod(nets, netns=None)]))
    assert where(nets) == (True, False) and caplog.records == []
    with pytest.raises(NetdevError, match="uses the host network"):
        run(m.container_created(pod(nets, netns=None), "app"))
    assert where(nets) == (True, False)


def test_the_lock_still_held_at_the_look_is_said_and_tried_again(tmp_path, nets):
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    m = mover(tmp_path, nets, lock_timeout=0.2)
    with Flock(str(tmp_path / "serialize.lock"), 1.0):
        run(m.synchronized([pod(nets)]))
        with pytest.raises(UpdateError):
            run(m.reconcile())
    run(m.reconcile())
    assert where(nets) == (False, True)


def test_a_synchronize_during_the_looks_recovery_is_still_recovered(tmp_path, nets):
    """The runtime restarted twice: the look runs the first Synchronize's recovery (a prepare held
    the lock then) when the second one comes and cannot have the lock. Its recovery is still due:
    the pod's new sandbox, started unseen, gets the netdev at the next look. It was dropped (the
    look said recovery done when its own was), and the pod's containers ran without the netdev."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    run(mover(tmp_path, nets).pod_started(pod(nets)))
    at_fault, go = threading.Event(), threading.Event()

    def slow(point):
        if point == "netdev:returning":
            at_fault.set()
            go.wait(10)

    m = mover(tmp_path, nets, fault=slow, lock_timeout=0.2)

    async def restarts():
        with Flock(str(tmp_path / "serialize.lock"), 1.0):  # a prepare
            await m.synchronized([])  # sb1 stopped while the runtime was away
        look = asyncio.create_task(m.reconcile())  # its recovery: sb1's netdev back to the host
        await asyncio.to_thread(at_fault.wait, 10)
        await m.synchronized([pod(nets, sandbox="sb2")])  # the runtime again: sb2 started unseen
        go.set()
        await look
        await m.reconcile()

    run(restarts())
    assert where(nets) == (False, True) and records(tmp_path)[0]["sandbox"] == "sb2"
