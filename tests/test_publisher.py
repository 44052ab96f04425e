"""Reconciler and publisher against the offline directory and, over real HTTP, the
stand-in API server (tests/apiserver_standin.py; not a real kube-apiserver)."""

from __future__ import annotations

import asyncio
import json
import time

import kubernetes_validate
import pytest
from lightkube import AsyncClient, KubeConfig

from agent.publish import Conflict, Reconciler
from agent.publish.backoff import Backoff
from agent.publish.dirstore import DirStore
from agent.publish.drift import watch_api, watch_dir
from agent.publish.kubestore import KubeStore
from agent.publish.publisher import Publisher
from agent.publish.slices import build_pool
from agent.service.watch import start_file_observer
from discovery.models import Inventory
from tests.apiserver_standin import StandinAPIServer
from tests.inventory_factory import device, inventory

DRIVER, NODE = "sysdra.io", "node-a"


def pool_of(n: int | Inventory, **kw):
    inv = inventory(n) if isinstance(n, int) else n
    return build_pool(inv, node_name=NODE, driver_name=DRIVER, **kw)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


class Recording:
    """Store proxy that records the operations in order."""

    def __init__(self, store):
        self.store, self.ops = store, []
        self.full_names = store.full_names

    async def list_slices(self):
        return await self.store.list_slices()

    async def create(self, obj):
        self.ops.append(("create", obj["metadata"].get("name") or obj["metadata"]["generateName"]))
        return await self.store.create(obj)

    async def update(self, obj):
        self.ops.append(("update", obj["metadata"]["name"], obj["metadata"]["resourceVersion"]))
        return await self.store.update(obj)

    async def delete(self, name, uid, rv):
        self.ops.append(("delete", name, uid, rv))
        return await self.store.delete(name, uid, rv)


def dir_slices(tmp_path) -> list[dict]:
    d = tmp_path / "resourceslices"
    return [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))]


# --- generation rules and order of operations (offline directory) --------------------------
def test_initial_publish_then_noop_resync_writes_nothing(tmp_path):
    async def scenario():
        rec = Reconciler(DirStore(str(tmp_path), node_name=NODE, driver_name=DRIVER), node_name=NODE, driver_name=DRIVER)
        first = await rec.sync(pool_of(300))
        again = await rec.sync(pool_of(300))
        return first, again

    first, again = run(scenario())
    assert (first.created, first.generation) == (3, 1)
    assert again.writes == 0 and again.generation == 1
    objs = dir_slices(tmp_path)
    assert [o["spec"]["pool"] for o in objs] == [{"name": NODE, "generation": 1, "resourceSliceCount": 3}] * 3
    for o in objs:
        kubernetes_validate.validate(o, "1.37", strict=True)
        assert o["metadata"]["uid"] and o["metadata"]["resourceVersion"] == "1"


def test_one_changed_slice_keeps_generation_more_bump(tmp_path):
    async def scenario():
        rec = Reconciler(DirStore(str(tmp_path), node_name=NODE, driver_name=DRIVER), node_name=NODE, driver_name=DRIVER)
        await rec.sync(pool_of(200))  # 128 + 72
        one = await rec.sync(pool_of(201))  # only the second slice changes
        new_slice = await rec.sync(pool_of(260))  # a third slice is needed
        removed = await rec.sync(pool_of(100))  # back to one slice
        return one, new_slice, removed

    one, new_slice, removed = run(scenario())
    assert (one.updated, one.created, one.generation) == (1, 0, 1)
    assert (new_slice.updated, new_slice.created, new_slice.generation) == (2, 1, 2)  # bump rewrites all kept slices
    assert removed.deleted == 2 and removed.generation == 2  # delete obsolete; the single kept slice changed
    objs = dir_slices(tmp_path)
    assert len(objs) == 1 and objs[0]["spec"]["pool"] == {"name": NODE, "generation": 2, "resourceSliceCount": 1}
    assert len(objs[0]["spec"]["devices"]) == 100


