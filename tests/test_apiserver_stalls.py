"""A server (or a proxy or load balancer in between) that accepts a request and then stalls,
trickles, cuts or floods its answer, from tests/faultproxy.py in front of the real
kube-apiserver: every request of the slice store ends within its deadline and size limit, the
publisher retries with its backoff and converges once the server answers again, and a watch
that goes silent is made again (a kubelet's wipe meanwhile is still repaired). The stores'
bounds are made small here (1 s, 1 MiB); the agent's are kubehttp's."""

from __future__ import annotations

import asyncio

import pytest

from agent.publish.backoff import Backoff
from agent.publish.drift import watch_api
from agent.publish.kubestore import KubeStore
from agent.publish.store import StoreError
from tests.test_apiserver_faults import proxy  # noqa: F401 - the module's fault proxy (fixture)
from tests.test_apiserver_publish import Node, Running, run

MIB = 1024 * 1024
FLOOD = 64 * MIB  # a garbage answer far past every limit: only its first MiBs may be read


@pytest.fixture
def node(apiserver, proxy, tmp_path):
    n = Node(apiserver, tmp_path, token=True)
    n.kubeconfig = proxy.write_kubeconfig(str(tmp_path / "proxied.kubeconfig"), token=n.token)
    yield n
    proxy.trickle(0)
    proxy.release()


class Syncs:
    """The publisher as the watch sees it: the syncs it is asked for, counted."""
    syncs = 0

    def request_sync(self):
        self.syncs += 1


def bounded(r: Running) -> Running:
    """The store's bounds made small (before its tasks make their first request)."""
    store: KubeStore = r.store.store
    store.timeout, store.watch_idle, store.max_object, store.max_page = 1.0, 1.0, MIB, MIB
    return r


async def synced_since(r: Running, syncs: int) -> None:
    """A sync completed after the ``syncs``-th: what asked for one before (the watch's echo of
    our own writes, a failed watch) is done, so only the watch can see a later wipe."""
    await r.settle(lambda: r.pub.syncs > syncs)


async def failed_with(r: Running, words: str, errors: int) -> None:
    """The publisher counted an error (after ``errors``) that says ``words``."""
    await r.settle(lambda: r.pub.errors > errors and words in (r.pub.last_error or ""))


def test_an_answer_trickling_in_ends_at_the_deadline_and_publishing_goes_on(node, proxy):
    """Each byte in time for httpx's read timeout, the whole answer never: the list was waited
    for as long as the server trickled (every later pool waited behind it)."""
    async def scenario():
        async with Running(node) as r:
            bounded(r).pub.set_pool(node.pool(5))
            await r.settle(lambda: node.devices() == 5)
            proxy.trickle(0.02)
            r.pub.set_pool(node.pool(6))
            await failed_with(r, "no answer within 1 s", r.pub.errors)
            proxy.trickle(0)
            await r.settle(lambda: node.devices() == 6)

    run(scenario())


@pytest.mark.parametrize("stall", ["open watch", "mid-event"])
def test_a_stalled_watch_is_made_again_and_the_kubelets_wipe_repaired(node, proxy, stall):
    """A watch stream that stops (the connection kept open) was read for ever: the kubelet's
    wipe was never seen, its slices gone until the next resync (none here)."""
    async def scenario():
        async with Running(node) as r:
            bounded(r).pub.set_pool(node.pool(5))
            await r.settle(lambda: node.devices() == 5 and proxy.open_watches() >= 1)
            await synced_since(r, 1)  # (the watch's echo of our create)
            if stall == "open watch":
                assert proxy.stall_watches() >= 1
            else:  # the watch made again gets the head and part of an event, then nothing
                proxy.stall_next(1, after=20, watch=True)
                syncs = r.pub.syncs
                assert proxy.drop_watches() >= 1
                await r.settle(lambda: proxy.injected > injected)
                await synced_since(r, syncs)  # (the sync a failed watch asks for)
            await asyncio.to_thread(node.wipe_as_kubelet)
            await r.settle(lambda: node.devices() == 5)

    injected = proxy.injected
    run(scenario())


# (devices published first, devices then, where the flood goes) for each kind of request
FLOOD_CASES = {"list": (5, 6, dict(method="GET", path="/resourceslices?", watch=False)),
               "create": (0, 5, dict(method="POST")),
               "update": (5, 6, dict(method="PUT")),
               "delete": (200, 5, dict(method="DELETE")),  # (two slices, then one)
               "node": (0, 5, dict(method="GET", path="/nodes/"))}


