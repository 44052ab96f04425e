"""The agent's API mode (KubeStore over lightkube, Publisher, drift watch) against the real
kube-apiserver v1.37.2 + etcd (tests/controlplane.py): field-selected list/watch, updates and
deletes with preconditions, real 409s, the kubelet's wipe done as the kubelet does it, a second
writer's drift, and the whole Agent publishing with its ServiceAccount token. What the server
does not do on demand (5xx bursts, stalls, dropped watches) is in test_apiserver_faults.py."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
from lightkube import AsyncClient, KubeConfig

from agent.publish import Conflict, NotFound
from agent.publish.backoff import Backoff
from agent.publish.drift import watch_api
from agent.publish.kubestore import KubeStore
from agent.publish.publisher import Publisher
from agent.publish.sharing import share_plan
from agent.publish.slices import build_pool
from tests.conftest import REPO
from tests.controlplane import unique
from tests.inventory_factory import inventory

DRIVER = "sysdra.io"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


class Counting:
    """The store with a count of the writes it sent (the real server keeps no such count)."""

    def __init__(self, store: KubeStore):
        self.store, self.writes = store, {"create": 0, "update": 0, "delete": 0}
        self.full_names = store.full_names

    def __getattr__(self, name):
        return getattr(self.store, name)

    async def create(self, obj):
        self.writes["create"] += 1
        return await self.store.create(obj)

    async def update(self, obj):
        self.writes["update"] += 1
        return await self.store.update(obj)

    async def delete(self, name, uid, rv):
        self.writes["delete"] += 1
        return await self.store.delete(name, uid, rv)


class Node:
    """A Node of the real server, with the agent's kubeconfig for it."""

    def __init__(self, plane, tmp, *, create_node: bool = True, token: bool = False):
        self.plane = plane
        self.name = unique("pub")
        self.uid = plane.create_node(self.name)["metadata"]["uid"] if create_node else None
        if token:  # the agent's own identity (deploy/rbac.yaml), bound to this node
            plane.apply(f"{REPO}/deploy/namespace.yaml")
            plane.apply(f"{REPO}/deploy/rbac.yaml")
            self.token = plane.token("sysdra", "sysdra", node=self.name)
            self.kubeconfig = plane.write_kubeconfig(str(tmp / "agent.kubeconfig"), token=self.token)
        else:
            self.kubeconfig = plane.kubeconfig

    def pool(self, n: int, **kw):
        return build_pool(inventory(n), node_name=self.name, driver_name=DRIVER, **kw)

    def slices(self) -> list[dict]:
        items = self.plane.list("ResourceSlice", fields={"spec.nodeName": self.name, "spec.driver": DRIVER})
        return sorted(items, key=lambda o: o["metadata"]["name"])

    def devices(self) -> int:
        return sum(len(o["spec"].get("devices", [])) for o in self.slices())

    def wipe_as_kubelet(self) -> int:
        """What the kubelet does when a plugin (re)registers: deletecollection by field
        selector, as system:node:<name> (the Node authorizer allows it for its own node)."""
        kubelet = self.plane.http(cert=self.plane.node_identity(self.name))
        try:
            r = kubelet.request("DELETE", "/apis/resource.k8s.io/v1/resourceslices",
                                params={"fieldSelector": f"spec.nodeName={self.name},spec.driver={DRIVER}"})  # fmt: skip
            assert r.status_code == 200, r.text
            return len(r.json()["items"])
        finally:
            kubelet.close()


@pytest.fixture
def node(apiserver, tmp_path):
    return Node(apiserver, tmp_path)


class Running:
    """A publisher with its API watch, as the daemon runs them."""

    def __init__(self, node: Node, debounce=0.05):
        self.node = node
        client = AsyncClient(config=KubeConfig.from_file(node.kubeconfig), field_manager=DRIVER)
        self.store = Counting(KubeStore(client, node_name=node.name, driver_name=DRIVER))
        self.pub = Publisher(self.store, node_name=node.name, driver_name=DRIVER, resync_interval=0, debounce=debounce,
                             backoff=Backoff(initial=0.02, cap=0.2))  # fmt: skip

    async def __aenter__(self):
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self.pub.run()),
                      loop.create_task(watch_api(self.store, self.pub, Backoff(initial=0.02, cap=0.2)))]  # fmt: skip
        return self

    async def __aexit__(self, *exc):
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.store.client.close()

    async def settle(self, predicate, timeout=15.0):
        deadline = time.monotonic() + timeout
        while not await asyncio.to_thread(predicate):
            if time.monotonic() > deadline:
                raise AssertionError(f"not converged: {self.store.writes}, {len(self.node.slices())} slices")
            await asyncio.sleep(0.05)