def test_obsolete_deleted_first_with_preconditions(tmp_path):
    async def scenario():
        store = DirStore(str(tmp_path), node_name=NODE, driver_name=DRIVER)
        # left behind by an older publisher: random name (pre-index naming) and an older generation
        junk = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "node-a-sysdra.io-x7k2p"},
                "spec": {"driver": DRIVER, "nodeName": NODE, "pool": {"name": NODE, "generation": 3, "resourceSliceCount": 1}, "devices": []}}
        junk = await store.create(junk)
        rec = Reconciler(Recording(store), node_name=NODE, driver_name=DRIVER)
        stats = await rec.sync(pool_of(130))
        return junk, rec.store.ops, stats

    junk, ops, stats = run(scenario())
    assert ops[0] == ("delete", junk["metadata"]["name"], junk["metadata"]["uid"], junk["metadata"]["resourceVersion"])
    assert [op[0] for op in ops] == ["delete", "create", "create"]
    assert stats.generation == 4  # never below what the store held


def test_generation_never_goes_backwards_across_restart_and_wipe(tmp_path):
    async def scenario():
        store = DirStore(str(tmp_path), node_name=NODE, driver_name=DRIVER)
        first = Reconciler(store, node_name=NODE, driver_name=DRIVER)
        for n in (10, 200, 300, 10):  # 1, 2, 3, then 3 again (one slice kept, two deleted)
            await first.sync(pool_of(n))
        restarted = Reconciler(store, node_name=NODE, driver_name=DRIVER)
        after_restart = await restarted.sync(pool_of(300))
        for p in (tmp_path / "resourceslices").glob("*.json"):
            p.unlink()  # like the kubelet's wipe
        after_wipe = await restarted.sync(pool_of(300))
        return after_restart, after_wipe

    after_restart, after_wipe = run(scenario())
    assert after_restart.generation == 4
    assert after_wipe.created == 3 and after_wipe.generation == 5


def test_stale_update_and_failed_precondition_conflict(tmp_path):
    async def scenario():
        store = DirStore(str(tmp_path), node_name=NODE, driver_name=DRIVER)
        await Reconciler(store, node_name=NODE, driver_name=DRIVER).sync(pool_of(1))
        obj = (await store.list_slices())[0]
        await store.update(obj)
        with pytest.raises(Conflict):
            await store.update(obj)  # stale resourceVersion
        with pytest.raises(Conflict):
            await store.delete(obj["metadata"]["name"], "other-uid", "")

    run(scenario())


def test_published_file_removed_by_someone_else_is_republished(tmp_path):
    async def scenario():
        store = DirStore(str(tmp_path), node_name=NODE, driver_name=DRIVER)
        pub = Publisher(store, node_name=NODE, driver_name=DRIVER, resync_interval=0, debounce=0.05)
        loop = asyncio.get_running_loop()
        task = loop.create_task(pub.run())
        observer = watch_dir(store.directory, pub, loop, start_file_observer)
        try:
            pub.set_pool(pool_of(5))
            await pub.wait_synced(lambda p: p.total.created == 1)
            (path,) = list((tmp_path / "resourceslices").glob("*.json"))
            t0 = time.monotonic()
            path.unlink()
            await pub.wait_synced(lambda p: p.total.created == 2, timeout=5)
            return time.monotonic() - t0, path.exists()
        finally:
            observer.stop()
            task.cancel()

    elapsed, exists = run(scenario())
    assert exists and elapsed < 1.0


# --- Kubernetes API via lightkube against the stand-in ------------------------------------
@pytest.fixture
def api(tmp_path):
    server = StandinAPIServer().start()
    server.add_node(NODE, uid="11111111-2222-3333-4444-555555555555")
    server.kubeconfig_path = server.kubeconfig(str(tmp_path / "kubeconfig"))
    yield server
    server.stop()


