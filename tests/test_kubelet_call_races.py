"""Kubelet calls that outlive the kubelet's patience, over the real gRPC path.

A kubelet timeout cancels only the awaiting coroutine; the call's worker thread goes on. A
prepare the kubelet gave up on must prepare nothing (its unprepare may already have run: the
serialize lock is not FIFO, and an unprepare of an unknown claim succeeds without a trace), and
neither may a prepare whose claim was unprepared after it began. A call's claim reads from a
slow API server answer per-claim errors within the kubelet's 45 s, never a DeadlineExceeded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading

import grpc
import psutil
import pytest

from agent.kubeletplugin import KubeletPlugin
from agent.kubeletplugin.claims import DirClaimSource, KubeClaimSource
from agent.kubeletplugin.service import GAVE_UP as GAVE_UP_ERROR
from agent.kubeletplugin.service import SerializeLock
from agent.kubeletplugin.sockets import registration_socket_path
from agent.prepare.checkpoint import Checkpoint
from agent.prepare.driver import Driver
from tests.controlplane import unique, wait_until
from tests.kubelet_standin import (
    DRIVER, Env, KubeletStandIn, _waiting_for_flock, claim, gpu, inventory, settings_for, store_claim,
)

GAVE_UP = 0.5  # the short deadline of a kubelet that gives up: every call it is used for is held past it


class HeldReads(DirClaimSource):
    """The ``dir:`` store, where reading claim ``held`` waits for ``release`` (a slow GET)."""

    def __init__(self, path: str, held: str):
        super().__init__(path)
        self.held, self.reading, self.release = held, threading.Event(), threading.Event()

    def read_claim(self, namespace: str, name: str) -> dict:
        if name == self.held:
            self.reading.set()
            assert self.release.wait(60)
        return super().read_claim(namespace, name)


def _count_lock_runs(plugin) -> list[int]:
    """How many runs under the serialize lock have ended (the handshake for an abandoned call's
    thread, whose answer nobody receives)."""
    ended, run = [0], plugin._lock.run

    def counted(fn, arg):
        try:
            return run(fn, arg)
        finally:
            ended[0] += 1
    plugin._lock.run = counted
    return ended


def _spec(settings, uid: str) -> str:
    return os.path.join(settings.cdi_dir, f"k8s.{DRIVER}-claim_{uid}.json")


async def _gave_up(kubelet, call, c, caplog) -> None:
    """``call(c)`` with a deadline the kubelet gives up at; returns once the plugin saw it."""
    kubelet.timeout = GAVE_UP
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(c)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        kubelet.timeout = 45
    uid = c["metadata"]["uid"]
    await asyncio.to_thread(wait_until, lambda: f"the kubelet gave up on the prepare of claims {uid}" in caplog.text,
                            30, what="the plugin to see the cancel")


def test_a_prepare_the_kubelet_gave_up_on_prepares_nothing(tmp_path, caplog):
    """Its thread waited for the lock (another instance held it) past the kubelet's deadline."""
    caplog.set_level(logging.WARNING, logger="agent.kubeletplugin.service")
    e = Env(tmp_path)
    calls = []  # what the agent's metrics count (agent.service.observers.call_observer)
    e.plugin.observe = lambda what, results, seconds: calls.append((what, {u: r.error for u, r in results.items()}))
    held, release = threading.Event(), threading.Event()
    lock_path = os.path.join(e.settings.plugin_dir, "serialize.lock")

    async def main():
        async with e:
            ended = _count_lock_runs(e.plugin)
            c = store_claim(e.settings, claim("c", [("r", "gpu-0000-1b-00-0")]))
            other = threading.Thread(target=SerializeLock(lock_path).run, args=(lambda _: (held.set(), release.wait(60)), None))
            other.start()
            try:
                assert held.wait(30)
                await _gave_up(e.kubelet, e.kubelet.prepare, c, caplog)
                await asyncio.to_thread(wait_until, lambda: _waiting_for_flock(lock_path), 30, what="the prepare to wait for the lock")
            finally:
                release.set()
                other.join()
            await asyncio.to_thread(wait_until, lambda: ended[0] == 1, 30, what="the abandoned prepare's thread")
            uid = c["metadata"]["uid"]
            assert uid not in e.driver.checkpoint.claims and not os.path.exists(_spec(e.settings, uid))
            assert calls == [("prepare", {uid: GAVE_UP_ERROR})]  # an error, as the kubelet saw it
            # nothing stays behind: the kubelet's retry prepares it
            assert (await e.kubelet.prepare(c)).claims[uid].error == ""
            assert os.path.exists(_spec(e.settings, uid)) and calls[1:] == [("prepare", {uid: None})]
    asyncio.run(main())


