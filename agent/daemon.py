"""``sysdra run``: scan, publish, watch hardware and the cluster, republish; stop on
SIGTERM/SIGINT. Side effects stay at the edges: scanning is ``discovery``, slice
content is ``agent.slices``, writes go through a store in ``agent.publish``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from typing import Callable

from agent.publish import metrics
from agent.publish.drift import watch_api, watch_dir
from agent.publish.publisher import Publisher
from agent.settings import Settings
from agent.slices import PoolContent, build_pool
from agent.watch import Debouncer, HardwareWatcher

log = logging.getLogger("sysdra.daemon")


def default_scan(settings: Settings):
    from discovery.inventory import scan

    return scan(settings.root, list_attributes=settings.list_attributes)


def make_store(settings: Settings):
    """The store for ``--cluster``; returns (store, closer)."""
    if settings.cluster_dir is not None:
        from agent.publish.dirstore import DirStore

        return DirStore(settings.cluster_dir, node_name=settings.node_name, driver_name=settings.driver_name), None
    from agent.publish.kubestore import KubeStore, kube_client

    client = kube_client(field_manager=settings.driver_name)
    return KubeStore(client, node_name=settings.node_name, driver_name=settings.driver_name), client


class Agent:
    def __init__(self, settings: Settings, scan: Callable[[Settings], object] = default_scan, store=None):
        self.settings = settings
        self.scan = scan
        self.store, self._client = (store, None) if store is not None else make_store(settings)
        self.publisher = Publisher(self.store, node_name=settings.node_name, driver_name=settings.driver_name,
                                   resync_interval=settings.resync_interval, debounce=settings.debounce)
        self.inventory = None
        self.pool: PoolContent | None = None
        self.rescans = 0
        self._rejected_seen: set[tuple[str, str]] = set()
        self.kubelet_plugin = None

    # --- inventory -> pool ---------------------------------------------------------------
    def _pool_for(self, inventory) -> PoolContent:
        s = self.settings
        pool = build_pool(inventory, node_name=s.node_name, driver_name=s.driver_name,
                          list_attributes=s.list_attributes, pf_vf_exclusive=s.pf_vf_exclusive)
        for rejected in pool.rejected:
            if rejected not in self._rejected_seen:  # one line per bad device, not one per rescan
                log.error("device %s left out of the ResourceSlice: %s", *rejected)
                metrics.INVALID_DEVICES.inc()
        self._rejected_seen = set(pool.rejected)
        return pool

    async def rescan(self, changed_at: float | None = None) -> bool:
        """Scan again; hand the publisher a new pool only if what we publish changed."""
        self.rescans += 1
        inventory = await asyncio.to_thread(self.scan, self.settings)
        self.inventory = inventory
        pool = self._pool_for(inventory)
        if pool == self.pool:
            return False
        self.pool = pool
        self.publisher.set_pool(pool, changed_at=changed_at if changed_at is not None else time.monotonic())
        return True

    async def _periodic_rescan(self) -> None:
        while self.settings.resync_interval:
            await asyncio.sleep(self.settings.resync_interval)
            await self.rescan()
            self.publisher.request_sync()  # also repair drift nobody told us about

    # --- kubelet plugin hook -------------------------------------------------------------
    async def start_kubelet_plugin(self) -> None:
        """Serve the kubelet (issue 4) next to publishing, when that component is present."""
        try:
            from agent.claims import claim_source
            from agent.driver import Driver
            from agent.kubeletplugin.plugin import KubeletPlugin
        except ImportError as err:
            log.info("kubelet plugin not available (%s): publishing only", err)
            return
        try:
            driver = Driver(self.settings, lambda: self.inventory)
            self.kubelet_plugin = KubeletPlugin(self.settings, driver, claim_source(self.settings))
            await self.kubelet_plugin.start()
        except Exception:  # noqa: BLE001 - publishing still helps the scheduler; the lead decides
            log.exception("kubelet plugin failed to start")
            self.kubelet_plugin = None

    # --- main loop -----------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> int:
        loop = asyncio.get_running_loop()
        await self.rescan()
        tasks = [loop.create_task(self.publisher.run(), name="publisher"),
                 loop.create_task(self._periodic_rescan(), name="resync")]
        observer = None
        if self.settings.cluster_dir is not None and hasattr(self.store, "directory"):
            observer = watch_dir(self.store.directory, self.publisher, loop)
        elif hasattr(self.store, "watch"):
            tasks.append(loop.create_task(watch_api(self.store, self.publisher), name="slice-watch"))
        debouncer = Debouncer(self.settings.debounce, lambda first: self.rescan(first))
        watcher = HardwareWatcher(self.settings.root, debouncer)
        watcher.start(loop)
        await self.start_kubelet_plugin()
        log.info("sysdra running: node %s, driver %s, cluster %s", self.settings.node_name, self.settings.driver_name, self.settings.cluster)
        try:
            await stop.wait()
        finally:
            log.info("stopping")
            watcher.stop()
            debouncer.cancel()
            if observer is not None:
                observer.stop()
            if self.kubelet_plugin is not None:
                with contextlib.suppress(Exception):
                    await self.kubelet_plugin.stop()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._client is not None:
                await self._client.close()
        return 0


async def serve(settings: Settings) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return await Agent(settings).run(stop)