def kube_store(api) -> KubeStore:
    client = AsyncClient(config=KubeConfig.from_file(api.kubeconfig_path), field_manager=DRIVER)
    return KubeStore(client, node_name=NODE, driver_name=DRIVER)


class Running:
    """A publisher with its API watch, as the daemon runs them."""

    def __init__(self, api, debounce=0.05):
        self.api = api
        self.store = kube_store(api)
        self.pub = Publisher(self.store, node_name=NODE, driver_name=DRIVER, resync_interval=0, debounce=debounce,
                             backoff=Backoff(initial=0.02, cap=0.2))

    async def __aenter__(self):
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self.pub.run()),
                      loop.create_task(watch_api(self.store, self.pub, Backoff(initial=0.02, cap=0.2)))]
        return self

    async def __aexit__(self, *exc):
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.store.client.close()

    async def settle(self, predicate, timeout=10.0):
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"not converged: {self.api.writes}, {len(self.api.slices)} slices")
            await asyncio.sleep(0.02)


def test_api_initial_publish_owner_and_noop_resync(api):
    async def scenario():
        async with Running(api) as r:
            r.pub.set_pool(pool_of(300))
            await r.pub.wait_synced(lambda p: p.total.created == 3)
            writes = dict(api.writes)
            r.pub.request_sync()
            syncs = r.pub.syncs
            await r.pub.wait_synced(lambda p: p.syncs > syncs)
            return writes, dict(api.writes), r.pub.last_stats

    before, after, last = run(scenario())
    assert before == after and last.writes == 0
    objs = api.slice_list()
    assert len(objs) == 3
    for i, o in enumerate(objs):
        assert o["metadata"]["name"].startswith(f"{i:05x}-{DRIVER}-{NODE}-") and len(o["metadata"]["name"]) == len(f"00000-{DRIVER}-{NODE}-") + 5
        assert o["metadata"]["ownerReferences"][0]["uid"] == "11111111-2222-3333-4444-555555555555"
        assert o["spec"]["pool"]["generation"] == 1


def test_api_device_added_and_removed(api):
    async def scenario():
        async with Running(api) as r:
            r.pub.set_pool(pool_of(3))
            await r.pub.wait_synced(lambda p: p.total.created == 1)
            r.pub.set_pool(pool_of(4))
            await r.pub.wait_synced(lambda p: p.total.updated == 1)
            r.pub.set_pool(pool_of(2))
            await r.pub.wait_synced(lambda p: p.total.updated == 2)

    run(scenario())
    (obj,) = api.slice_list()
    assert [d["name"] for d in obj["spec"]["devices"]] == [d.name for d in inventory(2).devices]
    assert obj["spec"]["pool"]["generation"] == 1


def test_api_kubelet_wipe_republished_within_debounce(api):
    async def scenario():
        async with Running(api, debounce=0.1) as r:
            r.pub.set_pool(pool_of(300))
            await r.pub.wait_synced(lambda p: p.total.created == 3)
            await asyncio.sleep(0.2)  # the watch is established
            t0 = time.monotonic()
            assert api.wipe(NODE) == 3
            await r.settle(lambda: len(api.slices) == 3)
            return time.monotonic() - t0

    elapsed = run(scenario())
    assert elapsed < 0.1 + 0.5
    assert {o["spec"]["pool"]["generation"] for o in api.slice_list()} == {2}


def test_api_5xx_burst_and_slow_server_converge(api):
    async def scenario():
        async with Running(api) as r:
            api.fail_next(6, 500)
            api.fail_next(2, 503, verb="create")
            r.pub.set_pool(pool_of(300))
            await r.settle(lambda: len(api.slices) == 3)
            api.delay(0.05)
            r.pub.set_pool(pool_of(310))
            await r.settle(lambda: sum(len(o["spec"]["devices"]) for o in api.slice_list()) == 310)
            return r.pub.errors

    assert run(scenario()) >= 1


