"""A periodic resync that finds the node as it was keeps one copy of what the agent publishes:
the pool handed to the publisher stays, and its device entries are the per-device slice cache's
(each full scan's new records used to miss that cache: the idle agent then held the published
pool and a second, equal set of entries in the cache)."""

from __future__ import annotations

import asyncio

from agent.service.daemon import Agent
from tests.conftest import profile_root
from tests.kubelet_standin import settings_for


def test_a_resync_of_an_unchanged_node_keeps_one_copy_of_the_pool(tmp_path):
    agent = Agent(settings_for(str(tmp_path), root=profile_root("server-2s-gpu-nic"), metrics_address=""))

    async def resyncs():
        assert await agent.rescan()  # the first scan: a new pool for the publisher
        published, inventory = agent.pool, agent.inventory
        assert not await agent.rescan()  # a full rescan (the resync's): nothing to publish
        return published, inventory

    published, inventory = asyncio.run(resyncs())
    assert agent.pool is published and agent.publisher.pool is published
    assert all(a is b for a, b in zip(agent.inventory.devices, inventory.devices))
    entries = [d for sl in published.slices for d in sl.get("devices", ())]
    assert entries and all(agent._slice_cache[d["name"]][3] is d for d in entries)