@pytest.mark.parametrize("request_kind", FLOOD_CASES)
def test_a_huge_answer_is_read_only_to_its_limit(node, proxy, request_kind):
    """64 MiB of garbage for each kind of request: read to just past the limit, an error that
    says so, retried (a Node that cannot be read: slices without an owner); lightkube read the
    whole answer into memory, then failed to decode it ('internal' error, with a traceback)."""
    async def scenario():
        async with Running(node) as r:
            first, then, where = FLOOD_CASES[request_kind]
            bounded(r)
            if first:
                r.pub.set_pool(node.pool(first))
                await r.settle(lambda: node.devices() == first)
            proxy.flood_next(1, FLOOD, **where)
            r.pub.set_pool(node.pool(then))
            await r.settle(lambda: node.devices() == then and proxy.injected > injected)
            return r.pub.last_error

    injected = proxy.injected
    last_error = run(scenario())
    assert proxy.flooded < 16 * MIB
    if request_kind != "node":  # (the owner is left out, not retried)
        assert f"more than {MIB} bytes" in last_error


def test_a_huge_watch_event_is_read_only_to_its_limit(node, proxy):
    async def scenario():
        async with Running(node) as r:
            bounded(r).pub.set_pool(node.pool(5))
            await r.settle(lambda: node.devices() == 5 and proxy.open_watches() >= 1)
            await synced_since(r, 1)
            proxy.flood_next(1, FLOOD, watch=True)
            syncs = r.pub.syncs
            assert proxy.drop_watches() >= 1
            await r.settle(lambda: proxy.injected > injected)
            await synced_since(r, syncs)
            await asyncio.to_thread(node.wipe_as_kubelet)
            await r.settle(lambda: node.devices() == 5)

    injected = proxy.injected
    run(scenario())
    assert proxy.flooded < 16 * MIB


FAULTS = {"stalled after the head": lambda p, **where: p.stall_next(1, after=0, **where),
          "stalled mid-body": lambda p, **where: p.stall_next(1, after=100, **where),
          "cut mid-body": lambda p, **where: p.cut_next(1, after=100, **where),
          "truncated chunk": lambda p, **where: p.answer_next(1, b'{"kind":', truncated=True, path=where.get("path")),
          "reset": lambda p, **where: p.reset_next(1)}


@pytest.mark.parametrize("fault", FAULTS.values(), ids=FAULTS.keys())
@pytest.mark.parametrize("request_kind", ["list", "update"])
def test_an_answer_that_stops_short_is_a_failed_attempt_retried(node, proxy, fault, request_kind):
    async def scenario():
        async with Running(node) as r:
            bounded(r).pub.set_pool(node.pool(5))
            await r.settle(lambda: node.devices() == 5)
            errors = r.pub.errors
            where = {"list": dict(method="GET", path="/resourceslices?", watch=False), "update": dict(method="PUT")}
            fault(proxy, **where[request_kind])
            r.pub.set_pool(node.pool(6))
            await r.settle(lambda: node.devices() == 6 and r.pub.errors > errors)

    run(scenario())


def test_a_bookmark_moves_the_watch_on_without_a_sync():
    """The server's bookmark on a quiet pool (about every minute) is no change to our slices:
    the watch resumes from its version, and no sync (a list) follows it."""
    class Store:
        list_resource_version = "10"

        def __init__(self):
            self.versions: list[str | None] = []

        async def watch(self, version):
            self.versions.append(version)
            yield "BOOKMARK", {"metadata": {"resourceVersion": str(11 + len(self.versions))}}
            if len(self.versions) == 1:
                raise StoreError("dropped")
            await asyncio.Event().wait()

    async def scenario():
        store, pub = Store(), Syncs()
        task = asyncio.get_running_loop().create_task(watch_api(store, pub, Backoff(initial=0.01)))
        try:
            while len(store.versions) < 2:
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
        return store.versions, pub.syncs

    assert run(scenario()) == (["10", "12"], 1)  # (the one sync: the dropped watch's)