def test_initial_publish_owner_and_noop_resync(node):
    async def scenario():
        async with Running(node) as r:
            r.pub.set_pool(node.pool(300))
            await r.pub.wait_synced(lambda p: p.total.created == 3)
            writes, versions = dict(r.store.writes), [o["metadata"]["resourceVersion"] for o in node.slices()]
            r.pub.request_sync()
            syncs = r.pub.syncs
            await r.pub.wait_synced(lambda p: p.syncs > syncs)
            return writes, dict(r.store.writes), versions, r.pub.last_stats

    before, after, versions, last = run(scenario())
    assert before == after == {"create": 3, "update": 0, "delete": 0} and last.writes == 0
    objs = node.slices()
    assert [o["metadata"]["resourceVersion"] for o in objs] == versions  # nothing rewritten
    assert [len(o["spec"]["devices"]) for o in objs] == [128, 128, 44]
    for i, o in enumerate(objs):
        prefix = f"{i:05x}-{DRIVER}-{node.name}-"
        assert o["metadata"]["name"].startswith(prefix) and len(o["metadata"]["name"]) == len(prefix) + 5  # server's generateName
        assert o["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Node", "name": node.name, "uid": node.uid, "controller": True}]
        assert o["spec"]["pool"] == {"name": node.name, "generation": 1, "resourceSliceCount": 3}


def test_policy_quantities_the_server_respells_do_not_rewrite_the_pool(node):
    """Share policies as the operator wrote them (2000, 1000, 0.5) come back as the server
    spells them (2k, 1k, 500m): compared by value, a resync writes nothing (else every sync
    would write, and each write's watch event ask for the next)."""
    plan = share_plan(("gpu",), {"gpu": {"memory": None, "compute": {
        "value": 2000, "default": 1000, "validRange": {"min": "0.5", "step": "0.5"}}}})

    async def scenario():
        async with Running(node) as r:
            r.pub.set_pool(node.pool(2, share=plan))
            await r.pub.wait_synced(lambda p: p.total.created == 1)
            syncs = r.pub.syncs
            r.pub.request_sync()
            await r.pub.wait_synced(lambda p: p.syncs > syncs)
            return dict(r.store.writes), r.pub.last_stats

    writes, last = run(scenario())
    assert writes == {"create": 1, "update": 0, "delete": 0} and last.writes == 0
    compute = node.slices()[0]["spec"]["devices"][0]["capacity"]["compute"]
    assert compute == {"value": "2k", "requestPolicy": {"default": "1k", "validRange": {"min": "500m", "step": "500m"}}}


def test_device_added_and_removed_updates_in_place(node):
    async def scenario():
        async with Running(node) as r:
            r.pub.set_pool(node.pool(3))
            await r.pub.wait_synced(lambda p: p.total.created == 1)
            uid = node.slices()[0]["metadata"]["uid"]
            r.pub.set_pool(node.pool(4))
            await r.pub.wait_synced(lambda p: p.total.updated == 1)
            r.pub.set_pool(node.pool(2))
            await r.pub.wait_synced(lambda p: p.total.updated == 2)
            return uid

    uid = run(scenario())
    (obj,) = node.slices()
    assert obj["metadata"]["uid"] == uid  # the same object, updated
    assert [d["name"] for d in obj["spec"]["devices"]] == [d.name for d in inventory(2).devices]
    assert obj["spec"]["pool"]["generation"] == 1


def test_shrinking_pool_deletes_obsolete_slices_first(node):
    async def scenario():
        async with Running(node) as r:
            r.pub.set_pool(node.pool(300))
            await r.settle(lambda: len(node.slices()) == 3)
            r.pub.set_pool(node.pool(100))
            await r.settle(lambda: node.devices() == 100 and len(node.slices()) == 1)
            return dict(r.store.writes)

    writes = run(scenario())
    assert writes["delete"] >= 2
    (obj,) = node.slices()
    # obsolete slices go, the kept one is rewritten: no generation bump (as offline, test_publisher.py)
    assert obj["spec"]["pool"] == {"name": node.name, "generation": 1, "resourceSliceCount": 1}


def test_kubelet_wipe_through_the_api_is_republished_with_a_higher_generation(node):
    async def scenario():
        async with Running(node, debounce=0.1) as r:
            r.pub.set_pool(node.pool(300))
            await r.pub.wait_synced(lambda p: p.total.created == 3)
            await asyncio.sleep(0.3)  # the watch is established
            assert await asyncio.to_thread(node.wipe_as_kubelet) == 3
            await r.settle(lambda: len(node.slices()) == 3)  # through the watch: no resync runs (interval 0)

    run(scenario())
    assert {o["spec"]["pool"]["generation"] for o in node.slices()} == {2}


def test_second_writers_drift_is_repaired(node, apiserver):
    async def scenario():
        async with Running(node) as r:
            r.pub.set_pool(node.pool(5))
            await r.settle(lambda: node.devices() == 5)
            await asyncio.sleep(0.3)
            theirs = copy.deepcopy(node.slices()[0])
            theirs["spec"]["devices"] = theirs["spec"]["devices"][:1]  # someone else rewrote our slice
            path = f"/apis/resource.k8s.io/v1/resourceslices/{theirs['metadata']['name']}"
            await asyncio.to_thread(apiserver.request, "PUT", path, body=theirs)
            await r.settle(lambda: node.devices() == 5)
            return r.store.writes

    writes = run(scenario())
    assert writes["update"] >= 1


