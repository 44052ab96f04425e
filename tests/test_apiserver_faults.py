"""Faults on the real server: what kube-apiserver does not do on demand (5xx bursts, slow
responses, dropped watches, connection resets) comes from tests/faultproxy.py in front of it;
the publisher must converge to the same slices the server would hold without them.
410 Gone is the server's own: a watch from a version etcd has compacted away."""

from __future__ import annotations

import asyncio

import pytest

from agent.publish.store import Gone
from agent.publish.kubestore import KubeStore
from tests.controlplane import ControlPlane, unique
from tests.faultproxy import FaultProxy
from tests.test_apiserver_publish import Node, Running, run


@pytest.fixture(scope="module")
def proxy(apiserver):
    p = FaultProxy(apiserver).start()
    yield p
    p.stop()


@pytest.fixture
def node(apiserver, proxy, tmp_path):
    n = Node(apiserver, tmp_path, token=True)  # through the proxy: a bearer token, not a client cert
    n.kubeconfig = proxy.write_kubeconfig(str(tmp_path / "proxied.kubeconfig"), token=n.token)
    return n


def test_5xx_burst_and_slow_server_converge(node, proxy):
    async def scenario():
        async with Running(node) as r:
            proxy.fail_next(6, 500)
            proxy.fail_next(2, 503, method="POST")
            r.pub.set_pool(node.pool(300))
            await r.settle(lambda: node.devices() == 300)
            proxy.delay(0.05)
            try:
                r.pub.set_pool(node.pool(310))
                await r.settle(lambda: node.devices() == 310)
            finally:
                proxy.delay(0)
            return r.pub.errors

    injected = proxy.injected
    assert run(scenario()) >= 1
    assert proxy.injected - injected == 8
    assert len(node.slices()) == 3


def test_injected_conflicts_converge(node, proxy):
    async def scenario():
        async with Running(node) as r:
            r.pub.set_pool(node.pool(200))
            await r.settle(lambda: node.devices() == 200)
            proxy.fail_next(3, 409, method="PUT")
            r.pub.set_pool(node.pool(201))
            await r.settle(lambda: node.devices() == 201)
            return r.pub.errors

    assert run(scenario()) >= 3


def test_connection_resets_converge(node, proxy):
    async def scenario():
        async with Running(node) as r:
            proxy.reset_next(4)
            r.pub.set_pool(node.pool(130))
            await r.settle(lambda: node.devices() == 130)

    run(scenario())
    assert {o["spec"]["pool"]["generation"] for o in node.slices()} == {1}


def test_dropped_watch_resumes_and_still_sees_the_kubelet_wipe(node, proxy):
    async def scenario():
        async with Running(node, debounce=0.05) as r:
            r.pub.set_pool(node.pool(5))
            await r.settle(lambda: node.devices() == 5)
            await r.settle(lambda: proxy.open_watches() >= 1)
            assert proxy.drop_watches() >= 1
            await r.settle(lambda: proxy.open_watches() >= 1)  # the drift watch came back by itself
            await asyncio.to_thread(node.wipe_as_kubelet)
            await r.settle(lambda: node.devices() == 5)

    run(scenario())
    assert {o["spec"]["pool"]["generation"] for o in node.slices()} == {2}


def watch_requests(proxy: FaultProxy) -> list[str]:
    return [target for _, target in list(proxy.requests) if "watch=true" in target]


GARBLED_EVENTS = {"truncated": b'{"type":"MODIFIED","object":{"kind":"ResourceSl',
                  "wrong types": b'{"type":"MODIFIED","object":{"metadata":"x","spec":[]}}',
                  "no metadata": b'{"type":"MODIFIED","object":{"spec":{"driver":"x","pool":{"name":"p","generation":1,'
                                 b'"resourceSliceCount":1}}}}'}


