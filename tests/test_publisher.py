"""Reconciler and publisher against the offline directory (``--cluster dir:``). API mode runs
against the real kube-apiserver: tests/test_apiserver_publish.py and test_apiserver_faults.py."""

from __future__ import annotations

import asyncio
import json

import kubernetes_validate
import pytest

from agent.publish import Conflict, Reconciler
from agent.publish.dirstore import DirStore
from agent.publish.drift import watch_dir
from agent.publish.publisher import Publisher
from agent.publish.slices import build_pool
from agent.service.watch import start_file_observer
from discovery.models import Inventory
from tests.inventory_factory import inventory

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


def test_two_changed_slices_bump_the_generation(tmp_path):
    """One device changed in each of two slices: both rewritten at a new generation, so the
    scheduler never takes a pool half old, half new for a whole one."""
    from discovery.models import AttributeValue
    from tests.inventory_factory import device

    changed = Inventory(root="/", devices=tuple(device(i, attributes={"x": AttributeValue(int_=1)} if i in (0, 200) else None)
                                                for i in range(256)))  # fmt: skip

    async def scenario():
        rec = Reconciler(DirStore(str(tmp_path), node_name=NODE, driver_name=DRIVER), node_name=NODE, driver_name=DRIVER)
        await rec.sync(pool_of(256))  # 128 + 128
        return await rec.sync(pool_of(changed))

    two = run(scenario())
    assert (two.updated, two.created, two.generation) == (2, 0, 2)
    assert [o["spec"]["pool"]["generation"] for o in dir_slices(tmp_path)] == [2, 2]


def test_a_second_slice_at_one_index_is_deleted(tmp_path):
    """Two stored slices named for the same index (a create whose answer was lost, then retried):
    one stays, the other is deleted, so no device is offered twice."""
    from agent.publish.slices import render

    async def scenario():
        store = DirStore(str(tmp_path), node_name=NODE, driver_name=DRIVER)
        (obj,) = render(pool_of(3), driver_name=DRIVER, node_name=NODE, generation=1, full_name=True)
        for suffix in ("bbbbb", "ccccc"):  # two names of index 0 (the server's random suffixes)
            obj["metadata"]["name"] = obj["metadata"]["name"][:-5] + suffix
            await store.create(json.loads(json.dumps(obj)))
        rec = Reconciler(store, node_name=NODE, driver_name=DRIVER)
        return await rec.sync(pool_of(3))

    stats = run(scenario())
    assert stats.deleted == 1 and len(dir_slices(tmp_path)) == 1


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
        observer = watch_dir(store.directory, pub, start_file_observer)
        try:
            pub.set_pool(pool_of(5))
            await pub.wait_synced(lambda p: p.total.created == 1)
            (path,) = list((tmp_path / "resourceslices").glob("*.json"))
            path.unlink()
            await pub.wait_synced(lambda p: p.total.created == 2, timeout=5)  # through the watch: no resync runs
            return path.exists()
        finally:
            observer.stop()
            task.cancel()

    assert run(scenario())


def test_resync_interval_zero_means_no_timer_resync(tmp_path):
    """``resync_interval: 0`` turns the periodic resync off: the publisher then syncs when told,
    not in a loop listing the store."""
    async def scenario():
        pub = Publisher(DirStore(str(tmp_path), node_name=NODE, driver_name=DRIVER), node_name=NODE, driver_name=DRIVER,
                        resync_interval=0, debounce=0)
        task = asyncio.get_running_loop().create_task(pub.run())
        try:
            pub.set_pool(pool_of(3))
            await pub.wait_synced()
            await asyncio.sleep(0.5)  # room for timer resyncs, were there any
            return pub.syncs
        finally:
            task.cancel()

    assert run(scenario()) == 1


def test_a_changed_counter_set_is_rewritten(tmp_path):
    """Fewer VFs: the PF's counter set shrinks with them; the slice holding it is rewritten, or
    the PF would consume more than its counter holds and never be allocated."""
    from tests.inventory_factory import sriov_inventory

    async def scenario():
        rec = Reconciler(DirStore(str(tmp_path), node_name=NODE, driver_name=DRIVER), node_name=NODE, driver_name=DRIVER)
        await rec.sync(pool_of(sriov_inventory(pfs=1, vfs=4), pf_vf_exclusive=True))
        await rec.sync(pool_of(sriov_inventory(pfs=1, vfs=2), pf_vf_exclusive=True))

    run(scenario())
    (counters,) = [o["spec"]["sharedCounters"] for o in dir_slices(tmp_path) if "sharedCounters" in o["spec"]]
    assert [c["counters"]["functions"]["value"] for c in counters] == ["2"]


def test_a_changed_skip_node_operations_is_rewritten(tmp_path):
    async def scenario():
        rec = Reconciler(DirStore(str(tmp_path), node_name=NODE, driver_name=DRIVER), node_name=NODE, driver_name=DRIVER)
        await rec.sync(pool_of(3, skip_node_operations={"gpu": ["*"]}))
        await rec.sync(pool_of(3, skip_node_operations={"gpu": ["NodeUnprepareResources"]}))

    run(scenario())
    assert [o["spec"].get("skipNodeOperations") for o in dir_slices(tmp_path)] == [["NodeUnprepareResources"]]