def test_preconditions_give_real_conflicts(node):
    async def scenario():
        client = AsyncClient(config=KubeConfig.from_file(node.kubeconfig), field_manager=DRIVER)
        store = KubeStore(client, node_name=node.name, driver_name=DRIVER)
        try:
            obj = node.pool(2).slices[0]
            created = await store.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                                          "metadata": {"generateName": f"00000-{DRIVER}-{node.name}-"},
                                          "spec": {"driver": DRIVER, "nodeName": node.name, **obj,
                                                   "pool": {"name": node.name, "generation": 1, "resourceSliceCount": 1}}})  # fmt: skip
            meta = created["metadata"]
            same = await store.update(created)
            # the real server turns an update that changes nothing into a no-op: same resourceVersion
            assert same["metadata"]["resourceVersion"] == meta["resourceVersion"]
            changed = copy.deepcopy(created)
            changed["spec"]["devices"] = changed["spec"]["devices"][:1]
            fresh = await store.update(changed)
            assert fresh["metadata"]["resourceVersion"] != meta["resourceVersion"]
            with pytest.raises(Conflict):
                await store.update(created)  # stale resourceVersion
            with pytest.raises(Conflict):
                await store.delete(meta["name"], "00000000-0000-0000-0000-000000000000", "")  # wrong uid
            with pytest.raises(Conflict):
                await store.delete(meta["name"], meta["uid"], meta["resourceVersion"])  # stale resourceVersion
            await store.delete(meta["name"], meta["uid"], fresh["metadata"]["resourceVersion"])
            with pytest.raises(NotFound):
                await store.delete(meta["name"], meta["uid"], "")
            gone = copy.deepcopy(fresh)
            with pytest.raises((NotFound, Conflict)):
                await store.update(gone)
        finally:
            await client.close()

    run(scenario())
    assert node.slices() == []


def test_list_and_watch_see_only_this_nodes_slices(node, apiserver, tmp_path):
    other = Node(apiserver, tmp_path)

    async def scenario():
        async with Running(node) as mine:
            async with Running(other) as theirs:
                mine.pub.set_pool(node.pool(2))
                theirs.pub.set_pool(other.pool(3))
                await mine.settle(lambda: node.devices() == 2 and other.devices() == 3)
                listed = await mine.store.list_slices()
                assert {o["spec"]["nodeName"] for o in listed} == {node.name}
                events = mine.store.watch(mine.store.list_resource_version)
                theirs.pub.set_pool(other.pool(4))  # not ours: no event
                await theirs.settle(lambda: other.devices() == 4)
                mine.pub.set_pool(node.pool(1))
                kind, obj = await asyncio.wait_for(events.__anext__(), 10)
                await events.aclose()
                return kind, obj

    kind, obj = run(scenario())
    assert kind == "MODIFIED" and obj["spec"]["nodeName"] == node.name


def test_without_a_node_object_slices_have_no_owner(apiserver, tmp_path, caplog):
    node = Node(apiserver, tmp_path, create_node=False)

    async def scenario():
        async with Running(node) as r:
            r.pub.set_pool(node.pool(1))
            await r.settle(lambda: len(node.slices()) == 1)
            r.pub.set_pool(node.pool(2))
            await r.settle(lambda: node.devices() == 2)

    run(scenario())
    assert "ownerReferences" not in node.slices()[0]["metadata"]
    assert sum("cannot read Node" in m for m in caplog.messages) == 1


def test_agent_in_api_mode_publishes_with_its_service_account_token(apiserver, tmp_path, monkeypatch):
    from agent.service.daemon import Agent
    from agent.settings import Settings

    node = Node(apiserver, tmp_path, token=True)
    monkeypatch.setenv("KUBECONFIG", node.kubeconfig)
    settings = Settings(root=str(tmp_path), node_name=node.name, cluster="kube", debounce=0.05, resync_interval=0,
                        kubelet_dir=str(tmp_path / "kubelet"), cdi_dir=str(tmp_path / "cdi"))  # fmt: skip

    async def no_plugin():
        return None

    async def scenario():
        agent = Agent(settings, scan=lambda s: inventory(130))
        agent.start_kubelet_plugin = no_plugin
        stop = asyncio.Event()
        task = asyncio.get_running_loop().create_task(agent.run(stop))
        try:
            await agent.publisher.wait_synced(lambda p: p.total.created == 2, timeout=30)
        finally:
            stop.set()
            await task

    run(scenario())
    objs = node.slices()
    assert [len(o["spec"]["devices"]) for o in objs] == [128, 2]
    assert all(o["metadata"]["ownerReferences"][0]["uid"] == node.uid for o in objs)