def test_a_pool_of_more_slices_than_a_page_is_listed_whole(node):
    """Lists are read kubehttp.PAGE_ITEMS slices a page (each page's size bounded): a pool of
    more slices is still seen whole (a page missed: its slices created again, duplicates)."""
    async def scenario():
        async with Running(node) as r:
            r.pub.set_pool(node.pool(1100))  # 9 slices of at most 128 devices
            await r.settle(lambda: node.devices() == 1100)
            await synced_since(r, 1)  # (the watch's echo of our creates)
            writes, syncs = dict(r.store.writes), r.pub.syncs
            r.pub.request_sync()
            await synced_since(r, syncs)
            return writes, dict(r.store.writes), len(node.slices())

    before, after, slices = run(scenario())
    assert before == after and slices == 9


def test_the_agent_starts_and_stops_while_every_slice_request_stalls(apiserver, proxy, tmp_path, monkeypatch):
    """The whole agent against a server whose ResourceSlice and Node answers never come: it
    starts (the first publish is waited for 1 s), runs, publishes once the server answers, and
    a stop during the stall ends it."""
    from agent.service.daemon import Agent
    from agent.settings import Settings
    from tests.inventory_factory import inventory

    node = Node(apiserver, tmp_path, token=True)
    monkeypatch.setenv("KUBECONFIG", proxy.write_kubeconfig(str(tmp_path / "proxied.kubeconfig"), token=node.token))
    settings = Settings(root=str(tmp_path), node_name=node.name, cluster="kube", debounce=0.05, resync_interval=0,
                        kubelet_dir=str(tmp_path / "kubelet"), cdi_dir=str(tmp_path / "cdi"))  # fmt: skip
    for path in ("/resourceslices", f"/nodes/{node.name}"):
        proxy.stall_next(10**6, after=10, path=path)

    async def started():
        """An agent (no kubelet plugin) running; the Event that stops it, its task."""
        agent, running, stop = Agent(settings, scan=lambda s: inventory(5)), asyncio.Event(), asyncio.Event()
        agent.start_kubelet_plugin, agent._running = no_plugin, lambda *a: running.set()
        task = asyncio.get_running_loop().create_task(agent.run(stop))
        await asyncio.wait_for(running.wait(), 30)
        return agent, stop, task

    async def no_plugin():
        return None

    async def scenario():
        agent, stop, task = await started()  # stopped during the stall
        assert agent.publisher.syncs == 0 and proxy.injected > injected
        stop.set()
        await asyncio.wait_for(task, 30)
        agent, stop, task = await started()  # the server answers again
        proxy.clear()
        proxy.release()
        try:
            await agent.publisher.wait_synced(lambda p: p.total.created == 1, timeout=30)
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)

    injected = proxy.injected
    run(scenario())
    assert node.devices() == 5


def test_an_unexpected_error_in_the_watch_resumes_it(caplog):
    """A bug in reading the watch (here an error no store raises on purpose) is logged with its
    traceback and the watch resumed, as the publisher does: it ended the watch task for good."""
    class Store:
        list_resource_version = "10"
        calls = 0

        async def watch(self, version):
            Store.calls += 1
            if Store.calls == 1:
                raise KeyError("metadata")
            yield "DELETED", {"metadata": {"resourceVersion": "11"}}
            await asyncio.Event().wait()

    async def scenario():
        pub = Syncs()
        task = asyncio.get_running_loop().create_task(watch_api(Store(), pub, Backoff(initial=0.01)))
        try:
            while pub.syncs < 2 and not task.done():
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
        return Store.calls, pub.syncs

    assert run(scenario()) == (2, 2)  # (the failure's sync and the event's)
    assert "unexpected error in the watch" in caplog.text


def test_doctor_ends_its_questions_to_a_trickling_server(node, proxy, monkeypatch):
    """sysdra doctor is run when something is wrong: a server (or proxy) trickling its answers
    held it for as long as they trickled (httpx's timeout is each read's)."""
    from agent.tools import doctor

    monkeypatch.setenv("KUBECONFIG", node.kubeconfig)
    monkeypatch.setattr(doctor, "API_DEADLINE", 1.0)
    proxy.trickle(0.5)  # each byte in time for a read timeout; an access review's answer takes minutes
    found = {f.check: f for f in doctor.check_api("kube", "node-a")}
    assert found["api"].level == "fail" and "TimeoutError: no whole answer within 1 s" in found["api"].message
    proxy.trickle(0)
    found = {f.check: f for f in doctor.check_api("kube", "node-a")}
    assert found["api"].level == "ok", found["api"]
