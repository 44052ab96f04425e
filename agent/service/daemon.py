"""``sysdra run``: scan, publish, watch hardware and the cluster, republish; stop on
SIGTERM/SIGINT. Side effects stay at the edges: scanning is ``discovery``, slice
content is ``agent.publish.slices``, writes go through a store in ``agent.publish``."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import time
from typing import Callable

from agent.fsutil import make_dirs
from agent.publish import metrics as publish_metrics
from agent.publish.drift import watch_api, watch_dir
from agent.publish.publisher import Publisher
from agent.publish.slices import PoolContent, build_pool, pool_options
from agent.kubeletplugin.sockets import InstanceLock, InstanceLocked, dra_socket_path
from agent.service import heap, loops, miglayouts, reload as reloading, scanning, sdnotify, startup
from agent.service.listfallback import ListFallback
from agent.service.hostnics import HostNics
from agent.service.inpod import InPodNetdevs
from agent.service.scanning import default_scan
from agent.service.observers import NullMetrics, PublishObserver
from agent.service.startup import EX_TEMPFAIL, StartupError
from agent.service.status import StatusBoard, StatusServer, status_socket_path
from agent.service.routewatch import follow_default_routes
from agent.service.watch import Debouncer, HardwareWatcher, start_file_observer
from agent.settings import Settings

log = logging.getLogger("sysdra.daemon")


class Agent:
    def __init__(self, settings: Settings, scan: Callable[[Settings], object] = default_scan, store=None,
                 metrics=None):
        self.settings = settings
        self.scan = scan
        if metrics is None:
            from agent.service.metrics import Metrics

            metrics = Metrics(process=False)
        self.metrics = metrics  # agent.service.metrics.Metrics, or NullMetrics without an endpoint
        self.board = StatusBoard(settings.node_name, settings.driver_name, metrics=self.metrics)
        if settings.nri_socket:  # the NRI plugin starts after the kubelet side; its first report replaces this
            self.board.set_nri({"state": "connecting", "reason": "the agent is starting", "socket": settings.nri_socket})
        self.store, self._client = (store, None) if store is not None else startup.make_store(settings)
        self.lists = ListFallback(self._rescan_soon)  # list attributes the API server refuses: published without
        self.publisher = Publisher(self.store, node_name=settings.node_name, driver_name=settings.driver_name,
                                   resync_interval=settings.resync_interval, debounce=settings.debounce,
                                   observer=PublishObserver(self), on_lists_refused=self.lists.refused, placed=self._placed_like)
        self.debouncer: Debouncer | None = None
        self.health = None  # agent.health.HealthMonitor once the kubelet plugin runs
        self._health_task: asyncio.Task | None = None  # its verdicts to status, metrics and taints
        self.inventory = None
        self._listed = settings.list_attributes  # what the inventory was scanned with (a SIGHUP may change it)
        self.pool: PoolContent | None = None
        self.rescans = 0
        self.resync_changed = asyncio.Event()  # a SIGHUP changed resync_interval: loops.periodic_rescan recomputes
        self._scanner = None  # discovery.inventory.IncrementalScanner of the default scan
        # the NICs whose netdevs the NRI plugin moved into pods keep their facts (discovery/away.py)
        self._in_pod = InPodNetdevs(settings.plugin_dir, lambda: getattr(getattr(self.kubelet_plugin, "driver", None), "saved", None))
        self._slice_cache: dict = {}  # agent.publish.slices.build_pool's per-device cache
        self.held_gpus: frozenset[str] = frozenset()  # not offered whole (service/kubeletside.held_gpus)
        self._background: set[asyncio.Task] = set()  # rescans asked for by a GPU mode switch
        self._scanning = asyncio.Lock()
        self._rejected_seen: set[tuple[str, str]] = set()
        self.kubelet_plugin = None
        self.watcher: HardwareWatcher | None = None
        self._registration_answered = asyncio.Event()  # the kubelet called NotifyRegistrationStatus
        self.host_nics = HostNics(lambda: self.settings, lambda: self._republish())  # their taints (docs/networking.md)
        self._first_round: tuple[dict, dict] | None = None  # --taint-unhealthy: (taints, health) until the monitor runs

    # --- inventory -> pool ---------------------------------------------------------------
    def _placed_like(self, stored: PoolContent) -> PoolContent:
        """At the first sync, each device in the slice the store holds it in: a restart writes nothing."""
        self.pool = self._pool_for(self.inventory, previous=stored)  # (a pool to sync: scanned already)
        return self.pool

    def _pool_for(self, inventory, previous: PoolContent | None = None) -> PoolContent:
        s, taints = self.settings, None
        if s.taint_unhealthy:  # before the monitor runs (the first publish): the first scan's round
            taints = self.health.taints() if self.health is not None else (self._first_round or ({}, {}))[0]
            taints = self.host_nics.with_taints(taints)
        # validated against what the scan made: a SIGHUP's new list_attributes waits for its rescan
        options = {**pool_options(s), "list_attributes": self._listed}
        pool = build_pool(inventory, **options, taints=taints, previous=previous or self.pool, cache=self._slice_cache, held=self.held_gpus)
        for rejected in pool.rejected:
            if rejected not in self._rejected_seen:  # one line per bad device, not one per rescan
                log.error("device %s left out of the ResourceSlice: %s", *rejected)
                publish_metrics.INVALID_DEVICES.inc()
        self._rejected_seen = set(pool.rejected)
        publish_metrics.LEFT_OUT.set(len(pool.rejected))
        return pool

    def _scan(self, settings: Settings, changed: set[str] | None) -> object:
        """Default scanner: incremental (re-read only ``changed`` PCI functions, None = all);
        an injected ``scan`` function (tests) always scans everything."""
        if self.scan is not default_scan:
            return self.scan(settings)
        self._scanner, inventory = scanning.update(self._scanner, settings, changed, away=self._in_pod)
        return inventory

    async def rescan(self, changed_at: float | None = None, changed: set[str] | None = None) -> bool:
        """Scan again (only the ``changed`` PCI functions, None = a full scan); hand the
        publisher a new pool only if what we publish changed."""
        self.rescans += 1
        async with self._scanning:  # one scan at a time: events, resyncs and prepare's mode switches all ask
            settings = self.lists.applied(self.settings)
            inventory = await asyncio.to_thread(self._scan, settings, changed)
            if self.settings.taint_unhealthy and self.health is None:  # no unhealthy device published untainted
                from agent.health.monitor import first_round
                self._first_round = await asyncio.to_thread(first_round, self.settings, inventory)
            await self.host_nics.scanned(inventory)
            if self.health is not None:
                self.health.on_inventory(inventory)
                if self.settings.taint_unhealthy:  # a device new to the node: published with its first verdict
                    await loops.new_devices_checked(self.health, inventory)
        self.inventory, self._listed = inventory, settings.list_attributes  # the old one goes here
        if changed is None and self.pool is not None:  # (the first scan's is trimmed after the first publish)
            heap.trim()  # a full scan's garbage would otherwise stay in the RSS for good
        self.board.set_inventory(inventory, *self.health_states())
        return self._republish(changed_at)

    def _rescan_soon(self) -> None:
        task = asyncio.get_running_loop().create_task(self.rescan())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _nvml_up(self) -> None:
        """The health monitor opened the NVML the scans have not: they read the GPUs again with it."""
        if self._scanner is not None and self._scanner.nvml is None:
            self._rescan_soon()

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

    def _follow_health(self) -> None:
        """Subscribed before the monitor's first round: its verdicts reach status, metrics and taints at once."""
        self._health_task = asyncio.get_running_loop().create_task(loops.follow_health(self, self.health.subscribe()),
                                                                   name="health-follow")

    async def _first_publish(self, wait: float = 1.0) -> None:
        """Let the first slices go out before what starts after them (a fixture root's file watch;
        publishing to a directory, the kubelet side). A store that does not
        answer within ``wait`` seconds (API server down) does not hold it up. Then the garbage
        of building and writing the pool goes back to the OS."""
        with contextlib.suppress(asyncio.TimeoutError):
            await self.publisher.wait_synced(timeout=wait)
        heap.trim()

    def _watch_slices(self, tasks: list[asyncio.Task]) -> None:
        """Someone else's change to our slices in the API (the kubelet's wipe) asks for a sync."""
        if self.settings.cluster_dir is None and hasattr(self.store, "watch"):
            tasks.append(asyncio.get_running_loop().create_task(watch_api(self.store, self.publisher), name="slice-watch"))

    async def _watch_slice_dir(self, started: contextlib.AsyncExitStack) -> None:
        """The offline dir's file events (someone deleting or editing our files), armed in a worker
        thread after the first publish (arming blocks), then a sync covers what changed before."""
        if self.settings.cluster_dir is not None and hasattr(self.store, "directory"):
            observe = functools.partial(start_file_observer, loop=asyncio.get_running_loop())
            started.callback((await asyncio.to_thread(watch_dir, self.store.directory, self.publisher, observe)).stop)
            self.publisher.request_sync()

    # --- kubelet plugin hook -------------------------------------------------------------
    async def start_kubelet_plugin(self) -> None:
        """Serve the kubelet (issue 4) next to publishing, when that component is present."""
        from agent.service import kubeletside  # gRPC, the driver, health: not before they are needed

        await kubeletside.start(self)

    def _on_registration(self, status) -> None:
        self._registration_answered.set()
        if status.registered:
            self.board.set_registration("registered")
        else:
            log.error("kubelet REJECTED the plugin registration: %s", status.error or "no reason given")
            self.board.set_registration("failed", status.error or "registration rejected")

    def health_states(self) -> tuple[dict[str, str], dict[str, tuple[str, str]]] | tuple[None, None]:
        """(device name -> healthy/unhealthy/unknown, unhealthy device -> (reason, message)): the
        monitor's, else the first round's (the status then agrees with the taints first published)."""
        if self.health is not None:
            snapshot = self.health.snapshot()
        elif self._first_round is not None:
            snapshot = self._first_round[1]
        else:
            return None, None
        return ({name: state.lower() for name, (state, _msg, _reason) in snapshot.items()},
                {name: (reason, msg) for name, (state, msg, reason) in snapshot.items() if state == "UNHEALTHY"})

    def _node_operations(self, configured: dict) -> dict:
        """``configured`` skip_node_operations, or the applied ones while prepared claims forbid the change.
        Blocking (it records the rule with fsync, and may read the checkpoint): call it in a worker thread."""
        from agent.service import nodeops

        driver = getattr(self.kubelet_plugin, "driver", None)
        return nodeops.settle(configured, self.settings.plugin_dir, live=getattr(driver, "checkpoint", None),
                              applied=self.settings.skip_node_operations if self.kubelet_plugin else None)

    # --- SIGHUP ----------------------------------------------------------------------------
    def reload(self, new: Settings, node_operations: dict | None = None) -> None:
        """Apply the settings that can change live; say which ones need a restart. ``node_operations``:
        ``_node_operations(new.skip_node_operations)`` as a worker thread settled it (SIGHUP's handler);
        None: settled here, blocking."""
        reloading.apply(self, new, node_operations)

    # --- main loop -----------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> int:
        """Serve until ``stop``. A stop during start-up abandons the start at once; whatever
        was started is stopped in reverse order either way."""
        async with contextlib.AsyncExitStack() as started:
            started.callback(log.info, "stopped")
            await self._serve(stop, started)
        return 0

    async def _serve(self, stop: asyncio.Event, started: contextlib.AsyncExitStack) -> None:
        """Start in the order of docs/architecture.md ("Start-up order"), then serve until ``stop``;
        a step that ``stop`` abandons ends the start there."""
        await self._serve_endpoints(started)
        if self._client is not None:
            started.push_async_callback(self._client.close)
        # the rule last applied and the checkpoint read, the rule recorded (fsync): a worker thread's
        ops = await asyncio.to_thread(self._node_operations, self.settings.skip_node_operations)
        if ops != self.settings.skip_node_operations:
            self.settings = self.settings.replace(skip_node_operations=ops)
        # No change between the first scan and the watchers is lost (docs/architecture.md, "Start-up
        # order"): sources that arm at once (uevents, slice watches) are armed before the scan and
        # their hardware events wait in the held debouncer until it is done; a fixture tree's file
        # watch (it walks every directory) is armed after the first publish, then one full rescan
        # covers what changed before it.
        tasks: list[asyncio.Task] = []
        started.push_async_callback(startup.cancel_all, tasks)
        self._watch_slices(tasks)
        if not await self._arm_watchers(stop, started) or not await self._first_scan(stop):
            return
        # Slices in the API reach the scheduler at once, and a pod allocated from them before the
        # kubelet registered the driver fails prepare ("not registered"): there the kubelet side
        # starts first and the first publish waits for the registration. A directory has no reader.
        kubelet_first = self.settings.cluster_dir is None
        if kubelet_first and not await self._kubelet_registered(stop, started):
            return
        if not await self._publish(stop, tasks):
            return
        await self._watch_slice_dir(started)
        if not await self._arm_file_watch(stop):
            return
        if not kubelet_first and not await self._start_kubelet_side(stop, started):
            return
        self._running(started, tasks)
        await stop.wait()
        log.info("stopping")
        sdnotify.stopping("stopping")

    async def _serve_endpoints(self, started: contextlib.AsyncExitStack) -> None:
        """The status socket and the metrics endpoint; one that cannot be served is a warning."""
        status_path = status_socket_path(self.settings)
        status_server = StatusServer(self.board, status_path)
        try:
            make_dirs(os.path.dirname(status_path), 0o750)
            await status_server.start()
            started.push_async_callback(status_server.close)
        except OSError as err:
            log.warning("status socket not served (%s): `sysdra status` will not reach this agent", err)
        if self.settings.metrics_address and not isinstance(self.metrics, NullMetrics):
            from agent.service.metrics import start_server

            try:
                metrics_server = start_server(self.settings.metrics_address, self.metrics)
                started.callback(metrics_server.close)
            except (OSError, ValueError) as err:
                log.warning("metrics endpoint %s not served: %s", self.settings.metrics_address, err)

    async def _arm_watchers(self, stop: asyncio.Event, started: contextlib.AsyncExitStack) -> bool:
        """The held debouncer, the hardware watcher (uevents armed now, a file watch later), the
        default routes and the host's NICs; False if ``stop`` came first."""
        debouncer = self.debouncer = Debouncer(self.settings.debounce, lambda first, changed: self.rescan(first, changed),
                                               with_changes=True, held=True)
        started.callback(debouncer.cancel)
        watcher = self.watcher = HardwareWatcher(self.settings.root, debouncer, on_event=self.metrics.count_watcher_event)
        started.callback(watcher.stop)
        if (routes := await follow_default_routes(self.settings, watcher.uevents, lambda: debouncer.trigger(None))) is not None:
            started.callback(routes.stop)  # armed at once, like the uevents: before the first scan
        started.callback(self.host_nics.stop)  # (also what a SIGHUP that turns taint_unhealthy on arms)
        if self.settings.taint_unhealthy:
            await self.host_nics.follow(watcher.uevents)
        return not watcher.arms_at_once or await startup.unless_stopped(stop, watcher.start(), cancel=False)

    async def _first_scan(self, stop: asyncio.Event) -> bool:
        """The first full scan, then the events held meanwhile; False if ``stop`` came first."""
        if not await startup.unless_stopped(stop, self.rescan()):
            return False
        self.debouncer.release()  # what changed since the watchers were armed is re-read now
        return True

    async def _kubelet_registered(self, stop: asyncio.Event, started: contextlib.AsyncExitStack) -> bool:
        """The kubelet side started and its registration answered (or waited for in vain); False if stopped."""
        if not await self._start_kubelet_side(stop, started):
            return False
        return self.kubelet_plugin is None or await startup.unless_stopped(  # (some tests run none)
            stop, startup.until_registered(self._registration_answered))

    async def _publish(self, stop: asyncio.Event, tasks: list[asyncio.Task]) -> bool:
        """The publisher and the periodic rescan running, the first publish let out; False if stopped."""
        loop = asyncio.get_running_loop()
        tasks += [loop.create_task(self.publisher.run(), name="publisher"),
                  loop.create_task(loops.periodic_rescan(self), name="resync"),
                  loop.create_task(miglayouts.follow(self), name="mig-layouts")]
        return await startup.unless_stopped(stop, self._first_publish())

    async def _arm_file_watch(self, stop: asyncio.Event) -> bool:
        """A fixture root's file watch (in a worker thread), then a full rescan for what changed
        between the first scan and the watch; False if ``stop`` came first."""
        if self.watcher.arms_at_once:
            return True
        if not await startup.unless_stopped(stop, self.watcher.start(), cancel=False):
            return False
        self.debouncer.trigger()
        return True

    def _running(self, started: contextlib.AsyncExitStack, tasks: list[asyncio.Task]) -> None:
        """READY, then what runs beside serving: STATUS= updates, the NRI plugin, the watchdog."""
        # sockets served and state reconciled: ready (publishing may still wait for the API server)
        sdnotify.ready(self.board.summary())
        from agent.nri.start import follow_pod_sandboxes  # pydantic and protobuf: after the first publish
        loop = asyncio.get_running_loop()
        tasks += [loop.create_task(self._report_status(), name="sd-status"),
                  *follow_pod_sandboxes(self.settings, self.kubelet_plugin, board=self.board)]
        watchdog = sdnotify.start_watchdog(loop)
        if watchdog is not None:
            started.callback(watchdog.cancel)
        log.info("sysdra running: node %s, driver %s, cluster %s", self.settings.node_name, self.settings.driver_name, self.settings.cluster)

    async def _start_kubelet_side(self, stop: asyncio.Event, started: contextlib.AsyncExitStack) -> bool:
        started.push_async_callback(self._stop_kubelet_side)
        # not cancelled midway: a grpc.aio server cancelled in its start() breaks in its shutdown
        return await startup.unless_stopped(stop, self.start_kubelet_plugin(), cancel=False)

    async def _stop_kubelet_side(self) -> None:
        if self.health is not None:
            with contextlib.suppress(Exception):
                await self.health.stop()
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # the plugin is stopped whatever it died of
                await self._health_task
        if self.kubelet_plugin is not None:
            with contextlib.suppress(Exception):
                await self.kubelet_plugin.stop()

    async def _report_status(self) -> None:
        """STATUS= for `systemctl status`: one line, refreshed while running under systemd."""
        while sdnotify.enabled():
            await asyncio.sleep(5)
            sdnotify.status(self.board.summary())


async def serve(settings: Settings, reload_settings: Callable[[], Settings] | None = None) -> int:
    """Run until SIGTERM/SIGINT; on SIGHUP re-read flags, environment and config file."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    settings = startup.resolve(settings)  # directories resolved once, checked, used in that form
    # before any socket or file is touched: a second agent must not take over the first one's
    instance = InstanceLock(dra_socket_path(settings))
    try:
        instance.acquire()
    except InstanceLocked as err:
        raise StartupError(str(err), EX_TEMPFAIL) from None
    try:
        return await _serve_locked(settings, stop, reload_settings)
    finally:
        instance.release()


async def _serve_locked(settings: Settings, stop: asyncio.Event, reload_settings) -> int:
    loop = asyncio.get_running_loop()
    if settings.metrics_address:
        from agent.service.metrics import Metrics

        metrics = Metrics()
    else:  # no endpoint: nobody could read them, and prometheus_client is not even loaded
        metrics = NullMetrics()
    agent = Agent(settings, metrics=metrics)

    if reload_settings is not None:
        loop.add_signal_handler(signal.SIGHUP, reloading.sighup_handler(agent, reload_settings))
    return await agent.run(stop)
