"""``sysdra_hardware_change_to_slice_seconds``: every hardware change handed to the publisher is
observed once it is published, a change that comes while a sync of the one before is under way
too (a burst of hotplug events, a slow API server)."""

from __future__ import annotations

import asyncio
import time

from agent.publish.dirstore import DirStore
from agent.publish.publisher import Publisher
from tests.test_publisher import DRIVER, NODE, pool_of, run


class Gated:
    """The store, its listings held while ``gate`` is clear (``listing``: one began)."""

    def __init__(self, store: DirStore):
        self.store, self.full_names = store, store.full_names
        self.gate, self.listing = asyncio.Event(), asyncio.Event()

    async def list_slices(self):
        self.listing.set()
        await self.gate.wait()
        return await self.store.list_slices()

    async def create(self, obj):
        return await self.store.create(obj)

    async def update(self, obj):
        return await self.store.update(obj)

    async def delete(self, name, uid, rv):
        return await self.store.delete(name, uid, rv)


class Observed:
    def __init__(self):
        self.latencies: list[float] = []

    def observe_publish(self, ok, seconds, reason=None):
        pass

    def observe_change_to_slice(self, seconds):
        self.latencies.append(seconds)


def test_a_change_during_a_sync_is_observed_when_it_is_published(tmp_path):
    """The second of two changes came while the first one's sync ran: it was published by the next
    sync, and never observed (the histogram missed the changes of every burst)."""
    async def scenario():
        store, observed = Gated(DirStore(str(tmp_path), node_name=NODE, driver_name=DRIVER)), Observed()
        pub = Publisher(store, node_name=NODE, driver_name=DRIVER, resync_interval=0, debounce=0, observer=observed)
        task = asyncio.get_running_loop().create_task(pub.run())
        try:
            pub.set_pool(pool_of(3), changed_at=time.monotonic())
            await store.listing.wait()  # its sync is under way
            pub.set_pool(pool_of(4), changed_at=time.monotonic())
            store.gate.set()
            await pub.wait_synced(lambda p: p.syncs == 2 and p.total.writes == 2)
            await asyncio.sleep(0.2)  # (a third sync would have nothing to observe)
            return observed.latencies, pub.syncs
        finally:
            task.cancel()

    latencies, syncs = run(scenario())
    assert syncs == 2 and len(latencies) == 2
