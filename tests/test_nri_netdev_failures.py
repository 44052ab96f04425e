"""The NRI netdev mover when things fail (agent/nri/netdev.py): a request the runtime gave up on,
a sandbox whose move failed, a look every 10 s that fails. On the real kernel, as
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

from agent.nri.netdev import NetdevError
from agent.prepare.metadata.update import Flock
from tests.controlplane import wait_until
from tests.test_nri_netdev import mover, nets, pod, records, run, where, write_checkpoint  # noqa: F401 - fixtures


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