# --- found in review: long outages, foreign files in the directory ------------------------
def test_the_publisher_keeps_retrying_after_a_thousand_failures(tmp_path):
    """An API server refusing the agent for hours (outage, RBAC not yet granted, a slice it rejects)
    is retried at the capped delay for ever: the 1025th retry used to compute 2.0 ** 1024, whose
    OverflowError left ``run`` from inside its error handler and publishing stopped for good."""
    from agent.publish.backoff import Backoff
    from agent.publish.store import StoreError

    class Down:
        full_names = True

        async def list_slices(self):
            raise StoreError("API server unavailable")

    b = Backoff(initial=0.2, cap=30.0)
    b.attempt = 5000
    assert 24.0 <= b.next() <= 36.0  # the cap, with its jitter

    async def scenario():
        pub = Publisher(Down(), node_name=NODE, driver_name=DRIVER, resync_interval=0, debounce=0,
                        backoff=Backoff(initial=1e-6, cap=1e-6, jitter=0))
        task = asyncio.get_running_loop().create_task(pub.run())
        pub.set_pool(pool_of(1))
        while pub.errors < 1100 and not task.done():
            await asyncio.sleep(0.01)
        died = task.done() and not task.cancelled() and task.exception()
        task.cancel()
        return pub.errors, died

    errors, died = run(scenario())
    assert not died, f"the publisher stopped after {errors} failures: {died!r}"
    assert errors >= 1100


def test_foreign_json_in_the_directory_is_left_alone(tmp_path):
    """Files of others in ``resourceslices/`` are left alone (docs/publishing.md), whatever JSON they
    hold: one whose top level is no object (or whose spec is none) made every listing raise, so the
    node's slices were never published, retried for ever."""
    d = tmp_path / "resourceslices"
    d.mkdir()
    foreign = {"list.json": '["not", "a", "slice"]', "text.json": '"hello"', "spec.json": '{"spec": "x"}',
               "nopool.json": json.dumps({"metadata": {"name": "nopool"}, "spec": {"driver": DRIVER, "nodeName": NODE, "pool": None}})}
    for name, text in foreign.items():
        (d / name).write_text(text)

    async def scenario():
        rec = Reconciler(DirStore(str(tmp_path), node_name=NODE, driver_name=DRIVER), node_name=NODE, driver_name=DRIVER)
        return await rec.sync(pool_of(3))

    assert run(scenario()).created == 1
    assert {name: (d / name).read_text() for name in foreign} == foreign


def test_a_copy_of_a_slice_file_under_another_name_is_repaired(tmp_path):
    """A file is addressed by its name: a slice file copied (or moved) to another name holds the
    name of the first. The reconciler deleted the first file for the copy's duplicate, then
    could never update the slice the copy claimed to be (NotFound, retried for ever)."""
    import shutil

    async def scenario():
        store = DirStore(str(tmp_path), node_name=NODE, driver_name=DRIVER)
        rec = Reconciler(store, node_name=NODE, driver_name=DRIVER)
        await rec.sync(pool_of(3))
        (path,) = (tmp_path / "resourceslices").glob("*.json")
        shutil.copy(path, path.with_name("copy-of-it.json"))
        await rec.sync(pool_of(3))
        return await rec.sync(pool_of(4))  # a change: the slice is updated

    stats = run(scenario())
    assert stats.updated + stats.created >= 1
    (obj,) = dir_slices(tmp_path)
    assert len(obj["spec"]["devices"]) == 4
    assert (tmp_path / "resourceslices" / (obj["metadata"]["name"] + ".json")).exists()


def test_the_api_lists_pages_are_decoded_off_the_event_loop():
    """A large node's slices are megabytes of JSON: each page the server sends is decoded (and made
    dicts) in a worker thread, every page read until the server says there is no more."""
    import threading
    import types

    from agent.publish.kubestore import KubeStore

    loop_thread, decoded = [], []

    class Obj:
        def __init__(self, n):
            self.n = n

        def to_dict(self):
            return {"metadata": {"name": f"s{self.n}"}}

    class Streamed:  # httpx's streamed response, as kubehttp reads it
        status_code, headers, request = 200, {}, None

        async def aiter_bytes(self):
            yield b"{}"

        async def aclose(self):
            pass

    class Generic:
        pages = [(True, None, [Obj(0), Obj(1)]), (False, "42", [Obj(2)])]

        def prepare_request(self, method, res, params):
            assert method == "list" and "spec.nodeName=node-a" in params["fieldSelector"]
            return types.SimpleNamespace(method="GET", url="/apis/resource.k8s.io/v1/resourceslices")

        def build_adapter_request(self, request):
            return request

        async def send(self, request, stream=False):
            loop_thread.append(threading.current_thread())
            return Streamed()

        def handle_response(self, method, response, request):
            decoded.append(threading.current_thread())
            return self.pages.pop(0)

    class Client:
        _client = Generic()

    store = KubeStore(Client(), node_name="node-a", driver_name="sysdra.io")
    items = asyncio.run(store.list_slices())
    assert [i["metadata"]["name"] for i in items] == ["s0", "s1", "s2"] and store.list_resource_version == "42"
    assert len(decoded) == 2 and not set(decoded) & set(loop_thread)