@pytest.mark.parametrize("abandoned", [True, False], ids=["kubelet-gave-up", "cancel-not-seen-yet"])
def test_a_prepare_overtaken_by_its_claims_unprepare_prepares_nothing(tmp_path, caplog, abandoned):
    """Its claim's read was slow; the kubelet unprepared the claim meanwhile. Not abandoned: the
    kubelet's cancel had not reached the plugin yet (it is asynchronous), which the unprepare
    marks cover."""
    caplog.set_level(logging.WARNING, logger="agent.kubeletplugin.service")
    settings = settings_for(str(tmp_path))
    source = HeldReads(settings.cluster_dir, "c")
    driver = Driver(settings, lambda: inventory(gpu(0)))

    async def main():
        plugin = KubeletPlugin(settings, driver, source)
        await plugin.start()
        try:
            kubelet = KubeletStandIn(settings.registry_dir)
            await kubelet.register()
            ended = _count_lock_runs(plugin)
            c = store_claim(settings, claim("c", [("r", "gpu-0000-1b-00-0")]))
            uid = c["metadata"]["uid"]
            if abandoned:
                await _gave_up(kubelet, kubelet.prepare, c, caplog)
            else:
                preparing = asyncio.ensure_future(kubelet.prepare(c))
            assert await asyncio.to_thread(source.reading.wait, 30)
            assert (await kubelet.unprepare(c)).claims[uid].error == ""  # unknown yet: succeeds
            source.release.set()
            if abandoned:
                await asyncio.to_thread(wait_until, lambda: ended[0] == 2, 30, what="the abandoned prepare's thread")
            else:
                assert "unprepared after this prepare began" in (await preparing).claims[uid].error
            assert uid not in driver.checkpoint.claims and not os.path.exists(_spec(settings, uid))
            # the kubelet preparing it again (a new pod) is not stale
            assert (await kubelet.prepare(c)).claims[uid].error == ""
        finally:
            source.release.set()
            await plugin.stop()
    asyncio.run(main())


def test_claim_reads_from_a_slow_api_server_answer_within_the_kubelets_deadline(apiserver, tmp_path):
    """The real kube-apiserver, slow because its storage is: etcd stopped (SIGSTOP), a GET waits
    (a GET without resourceVersion is read from etcd, not the watch cache). Each read would
    end at the request timeout (10 s); six of them one after another outlast the kubelet's 45 s."""
    from lightkube import AsyncClient
    from lightkube.config.kubeconfig import KubeConfig

    namespace = "slow-reads"
    try:
        apiserver.create_namespace(namespace)
    except Exception:  # noqa: BLE001 - exists from another test of the session
        pass
    claims = [apiserver.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                "metadata": {"name": unique("c"), "namespace": namespace},
                                "spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": "gpu.sysdra.io"}}]}}})
              for _ in range(6)]
    settings = settings_for(str(tmp_path))
    source = KubeClaimSource(AsyncClient(config=KubeConfig.from_file(apiserver.kubeconfig)))
    plugin = KubeletPlugin(settings, Driver(settings, lambda: inventory(gpu(0))), source)
    (etcd,) = [p for p in apiserver._procs if p.name == "etcd"]
    etcd = [psutil.Process(etcd.pid), *psutil.Process(etcd.pid).children(recursive=True)]  # the peer wrapper's too

    async def main():
        await plugin.start()
        try:
            kubelet = KubeletStandIn(settings.registry_dir)
            await kubelet.register()
            plugin._core.read_budget = 2.0  # the test's, well below the request timeout
            for p in etcd:
                p.send_signal(signal.SIGSTOP)
            try:
                resp = await kubelet.prepare(*claims)  # the kubelet's 45 s deadline
            finally:
                for p in etcd:
                    p.send_signal(signal.SIGCONT)
            for c in claims:
                m = c["metadata"]
                assert resp.claims[m["uid"]].error == (f"ResourceClaim {namespace}/{m['name']} not read within 2 s: "
                                                       "the API server is slow")
        finally:
            await plugin.stop()
            source.api.close()
    asyncio.run(main())
    wait_until(lambda: apiserver.http().get("/readyz", timeout=5).status_code == 200, 60, what="the API server after etcd")


