"""``sysdra run``: scan, publish, watch hardware and the cluster, republish; stop on
SIGTERM/SIGINT. Side effects stay at the edges: scanning is ``discovery``, slice
content is ``agent.publish.slices``, writes go through a store in ``agent.publish``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from typing import Callable

from agent.publish import metrics as publish_metrics
from agent.publish.drift import watch_api, watch_dir
from agent.publish.publisher import Publisher
from agent.publish.slices import PoolContent, build_pool
from agent.service import sdnotify
from agent.service.logs import setup_logging
from agent.service.metrics import Metrics, start_server
from agent.service.status import StatusBoard, StatusServer, status_socket_path
from agent.service.watch import Debouncer, HardwareWatcher, start_file_observer
from agent.settings import ConfigError, Settings

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


# Settings a SIGHUP applies without a restart; the others need one (sockets, paths, identity).
LIVE_SETTINGS = frozenset({"log_level", "log_format", "resync_interval", "debounce", "health_interval",
                           "list_attributes", "pf_vf_exclusive", "taint_unhealthy"})


def trim_heap() -> None:
    """Hand freed heap back to the OS (glibc keeps it in its arenas otherwise)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class ObservedDriver:
    """The driver, timed per claim for metrics, refreshing the status board's claim list."""

    def __init__(self, driver, metrics: Metrics, board: StatusBoard):
        self.driver, self.metrics, self.board = driver, metrics, board

    def __getattr__(self, name):  # recover(), checkpoint, ... pass through
        return getattr(self.driver, name)

    def _observe(self, observe, results: dict, seconds: float) -> None:
        per_claim = seconds / max(1, len(results))
        for result in results.values():
            failed = getattr(result, "error", result)  # PrepareResult or unprepare's error string
            observe(not failed, per_claim)
        cp = getattr(self.driver, "checkpoint", None)
        if cp is not None:
            self.board.set_prepared_claims(cp.claims)

    def prepare_claims(self, claims):
        t0 = time.perf_counter()
        results = self.driver.prepare_claims(claims)
        self._observe(self.metrics.observe_prepare, results, time.perf_counter() - t0)
        return results

    def unprepare_claims(self, claims):
        t0 = time.perf_counter()
        results = self.driver.unprepare_claims(claims)
        self._observe(self.metrics.observe_unprepare, results, time.perf_counter() - t0)
        return results


class PublishObserver:
    """Publisher -> metrics and status board (one place reports each fact)."""

    def __init__(self, agent: "Agent"):
        self.agent = agent

    def observe_publish(self, ok: bool, seconds: float, reason: str = "error") -> None:
        a = self.agent
        a.metrics.observe_publish(ok, seconds, reason)
        pool = a.pool
        devices = sum(len(sl.get("devices", ())) for sl in pool.slices) if pool is not None else None
        a.board.record_publish(ok, error=a.publisher.last_error if not ok else None, devices=devices,
                               slices=len(pool.slices) if pool is not None else None)

    def observe_change_to_slice(self, seconds: float) -> None:
        self.agent.metrics.observe_change_to_slice(seconds)