@pytest.mark.parametrize("event", GARBLED_EVENTS.values(), ids=GARBLED_EVENTS.keys())
def test_a_garbled_watch_event_resumes_the_watch(node, proxy, event):
    """An event no kube-apiserver writes (a proxy's truncation, wrong types) is a failed watch,
    resumed as a dropped one; one without metadata moves no version on: the kubelet's later wipe
    is still seen (the watch task ended on the decoder's ValueError, or on the missing metadata,
    and only a resync, if any, repaired the wipe)."""
    async def scenario():
        async with Running(node, debounce=0.05) as r:
            r.pub.set_pool(node.pool(5))
            await r.settle(lambda: node.devices() == 5)
            await r.settle(lambda: proxy.open_watches() >= 1)
            watches = len(watch_requests(proxy))
            proxy.answer_next(1, event + b"\n", watch=True)
            assert proxy.drop_watches() >= 1  # the watch resumed gets the garbled event, then resumes again
            await r.settle(lambda: len(watch_requests(proxy)) >= watches + 2)
            await asyncio.to_thread(node.wipe_as_kubelet)
            await r.settle(lambda: node.devices() == 5)

    injected = proxy.injected
    run(scenario())
    assert proxy.injected == injected + 1


@pytest.fixture(scope="module")
def uncached(tmp_path_factory):
    """A second control plane whose ResourceSlice watches go to etcd (no watch cache), so a
    compacted version gives the server's own 410 Gone at once."""
    plane = ControlPlane(dir=str(tmp_path_factory.mktemp("uncached")), extra_args=["--watch-cache=false"]).start()
    yield plane
    plane.stop()


def test_watch_from_a_compacted_version_is_gone(uncached, tmp_path):
    node = Node(uncached, tmp_path)

    async def scenario():
        async with Running(node) as r:
            r.pub.set_pool(node.pool(3))
            await r.settle(lambda: node.devices() == 3)
            old = node.slices()[0]["metadata"]["resourceVersion"]
            r.pub.set_pool(node.pool(4))
            await r.settle(lambda: node.devices() == 4)
            for i in range(2):  # move etcd past the update's revision, so that one is compacted too
                await asyncio.to_thread(uncached.create_namespace, unique("bump"))
            revision = await asyncio.to_thread(uncached.compact_etcd)
            assert revision > int(old) + 1
            store: KubeStore = r.store.store
            with pytest.raises(Gone):
                async for _ in store.watch(old):
                    pass
            # the publisher's own watch re-lists and goes on: a wipe is still repaired
            await asyncio.to_thread(node.wipe_as_kubelet)
            await r.settle(lambda: node.devices() == 4)

    run(scenario())


def test_publishers_watch_resuming_from_a_compacted_version_gets_gone_and_relists(uncached, tmp_path):
    """The drift watch itself is dropped (fault proxy) and resumes from a version etcd has
    compacted away: the server's 410 Gone, a fresh list, and a later kubelet wipe still repaired."""
    proxy = FaultProxy(uncached).start()
    node = Node(uncached, tmp_path, token=True)
    node.kubeconfig = proxy.write_kubeconfig(str(tmp_path / "proxied.kubeconfig"), token=node.token)
    gone: list[str] = []

    async def scenario():
        async with Running(node) as r:
            r.pub.set_pool(node.pool(5))
            await r.settle(lambda: node.devices() == 5)
            await r.settle(lambda: proxy.open_watches() >= 1)
            inner = r.store.store.watch

            async def watch(version):  # the watch as watch_api calls it, noting the 410s
                try:
                    async for event in inner(version):
                        yield event
                except Gone:
                    gone.append(version)
                    raise

            r.store.watch = watch  # watch_api looks it up again on every resume
            old = node.slices()[0]["metadata"]["resourceVersion"]
            for _ in range(2):  # other objects move etcd on; the slice watch sees none of it
                await asyncio.to_thread(uncached.create_namespace, unique("bump"))
            assert await asyncio.to_thread(uncached.compact_etcd) > int(old) + 1
            assert proxy.drop_watches() >= 1
            await r.settle(lambda: bool(gone) and proxy.open_watches() >= 1)
            await asyncio.to_thread(node.wipe_as_kubelet)
            await r.settle(lambda: node.devices() == 5)

    try:
        run(scenario())
    finally:
        proxy.stop()
    assert gone and {o["spec"]["pool"]["generation"] for o in node.slices()} == {2}
