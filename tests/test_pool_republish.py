"""Property: a republish after a change keeps the pool on the real kube-apiserver v1.37.2
consistent. The agent's Reconciler (over KubeStore, as the daemon runs it) publishes a pool,
then the pool after a change (devices gone, faults raised or cleared, the share or node
operations settings changed), built as the daemon builds it (``previous``, the slice cache):
the server then holds exactly the new pool's devices, in one generation with
resourceSliceCount slices, valid by the allocator's rules (tests/pool_checks.py), and a sync
of an unchanged pool writes nothing (a difference the server's own spelling makes, read back
as a change, would rewrite the pool on every resync)."""

from __future__ import annotations

import asyncio
import functools

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from lightkube import AsyncClient, KubeConfig

from agent.publish.kubestore import KubeStore
from agent.publish.reconcile import Reconciler
from agent.publish.sharing import share_plan
from agent.publish.slices import build_pool
from discovery.inventory import scan
from discovery.models import Inventory, Sriov
from tests import inventory_factory as factory
from tests.conftest import profile_root, profiles
from tests.controlplane import unique
from tests.pool_checks import DRIVER, allocator_problem, partition_type_problems, pool_problems

TAINT = [{"key": "sysdra.io/unhealthy", "value": "xid-79", "effect": "NoSchedule"}]


@functools.lru_cache(maxsize=None)
def inventory(name: str, list_attributes: bool) -> Inventory:
    """A fixture node, or ``many``: 150 GPUs and 2 NICs with 40 VFs each (past 128 devices a slice)."""
    if name != "many":
        return scan(profile_root(name), list_attributes=list_attributes)
    gpus = [factory.device(i) for i in range(150)]
    nics = []
    for p in (200, 201):
        nics.append(factory.device(p, "nic", sriov=Sriov(total_vfs=64, num_vfs=40)))
        nics += [factory.device(300 + 64 * (p - 200) + f, "nic", physfn=factory.bdf(p)) for f in range(40)]
    return Inventory(root="/", devices=tuple(gpus + nics))


@st.composite
def settings_of(draw, names: list[str]) -> dict:
    return {"share": share_plan(tuple(draw(st.lists(st.sampled_from(["gpu", "nic"]), unique=True))), None),
            "taints": {n: TAINT for n in draw(st.lists(st.sampled_from(names), unique=True, max_size=70))},
            "skip_node_operations": {k: ["*"] for k in draw(st.lists(st.sampled_from(["gpu", "nic"]), unique=True))}}


def stored(plane, node: str) -> list[dict]:
    return sorted(plane.list("ResourceSlice", fields={"spec.nodeName": node, "spec.driver": DRIVER}),
                  key=lambda o: o["metadata"]["name"])


@settings(max_examples=60, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate, Phase.shrink],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_a_republish_after_a_change_keeps_the_pool_consistent(apiserver, data):
    name = data.draw(st.sampled_from(["many", *profiles()]))
    options = {"list_attributes": data.draw(st.booleans()), "pf_vf_exclusive": data.draw(st.booleans()),
               "partitions": data.draw(st.booleans()), "partition_type_attribute": data.draw(st.booleans())}
    inv = inventory(name, options["list_attributes"])
    names = [d.name for d in inv.devices]
    before, after = data.draw(settings_of(names)), data.draw(settings_of(names))
    gone = set(data.draw(st.lists(st.sampled_from(names), unique=True, max_size=len(names) // 2)))
    later = inv.replace(devices=tuple(d for d in inv.devices if d.name not in gone))

    node = apiserver.create_node(unique("repub"))["metadata"]["name"]
    try:
        asyncio.run(asyncio.wait_for(republish(apiserver, node, inv, later, options, before, after), 120))
    finally:
        for o in stored(apiserver, node):
            apiserver.delete("ResourceSlice", o["metadata"]["name"])
        apiserver.delete("Node", node)


async def republish(plane, node: str, inv, later, options: dict, before: dict, after: dict) -> None:
    client = AsyncClient(config=KubeConfig.from_file(plane.kubeconfig), field_manager=DRIVER)
    reconciler = Reconciler(KubeStore(client, node_name=node, driver_name=DRIVER), node_name=node, driver_name=DRIVER)
    cache: dict = {}  # as the daemon keeps it across builds
    try:
        first = build_pool(inv, node_name=node, driver_name=DRIVER, **options, **before, cache=cache)
        second = build_pool(later, node_name=node, driver_name=DRIVER, **options, **after, previous=first, cache=cache)
        for pool in (first, second):
            await reconciler.sync(pool)
            assert (await reconciler.sync(pool)).writes == 0  # nothing changed: nothing written
            slices = stored(plane, node)
            assert not (problems := pool_problems(slices) + partition_type_problems(slices)), problems
            assert len(slices) == len(pool.slices)
            devices = sorted(d["name"] for o in slices for d in o["spec"].get("devices", []))
            assert devices == sorted(d["name"] for s in pool.slices for d in s.get("devices", []))
        assert allocator_problem(slices, node) is None
    finally:
        await client.close()


def test_an_empty_pool_is_not_rewritten_at_every_sync(apiserver):
    """A node whose last device is gone keeps one empty slice; the server stores it without
    ``devices`` (omitempty), which is no change from the ``devices: []`` the agent sends."""
    inv = inventory("many", False)
    node = apiserver.create_node(unique("empty"))["metadata"]["name"]
    try:
        asyncio.run(asyncio.wait_for(republish(apiserver, node, inv, inv.replace(devices=()), {}, {}, {}), 60))
    finally:
        for o in stored(apiserver, node):
            apiserver.delete("ResourceSlice", o["metadata"]["name"])
        apiserver.delete("Node", node)