def test_api_conflicts_converge(api):
    async def scenario():
        async with Running(api) as r:
            r.pub.set_pool(pool_of(200))
            await r.settle(lambda: len(api.slices) == 2)
            # someone else touched a slice: our cached view is stale when we update
            store = r.store
            api.fail_next(3, 409, verb="update")
            r.pub.set_pool(pool_of(201))
            await r.settle(lambda: sum(len(o["spec"]["devices"]) for o in api.slice_list()) == 201)
            obj = (await store.list_slices())[0]
            await store.update(obj)
            with pytest.raises(Conflict):
                await store.update(obj)  # real stale resourceVersion
            with pytest.raises(Conflict):
                await store.delete(obj["metadata"]["name"], "wrong-uid", "")
            return r.pub.errors

    assert run(scenario()) >= 3


def test_api_dropped_watch_and_410_gone_still_repair(api):
    async def scenario():
        async with Running(api) as r:
            r.pub.set_pool(pool_of(5))
            await r.settle(lambda: len(api.slices) == 1)
            await asyncio.sleep(0.2)
            other = pool_of(1)
            with api.lock:  # another node's write moves the resourceVersion past what our watch saw
                api._create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "other"},
                             "spec": {"driver": DRIVER, "nodeName": "node-b", "pool": {"name": "node-b", "generation": 1, "resourceSliceCount": 1},
                                      "devices": other.slices[0]["devices"]}})
            api.compact()
            api.drop_watches()  # the watch resumes from a compacted version: 410 Gone, re-list
            await asyncio.sleep(0.3)
            api.wipe(NODE, DRIVER)
            await r.settle(lambda: len([o for o in api.slice_list() if o["spec"]["nodeName"] == NODE]) == 1, timeout=5)

    run(scenario())
    assert api.writes["create"] == 3
    assert api.gone_served >= 1


def test_agent_in_api_mode_publishes_scanned_inventory(api, monkeypatch, tmp_path):
    from agent.service.daemon import Agent
    from agent.settings import Settings

    monkeypatch.setenv("KUBECONFIG", api.kubeconfig_path)
    settings = Settings(root=str(tmp_path), node_name=NODE, cluster="kube", debounce=0.05, resync_interval=0,
                        kubelet_dir=str(tmp_path / "kubelet"), cdi_dir=str(tmp_path / "cdi"))

    async def scenario():
        agent = Agent(settings, scan=lambda s: inventory(130))
        agent.start_kubelet_plugin = _no_plugin
        stop = asyncio.Event()
        task = asyncio.get_running_loop().create_task(agent.run(stop))
        try:
            await agent.publisher.wait_synced(lambda p: p.total.created == 2)
        finally:
            stop.set()
            await task

    run(scenario())
    assert [len(o["spec"]["devices"]) for o in api.slice_list()] == [128, 2]


async def _no_plugin():
    return None


def test_api_without_node_publishes_without_owner(api, caplog):
    api.nodes.clear()

    async def scenario():
        async with Running(api) as r:
            r.pub.set_pool(pool_of(1))
            await r.settle(lambda: len(api.slices) == 1)
            r.pub.set_pool(pool_of(2))
            await r.settle(lambda: len(api.slice_list()[0]["spec"]["devices"]) == 2)

    run(scenario())
    assert "ownerReferences" not in api.slice_list()[0]["metadata"]
    assert sum("cannot read Node" in m for m in caplog.messages) == 1


def test_standin_rejects_what_the_apiserver_rejects(api):
    async def scenario():
        store = kube_store(api)
        try:
            too_many = pool_of(129).slices[0]
            too_many = {"devices": too_many["devices"] + [device(999).to_api()]}
            obj = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"generateName": "x-"},
                   "spec": {"driver": DRIVER, "nodeName": NODE, "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1}, **too_many}}
            from agent.publish import StoreError
            with pytest.raises(StoreError, match="422"):
                await store.create(obj)
        finally:
            await store.client.close()

    run(scenario())