class Agent:
    def __init__(self, settings: Settings, scan: Callable[[Settings], object] = default_scan, store=None,
                 metrics: Metrics | None = None):
        self.settings = settings
        self.scan = scan
        self.metrics = metrics or Metrics(process=False)
        self.board = StatusBoard(settings.node_name, settings.driver_name, metrics=self.metrics)
        self.store, self._client = (store, None) if store is not None else make_store(settings)
        self.publisher = Publisher(self.store, node_name=settings.node_name, driver_name=settings.driver_name,
                                   resync_interval=settings.resync_interval, debounce=settings.debounce,
                                   observer=PublishObserver(self))
        self.debouncer: Debouncer | None = None
        self.health = None  # agent.health.HealthMonitor once the kubelet plugin runs
        self.inventory = None
        self.pool: PoolContent | None = None
        self.rescans = 0
        self._scanner = None  # discovery.inventory.IncrementalScanner of the default scan
        self._slice_cache: dict = {}  # agent.publish.slices.build_pool's per-device cache
        self._rejected_seen: set[tuple[str, str]] = set()
        self.kubelet_plugin = None

    # --- inventory -> pool ---------------------------------------------------------------
    def _pool_for(self, inventory) -> PoolContent:
        s = self.settings
        taints = self.health.taints() if s.taint_unhealthy and self.health is not None else None
        pool = build_pool(inventory, node_name=s.node_name, driver_name=s.driver_name,
                          list_attributes=s.list_attributes, pf_vf_exclusive=s.pf_vf_exclusive, taints=taints,
                          previous=self.pool, cache=self._slice_cache)
        for rejected in pool.rejected:
            if rejected not in self._rejected_seen:  # one line per bad device, not one per rescan
                log.error("device %s left out of the ResourceSlice: %s", *rejected)
                publish_metrics.INVALID_DEVICES.inc()
        self._rejected_seen = set(pool.rejected)
        return pool

    def _scan(self, changed: set[str] | None) -> object:
        """Default scanner: incremental (re-read only ``changed`` PCI functions, None = all);
        an injected ``scan`` function (tests) always scans everything."""
        if self.scan is not default_scan:
            return self.scan(self.settings)
        from discovery.inventory import IncrementalScanner

        s = self.settings
        sc = self._scanner
        if sc is None or sc.root != os.path.abspath(s.root) or sc.list_attributes != s.list_attributes:
            sc = self._scanner = IncrementalScanner(s.root, list_attributes=s.list_attributes)
            changed = None
        return sc.update(changed)

    async def rescan(self, changed_at: float | None = None, changed: set[str] | None = None) -> bool:
        """Scan again (only the ``changed`` PCI functions, None = a full scan); hand the
        publisher a new pool only if what we publish changed."""
        self.rescans += 1
        inventory = await asyncio.to_thread(self._scan, changed)
        self.inventory = inventory  # the old one goes here
        if changed is None:
            trim_heap()  # a full scan's garbage would otherwise stay in the RSS for good
        if self.health is not None:
            self.health.on_inventory(inventory)
        self.board.set_inventory(inventory, health=self.health_states())
        return self._republish(changed_at)

    def _republish(self, changed_at: float | None = None) -> bool:
        """Hand the publisher a new pool only if what we publish changed."""
        if self.inventory is None:
            return False
        pool = self._pool_for(self.inventory)
        if pool == self.pool:
            return False
        self.pool = pool
        self.publisher.set_pool(pool, changed_at=changed_at if changed_at is not None else time.monotonic())
        return True

    async def _follow_health(self) -> None:
        """After every health round: status board, metrics, and (with --taint-unhealthy) taints."""
        sub = self.health.subscribe()
        try:
            while not sub.closed:
                await sub.event.wait()
                sub.event.clear()
                if self.inventory is not None:
                    self.board.set_inventory(self.inventory, health=self.health_states())
                if self.settings.taint_unhealthy:
                    self._republish()
        finally:
            self.health.unsubscribe(sub)

    async def _periodic_rescan(self) -> None:
        while self.settings.resync_interval:
            await asyncio.sleep(self.settings.resync_interval)
            await self.rescan()
            self.publisher.request_sync()  # also repair drift nobody told us about

    async def _first_publish(self, wait: float = 1.0) -> None:
        """Let the first slices go out before the watchers and the kubelet side start (on a
        large node, setting up file watches alone takes ~0.5 s). A store that does not answer
        within ``wait`` seconds (API server down) does not hold them up."""
        with contextlib.suppress(asyncio.TimeoutError):
            await self.publisher.wait_synced(timeout=wait)

    # --- kubelet plugin hook -------------------------------------------------------------
    async def start_kubelet_plugin(self) -> None:
        """Serve the kubelet (issue 4) next to publishing, when that component is present."""
        try:
            from agent.kubeletplugin.claims import claim_source
            from agent.prepare.driver import Driver
            from agent.kubeletplugin.plugin import KubeletPlugin
        except ImportError as err:
            log.info("kubelet plugin not available (%s): publishing only", err)
            return
        from agent import health

        driver = ObservedDriver(Driver(self.settings, lambda: self.inventory), self.metrics, self.board)
        self.kubelet_plugin = KubeletPlugin(self.settings, driver, claim_source(self.settings))
        self.kubelet_plugin.registration.listeners.append(self._on_registration)
        self.health = health.attach(self.kubelet_plugin, lambda: self.inventory, self.settings)
        await self.health.start()
        if os.path.realpath(self.settings.root) == "/":  # kernel link events are about this host only
            self.health.watch_links()
        await self.kubelet_plugin.start()  # raises: the agent exits non-zero and systemd restarts it
        self.board.set_registration("waiting")
        if driver.checkpoint is not None:
            self.board.set_prepared_claims(driver.checkpoint.claims)

    def _on_registration(self, status) -> None:
        if status.registered:
            self.board.set_registration("registered")
        else:
            log.error("kubelet REJECTED the plugin registration: %s", status.error or "no reason given")
            self.board.set_registration("failed", status.error or "registration rejected")

    def health_states(self) -> dict[str, str] | None:
        """Device name -> healthy/unhealthy/unknown, once the health monitor runs."""
        if self.health is None:
            return None
        return {name: state.lower() for name, (state, _msg) in self.health.snapshot().items()}

    # --- SIGHUP ----------------------------------------------------------------------------
    def reload(self, new: Settings) -> None:
        """Apply the settings that can change live; say which ones need a restart."""
        old = self.settings
        changed = {k for k in Settings.model_fields if getattr(old, k) != getattr(new, k)}
        if not changed:
            log.info("SIGHUP: configuration unchanged")
            return
        restart = sorted(changed - LIVE_SETTINGS)
        if restart:
            log.warning("SIGHUP: %s changed but need a restart; keeping the running values", ", ".join(restart))
        live = {k: getattr(new, k) for k in changed & LIVE_SETTINGS}
        if not live:
            return
        self.settings = old.model_copy(update=live)
        self.publisher.resync_interval = self.settings.resync_interval
        self.publisher.debounce = self.settings.debounce
        if self.debouncer is not None:
            self.debouncer.delay = self.settings.debounce
        if self.health is not None:
            self.health.interval = self.settings.health_interval
        if "log_level" in live or "log_format" in live:
            setup_logging(self.settings)
        log.info("SIGHUP: applied %s", ", ".join(f"{k}={v}" for k, v in sorted(live.items())))
        if {"list_attributes", "pf_vf_exclusive", "taint_unhealthy"} & set(live):
            self._republish()

    # --- main loop -----------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> int:
        loop = asyncio.get_running_loop()
        status_path = status_socket_path(self.settings)
        status_server = StatusServer(self.board, status_path)
        try:
            os.makedirs(os.path.dirname(status_path), mode=0o750, exist_ok=True)
            await status_server.start()
        except OSError as err:
            log.warning("status socket not served (%s): `sysdra status` will not reach this agent", err)
            status_server = None
        metrics_server = None
        try:
            metrics_server = start_server(self.settings.metrics_address, self.metrics)
        except (OSError, ValueError) as err:
            log.warning("metrics endpoint %s not served: %s", self.settings.metrics_address, err)
        await self.rescan()
        tasks = [loop.create_task(self.publisher.run(), name="publisher"),
                 loop.create_task(self._periodic_rescan(), name="resync")]
        await self._first_publish()
        observer = None
        if self.settings.cluster_dir is not None and hasattr(self.store, "directory"):
            observer = watch_dir(self.store.directory, self.publisher, loop, start_file_observer)
        elif hasattr(self.store, "watch"):
            tasks.append(loop.create_task(watch_api(self.store, self.publisher), name="slice-watch"))
        debouncer = self.debouncer = Debouncer(self.settings.debounce, lambda first, changed: self.rescan(first, changed),
                                               with_changes=True)
        watcher = HardwareWatcher(self.settings.root, debouncer, on_event=self.metrics.count_watcher_event)
        watcher.start(loop)
        try:
            await self.start_kubelet_plugin()
        except BaseException:
            watcher.stop()
            for task in tasks:
                task.cancel()
            raise
        # sockets served and state reconciled: ready (publishing may still wait for the API server)
        sdnotify.ready(self.board.summary())
        tasks.append(loop.create_task(self._report_status(), name="sd-status"))
        tasks.append(loop.create_task(self._follow_health(), name="health-follow"))
        watchdog = sdnotify.start_watchdog(loop)
        log.info("sysdra running: node %s, driver %s, cluster %s", self.settings.node_name, self.settings.driver_name, self.settings.cluster)
        try:
            await stop.wait()
        finally:
            log.info("stopping")
            sdnotify.stopping("stopping")
            if watchdog is not None:
                watchdog.cancel()
            watcher.stop()
            debouncer.cancel()
            if observer is not None:
                observer.stop()
            if self.health is not None:
                with contextlib.suppress(Exception):
                    await self.health.stop()
            if self.kubelet_plugin is not None:
                with contextlib.suppress(Exception):
                    await self.kubelet_plugin.stop()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._client is not None:
                await self._client.close()
            if status_server is not None:
                await status_server.close()
            if metrics_server is not None:
                metrics_server.close()
        return 0

    async def _report_status(self) -> None:
        """STATUS= for `systemctl status`: one line, refreshed while running."""
        while True:
            await asyncio.sleep(5)
            sdnotify.status(self.board.summary())


async def serve(settings: Settings, reload_settings: Callable[[], Settings] | None = None) -> int:
    """Run until SIGTERM/SIGINT; on SIGHUP re-read flags, environment and config file."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    agent = Agent(settings, metrics=Metrics())

    def on_hup() -> None:
        if reload_settings is None:
            return
        try:
            agent.reload(reload_settings())
        except ConfigError as err:
            log.error("SIGHUP: new configuration rejected, keeping the running one: %s", err)

    loop.add_signal_handler(signal.SIGHUP, on_hup)
    return await agent.run(stop)