def test_stop_keeps_the_serialize_lock_while_a_prepare_still_runs(tmp_path):
    """SIGTERM while a prepare is in the driver (a GPU mode switch takes seconds): the DRA server's
    grace ends before it, but its thread goes on. The serialize lock must stay held until that
    thread is done: the new instance of a rolling update (whose recovery runs under the lock)
    would otherwise roll back the prepare as an interrupted one while it still runs."""
    e = Env(tmp_path)
    entered, release = threading.Event(), threading.Event()
    prepare = e.driver.prepare_claims

    def slow_prepare(claims):
        entered.set()
        assert release.wait(60)
        return prepare(claims)
    e.driver.prepare_claims = slow_prepare
    lock_path = os.path.join(e.settings.plugin_dir, "serialize.lock")

    def other_instance_gets_lock() -> bool:
        import fcntl
        fd = os.open(lock_path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)

    async def main():
        await e.__aenter__()
        ended = _count_lock_runs(e.plugin)
        stopping = preparing = None
        try:
            c = store_claim(e.settings, claim("c", [("r", "gpu-0000-1b-00-0")]))
            preparing = asyncio.ensure_future(e.kubelet.prepare(c))
            assert await asyncio.to_thread(entered.wait, 30)
            stopping = asyncio.ensure_future(e.plugin.stop(grace=0.2))
            await asyncio.sleep(1.0)  # past the server's grace: the prepare's thread still runs
            assert ended[0] == 0
            assert not await asyncio.to_thread(other_instance_gets_lock), \
                "the serialize lock was given up while a prepare ran under it"
        finally:
            release.set()
            if stopping is not None:
                await stopping
            else:
                await e.plugin.stop()
            if preparing is not None:
                with contextlib.suppress(Exception):
                    await preparing
        await asyncio.to_thread(wait_until, lambda: ended[0] == 1, 30, what="the prepare's thread")
    asyncio.run(main())


class _OrderedStatus:
    """A status writer that records what it is asked, in order; a prepare's ``submit`` is slow
    to arrive (its thread was preempted after the lock), waiting up to 3 s for a ``release``."""

    recorded = None

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self.released = threading.Event()

    def submit(self, ref, entries, seen=None) -> None:
        self.released.wait(3)
        self.calls.append(("submit", ref.uid))

    def release(self, ref) -> None:
        self.calls.append(("release", ref.uid))
        self.released.set()

    async def idle(self, timeout=None) -> None:
        return None

    def close(self) -> None:
        return None


def test_a_claims_status_is_not_written_after_its_unprepare_released_it(tmp_path):
    """The kubelet unprepared the claim while its prepare was in the driver (it had given up on
    it, or the pod went): the unprepare waited for the lock. Whatever order the two threads run
    in after the lock, the claim's last status wish is the unprepare's: a prepare's Ready entries
    written after it would describe devices the node gave back."""
    from agent.kubeletplugin.types import PreparedDevice, PrepareResult

    settings = settings_for(str(tmp_path))
    entered, go = threading.Event(), threading.Event()

    class Driver_:
        def prepare_claims(self, claims):
            entered.set()
            assert go.wait(30)
            return {c["metadata"]["uid"]: PrepareResult(
                [PreparedDevice(["r"], "node-1", "gpu-0000-1b-00-0", ["k8s.sysdra.io/claim=x"])],
                status=[{"driver": DRIVER, "pool": "node-1", "device": "gpu-0000-1b-00-0"}]) for c in claims}

        def unprepare_claims(self, refs):
            return {r.uid: None for r in refs}

    status = _OrderedStatus()
    plugin = KubeletPlugin(settings, Driver_(), DirClaimSource(settings.cluster_dir), status)

    async def main():
        await plugin.start()
        try:
            kubelet = KubeletStandIn(settings.registry_dir)
            await kubelet.register()
            c = store_claim(settings, claim("c", [("r", "gpu-0000-1b-00-0")]))
            uid = c["metadata"]["uid"]
            preparing = asyncio.ensure_future(kubelet.prepare(c))
            assert await asyncio.to_thread(entered.wait, 30)
            unpreparing = asyncio.ensure_future(kubelet.unprepare(c))
            await asyncio.to_thread(wait_until, lambda: _waiting_for_flock(os.path.join(settings.plugin_dir, "serialize.lock"))
                                    or plugin._lock._mutex.locked(), 30, what="the unprepare to wait for the lock")
            await asyncio.sleep(0.2)
            go.set()
            assert (await preparing).claims[uid].error == ""
            assert (await unpreparing).claims[uid].error == ""
            assert status.calls[-1] == ("release", uid), status.calls
        finally:
            go.set()
            await plugin.stop()
    asyncio.run(main())


