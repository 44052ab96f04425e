"""Keeps the store equal to the desired pool: syncs on request (new inventory, a watch
event from someone else's write or the kubelet's wipe), on a timer, and retries failures
with backoff. Never raises out of ``run``: API errors are logged and counted."""

from __future__ import annotations

import asyncio
import logging
import time

from agent.publish.backoff import Backoff
from agent.publish.listattrs import ListAttributesRefused
from agent.publish.reconcile import Reconciler, SyncStats
from agent.publish.slices import PoolContent
from agent.publish.store import Conflict, SliceStore, StoreError

log = logging.getLogger("sysdra.publish")


class Publisher:
    def __init__(self, store: SliceStore, *, node_name: str, driver_name: str, resync_interval: float = 300.0,
                 debounce: float = 0.25, backoff: Backoff | None = None, observer=None, on_lists_refused=None,
                 placed=None):
        self.store = store
        # placed(the stored PoolContent) -> the pool placed like it (or None): asked once, at the
        # first sync that lists the store, so a restarted agent keeps its devices where they are
        self._placed = placed
        # called with ListAttributesRefused: the daemon publishes without list attributes (agent/service/listfallback.py)
        self.on_lists_refused = on_lists_refused
        # agent.service.metrics.Metrics (or None): observe_publish(ok, secs, reason), observe_change_to_slice(secs)
        self.observer = observer
        self.reconciler = Reconciler(store, node_name=node_name, driver_name=driver_name)
        self.resync_interval = resync_interval
        self.debounce = debounce  # coalesce bursts of watch events into one sync
        self.backoff = backoff or Backoff()
        self.pool: PoolContent | None = None
        self.last_stats: SyncStats | None = None
        self.total = SyncStats()
        self.syncs = 0
        self.errors = 0
        self._wake = asyncio.Event()
        self._synced = asyncio.Condition()
        self.last_change_latency: float | None = None
        self.last_error: str | None = None
        self._pending_since: float | None = None  # monotonic time of the change waiting to be published
        self._urgent = False  # a new pool skips the debounce: its rescan was already debounced

    # --- inputs ------------------------------------------------------------------------
    def set_pool(self, pool: PoolContent, changed_at: float | None = None) -> None:
        self.pool = pool
        if changed_at is not None and self._pending_since is None:
            self._pending_since = changed_at
        self._urgent = True
        self._wake.set()

    def request_sync(self) -> None:
        self._wake.set()

    # --- loop --------------------------------------------------------------------------
    async def sync_once(self) -> SyncStats:
        t0 = time.monotonic()
        # the change this sync publishes: one handed over while it runs waits for the next sync
        since, self._pending_since = self._pending_since, None
        try:
            stats = await self.reconciler.sync(self.pool, self._place_once if self._placed is not None else None)
        except BaseException:
            self._pending_since = since if since is not None else self._pending_since  # (the earliest stays)
            raise
        if self.observer is not None:
            self.observer.observe_publish(True, time.monotonic() - t0)
        self.last_stats = stats
        self.total.created += stats.created
        self.total.updated += stats.updated
        self.total.deleted += stats.deleted
        self.syncs += 1
        if self.syncs == 1:  # the node's devices are in the cluster as this agent sees them
            devices = sum(len(s.get("devices") or ()) for s in self.pool.slices)
            log.info("ResourceSlices in sync: %d devices in %d slices (%d written)", devices, len(self.pool.slices), stats.writes)
        if since is not None:
            self.last_change_latency = time.monotonic() - since
            if self.observer is not None:
                self.observer.observe_change_to_slice(self.last_change_latency)
        async with self._synced:
            self._synced.notify_all()
        return stats

    def _place_once(self, stored: PoolContent | None) -> PoolContent | None:
        placed, self._placed = self._placed, None
        pool = placed(stored) if stored is not None else None
        if pool is not None:
            self.pool = pool
        return pool

    async def run(self) -> None:
        while True:
            try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel racing the wake-up
                async with asyncio.timeout(self.resync_interval or None):
                    await self._wake.wait()
            except TimeoutError:
                pass  # periodic resync: repairs drift nobody told us about
            self._wake.clear()
            if self.debounce and not self._urgent:
                await asyncio.sleep(self.debounce)
                self._wake.clear()
            self._urgent = False
            if self.pool is None:
                continue
            while True:
                try:
                    await self.sync_once()
                    self.backoff.reset()
                    break
                except ListAttributesRefused as err:
                    # the same pool would be refused again: wait for the next (the handler's, or the resync)
                    self._count_error("list_attributes", err, quiet=self.on_lists_refused is not None)
                    if self.on_lists_refused is not None:
                        self.on_lists_refused(err)
                    break
                except Conflict as err:
                    # someone else wrote in between: re-list and try again, briefly backed off
                    self._count_error("conflict", err)
                    await asyncio.sleep(min(self.backoff.next(), 1.0))
                except StoreError as err:
                    self._count_error("api", err)
                    await asyncio.sleep(self.backoff.next())
                except Exception as err:  # noqa: BLE001 - a bug must not stop publishing forever
                    log.exception("unexpected error while publishing slices")
                    self._count_error("internal", err)
                    await asyncio.sleep(self.backoff.next())

    def _count_error(self, reason: str, err: Exception, quiet: bool = False) -> None:
        self.errors += 1
        self.last_error = f"{reason}: {err}"
        if self.observer is not None:
            self.observer.observe_publish(False, 0.0, reason)
        if not quiet:  # (the handler of a refusal says it once, as an error)
            log.warning("publishing slices failed (%s): %s; retrying", reason, err)

    async def wait_synced(self, predicate=lambda p: True, timeout: float = 10.0) -> None:
        """For tests and start-up: wait until a sync has completed and ``predicate(self)`` holds."""
        async def _wait():
            async with self._synced:
                await self._synced.wait_for(lambda: self.syncs > 0 and predicate(self))
        async with asyncio.timeout(timeout):
            await _wait()
