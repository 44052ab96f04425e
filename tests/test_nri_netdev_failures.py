"""The NRI netdev mover when things fail (agent/nri/netdev.py): a request the runtime gave up on,
a sandbox whose move failed, a look every 10 s that fails, waits for the locks against the
runtime's request timeout (tests/nri_standin.py plays the runtime). On the real kernel, as
tests/test_nri_netdev.py (its namespaces and records). Root only.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import subprocess
import threading

import pytest

from agent.nri.movelock import LOCK_TIMEOUT
from agent.nri.netdev import NetdevError
from agent.nri.plugin import NriPlugin
from agent.nri.ttrpc import CallError
from agent.prepare.metadata.update import Flock, UpdateError
from agent.protos import nri_v1alpha1_pb2 as api
from tests.controlplane import wait_until
from tests.nri_standin import Runtime, sandbox
from tests.test_nri_netdev import POD_UID, mover, nets, pod, records, run, where, write_checkpoint  # noqa: F401 - fixtures


def test_a_request_the_runtime_gave_up_on_moves_nothing(tmp_path, nets, caplog):
    """The runtime cancels a handler at its deadline (2 s): the worker thread, still waiting for the
    plugin's lock, must not move the netdev into a sandbox the runtime has failed."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    m = mover(tmp_path, nets, lock_timeout=30)
    before = records(tmp_path)
    entered = threading.Event()
    locked = m._locked
    m._locked = lambda *args, **kw: (entered.set(), locked(*args, **kw))[1]  # the thread is on its way to the locks

    async def cancelled_while_waiting():
        flock = Flock(str(tmp_path / "serialize.lock"), 1.0).__enter__()  # a prepare holds the plugin's lock
        try:
            task = asyncio.create_task(m.pod_started(pod(nets)))
            assert await asyncio.to_thread(entered.wait, 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            flock.__exit__()
    with caplog.at_level(logging.INFO, logger="agent.nri.netdev"):
        run(cancelled_while_waiting())  # returns once the worker thread has (asyncio.run waits for it)
    assert where(nets) == (True, False) and records(tmp_path) == before
    assert "the runtime gave up on the request" in caplog.text
    assert "sb1" not in m.pods  # the runtime failed the sandbox
    run(m.pod_started(pod(nets, sandbox="sb2")))  # the kubelet's retry
    assert where(nets) == (False, True)


def test_a_move_waiting_for_another_move_times_out(tmp_path, nets):
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    m = mover(tmp_path, nets, lock_timeout=0.2)

    async def while_another_moves():
        m._lock.acquire()  # a thread of an earlier request still at work
        try:
            with pytest.raises(NetdevError, match="timed out .* another netdev move"):
                await asyncio.wait_for(m.pod_started(pod(nets)), 10)
        finally:
            m._lock.release()
    run(while_another_moves())
    assert where(nets) == (True, False)


def test_a_sandbox_whose_move_failed_leaves_the_netdev_to_the_pods_next_one(tmp_path, nets):
    """The move in fails and so does the give back: the record still names the failed sandbox. The
    kubelet's new sandbox of the pod gets the netdev (the failed one does not run)."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    failing = {"netdev:moved", "netdev:returning"}

    def fail_once(point):
        if point in failing:
            failing.discard(point)
            raise OSError(errno.EIO, f"failed at {point}")

    m = mover(tmp_path, nets, fault=fail_once)
    with pytest.raises(NetdevError, match="giving netdevs back to the host failed"):
        run(m.pod_started(pod(nets, sandbox="sb1")))
    assert records(tmp_path)[0]["sandbox"] == "sb1" and where(nets) == (False, True)
    run(m.pod_started(pod(nets, sandbox="sb2")))  # the kubelet's retry
    assert where(nets) == (False, True) and records(tmp_path)[0]["sandbox"] == "sb2"


def test_the_look_every_10s_survives_an_os_error(tmp_path, nets, caplog):
    """A round that fails with an OSError (the plugin's lock file cannot be opened) is logged; the
    next round looks again."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    m = mover(tmp_path, nets)
    run(m.pod_started(pod(nets)))
    os.unlink(tmp_path / "serialize.lock")
    os.mkdir(tmp_path / "serialize.lock")  # EISDIR for the flock's open
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    watching = asyncio.run_coroutine_threadsafe(m.watch(interval=0.05), loop)
    try:
        wait_until(lambda: "netdev records not looked at" in caplog.text, 30, what="a failed round")
        os.rmdir(tmp_path / "serialize.lock")
        subprocess.run(["ip", "netns", "del", nets.names["pod"]], check=True)
        wait_until(lambda: records(tmp_path)[0].get("state", "planned") == "planned", 30, what="the next round")
    finally:
        watching.cancel()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


async def _as_runtime(tmp_path, m, request_timeout: float, body):
    """``body(start)`` with the plugin registered with a runtime whose request timeout is
    ``request_timeout``; ``start(sandbox_id)`` is its RunPodSandbox of the claim's pod."""
    path = str(tmp_path / "nri.sock")
    runtime = Runtime(path, request_timeout=request_timeout)
    await runtime.start()
    task = asyncio.get_running_loop().create_task(NriPlugin(path, m).run())

    def start(sandbox_id: str):
        app = sandbox("app", m.test_netns, uid=POD_UID)
        app.id = sandbox_id
        return runtime.event(ep, "RunPodSandbox", api.RunPodSandboxRequest(pod=app), api.RunPodSandboxResponse)
    try:
        ep, *_ = await runtime.registered.get()
        return await body(start)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await runtime.stop()


@pytest.mark.parametrize("request_timeout", [1.0, 2.0], ids=["1s", "2s-while-the-10s-look-waits"])
def test_a_move_waiting_for_a_prepare_is_refused_within_the_runtimes_request_timeout(tmp_path, nets, request_timeout):
    """A prepare holds the plugin's lock. The refusal must reach the runtime before its deadline:
    past it containerd drops the plugin and (NRI before 0.12.5) runs the sandbox without its netdev.
    With ``plugin_request_timeout = "1s"`` the lock wait alone (1.5 s) outlasted it; with the default
    2 s, the thread lock (held by the 10 s look, itself waiting for the flock) and the flock were
    waited for one after the other."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    m = mover(tmp_path, nets)
    m.test_netns = nets.pod
    lock = str(tmp_path / "serialize.lock")

    async def body(start):
        await start("sb1")  # in the pod: the 10 s look has a record to look at
        with Flock(lock, 1.0):  # a prepare
            looking = asyncio.ensure_future(m.reconcile()) if request_timeout == 2.0 else None
            if looking is not None:
                await asyncio.to_thread(wait_until, m._lock.locked, 30, what="the look to hold the thread lock")
            with pytest.raises(CallError, match="a prepare or unprepare holds it|another netdev move"):
                await start("sb2")  # a TimeoutError: the runtime gave up first
            if looking is not None:
                with pytest.raises(Exception, match="timed out"):
                    await looking
        await start("sb1")  # the lock free: the running sandbox keeps it
    run(_as_runtime(tmp_path, m, request_timeout, body))
    assert where(nets) == (False, True)


def test_a_runtime_with_a_longer_request_timeout_lets_the_move_wait_longer(tmp_path, nets):
    """``plugin_request_timeout = "20s"``: a prepare holding the lock past the 1.5 s used when the
    runtime says nothing does not fail the sandbox."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    m = mover(tmp_path, nets)
    m.test_netns = nets.pod
    held, release = threading.Event(), threading.Event()

    def prepare():
        with Flock(str(tmp_path / "serialize.lock"), 1.0):
            held.set()
            release.wait(LOCK_TIMEOUT + 0.5)

    async def body(start):
        thread = threading.Thread(target=prepare)
        thread.start()
        try:
            assert await asyncio.to_thread(held.wait, 30)
            await start("sb1")
        finally:
            release.set()
            await asyncio.to_thread(thread.join)
    run(_as_runtime(tmp_path, m, 20.0, body))
    assert where(nets) == (False, True) and records(tmp_path)[0]["sandbox"] == "sb1"


def test_a_synchronize_while_a_prepare_holds_the_lock_is_answered_and_finished_by_the_next_look(tmp_path, nets, caplog):
    """containerd restarted during a long prepare: its Synchronize cannot have the lock. Refused, it
    made containerd close the plugin at every attempt (pods started meanwhile never got their
    netdevs); answered, the sandbox gone meanwhile gives its netdev back at the next look."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    m = mover(tmp_path, nets, lock_timeout=0.2)
    run(m.pod_started(pod(nets)))
    with Flock(str(tmp_path / "serialize.lock"), 1.0):  # a prepare
        run(m.synchronized([]))  # sb1 is gone
        assert where(nets) == (False, True) and "finished later" in caplog.text
        with pytest.raises(UpdateError, match="a prepare or unprepare holds it"):  # the look every 10 s: logged
            run(m.reconcile())
    run(m.reconcile())
    assert where(nets) == (True, False) and records(tmp_path)[0].get("state", "planned") == "planned"
    run(m.reconcile())  # done once