def test_a_prepare_in_the_old_instance_overtaken_by_the_unprepare_in_the_new_one_prepares_nothing(tmp_path, caplog):
    """A rolling update: the old instance's prepare of a claim began (its read slow); the kubelet,
    its cancel not seen there yet, sends the claim's unprepare to the new instance, which succeeds
    (nothing of it yet). The old one must not prepare it after that: no unprepare would come, the
    claim would stay prepared with its devices held."""
    caplog.set_level(logging.WARNING, logger="agent.kubeletplugin.service")
    old, new = settings_for(str(tmp_path), rolling_update_uid="old"), settings_for(str(tmp_path), rolling_update_uid="new")
    source = HeldReads(old.cluster_dir, "c")
    plugins = [KubeletPlugin(old, Driver(old, lambda: inventory(gpu(0))), source),
               KubeletPlugin(new, Driver(new, lambda: inventory(gpu(0))), DirClaimSource(new.cluster_dir))]

    async def main():
        for p in plugins:
            await p.start()
        try:
            kubelets = [KubeletStandIn(old.registry_dir), KubeletStandIn(new.registry_dir)]
            for k, s in zip(kubelets, (old, new)):
                await k.register(registration_socket_path(s))
            c = store_claim(old, claim("c", [("r", "gpu-0000-1b-00-0")]))
            uid = c["metadata"]["uid"]
            preparing = asyncio.ensure_future(kubelets[0].prepare(c))
            assert await asyncio.to_thread(source.reading.wait, 30)
            assert (await kubelets[1].unprepare(c)).claims[uid].error == ""  # unknown yet: succeeds
            source.release.set()
            assert "unprepared after this prepare began" in (await preparing).claims[uid].error
            assert not os.path.exists(_spec(old, uid))
            assert uid not in Checkpoint.load(os.path.join(old.plugin_dir, "checkpoint.json"), move_corrupt=False).claims
            assert (await kubelets[1].prepare(c)).claims[uid].error == ""  # a new pod's prepare is not stale
        finally:
            source.release.set()
            for p in plugins:
                await p.stop()
    asyncio.run(main())


def test_unprepare_marks_from_a_damaged_file_or_another_boot_count_as_none(tmp_path, caplog):
    """The marks file is the other instance's writing: damaged, it is said once and replaced at the
    next unprepare; another boot's marks (a clock begun anew) and marks of no time are not used."""
    import json
    import time

    from agent.kubeletplugin.unprepared import FILE, SharedMarks

    path, began = tmp_path / FILE, time.monotonic()
    marks = SharedMarks(str(tmp_path), "boot-1")
    for damaged in (b"\xff{", b"[1]", b'{"marks": 1}'):
        path.write_bytes(damaged)
        assert marks.after(["a"], began - 1) == set() and marks.after(["a"], began - 1) == set()
    assert caplog.text.count("cannot be read") == 3
    path.write_text(json.dumps({"bootID": "boot-0", "marks": {"a": began}}))
    assert marks.after(["a"], began - 1) == set()
    path.write_text(json.dumps({"bootID": "boot-1", "marks": {"a": True, "b": "1", "c": 1e300, "d": began}}))
    assert marks.after(["a", "b", "c", "d"], began - 1) == {"d"}
    path.write_bytes(b"\xff{")
    marks.record(["e"])
    assert marks.after(["d", "e"], began - 1) == {"e"} and marks.after(["e"], time.monotonic()) == set()
