"""An agent restarted on a node that did not change writes nothing, also on a node of more than
128 devices (several slices in its pool) whose last agent placed devices where a fresh split would
not: one device gone from the first slice, or one new device that filled that hole (sticky
placement, docs/publishing.md). A fresh split at start moved devices between slices there, and
the restarted agent rewrote the whole pool with a generation bump (every slice new to the scheduler).
The whole Agent (its pool building, its publisher) runs twice on one store: the offline directory
and the real kube-apiserver v1.37.2."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lightkube import AsyncClient, KubeConfig

from agent.publish.kubestore import KubeStore
from agent.publish.slices import build_pool, render, stored_pool
from discovery.models import Sriov
from agent.service.daemon import Agent
from tests import inventory_factory as factory
from tests.controlplane import unique
from tests.kubelet_standin import DRIVER, settings_for

GPUS = [factory.device(i) for i in range(300)]  # 128 + 128 + 44 at the first publish
CHANGES = {
    "device-gone": [GPUS[:5] + GPUS[6:]],  # a hole in slice 0
    "hole-filled": [GPUS[:5] + GPUS[6:], GPUS[:5] + GPUS[6:] + [factory.device(400)]],  # the new one goes there
}


TAINT = [{"key": "sysdra.io/unhealthy", "value": "xid-79", "effect": "NoSchedule"}]
NICS = [d for p in (200, 201) for d in [factory.device(p, "nic", sriov=Sriov(total_vfs=64, num_vfs=40))] +
        [factory.device(300 + 64 * (p - 200) + f, "nic", physfn=factory.bdf(p)) for f in range(40)]]


def placement(slices: list[dict]) -> dict[str, tuple[str, int]]:
    """device -> (its slice's name, the pool generation)"""
    return {d["name"]: (s["metadata"]["name"], s["spec"]["pool"]["generation"])
            for s in slices for d in s["spec"].get("devices", ())}


async def lifetimes(settings, store_of, inventories: list) -> tuple[dict, dict, int]:
    """The first agent publishes ``inventories`` one after the other; a second one starts on the
    last. (what the first left, what the second left, the second's writes)"""
    now = {"inventory": factory.Inventory(root="/", devices=tuple(inventories[0]))}
    scan = lambda _settings: now["inventory"]  # noqa: E731
    first = Agent(settings, scan=scan, store=await store_of())
    for devices in inventories:
        now["inventory"] = factory.Inventory(root="/", devices=tuple(devices))
        await first.rescan()
        await first.publisher.sync_once()
    before = placement(await first.store.list_slices())
    second = Agent(settings, scan=scan, store=await store_of())
    await second.rescan()
    stats = await second.publisher.sync_once()
    return before, placement(await second.store.list_slices()), stats.writes


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_restarted_agent_writes_nothing_to_the_directory(tmp_path, change):
    settings = settings_for(str(tmp_path), metrics_address="")
    from agent.publish.dirstore import DirStore

    async def store_of():
        return DirStore(settings.cluster_dir, node_name=settings.node_name, driver_name=DRIVER)

    before, after, writes = asyncio.run(asyncio.wait_for(lifetimes(settings, store_of, [GPUS, *CHANGES[change]]), 60))
    assert after == before and writes == 0


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_restarted_agent_writes_nothing_to_the_api_server(apiserver, tmp_path, change):
    node = apiserver.create_node(unique("restart"))["metadata"]["name"]
    settings = settings_for(str(tmp_path), metrics_address="", node_name=node)
    clients: list[AsyncClient] = []

    async def store_of():
        clients.append(AsyncClient(config=KubeConfig.from_file(apiserver.kubeconfig), field_manager=DRIVER))
        return KubeStore(clients[-1], node_name=node, driver_name=DRIVER)

    async def main():
        try:
            return await lifetimes(settings, store_of, [GPUS, *CHANGES[change]])
        finally:
            for client in clients:
                await client.close()

    try:
        before, after, writes = asyncio.run(asyncio.wait_for(main(), 120))
        assert after == before and writes == 0
    finally:
        for o in apiserver.list("ResourceSlice", fields={"spec.nodeName": node}):
            apiserver.delete("ResourceSlice", o["metadata"]["name"])
        apiserver.delete("Node", node)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(data=st.data())
def test_a_restart_places_every_device_where_the_running_agent_had_it(data):
    """Whatever the running agent went through (devices gone and back, taints making slices of 64,
    counter slices, slices of their own for node operations), the agent started on its slices
    builds the very pool it had: nothing to write."""
    names = [d.name for d in GPUS[:200] + NICS]
    options = {"pf_vf_exclusive": data.draw(st.booleans()),
               "skip_node_operations": {k: ["*"] for k in data.draw(st.lists(st.sampled_from(["gpu", "nic"]), unique=True))}}
    pool = None
    for _ in range(data.draw(st.integers(1, 4))):
        gone = set(data.draw(st.lists(st.sampled_from(names), unique=True, max_size=60)))
        taints = {n: TAINT for n in data.draw(st.lists(st.sampled_from(names), unique=True, max_size=40))}
        inv = factory.Inventory(root="/", devices=tuple(d for d in GPUS[:200] + NICS if d.name not in gone))
        pool = build_pool(inv, node_name="n", driver_name=DRIVER, **options, taints=taints, previous=pool)
    stored = render(pool, driver_name=DRIVER, node_name="n", generation=3, full_name=True)
    restarted = build_pool(inv, node_name="n", driver_name=DRIVER, **options, taints=taints,
                           previous=stored_pool(stored, "n"))
    assert restarted == pool
