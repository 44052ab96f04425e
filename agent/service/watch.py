"""Hardware change triggers. Events never carry data we use: they only schedule a rescan.

- a root whose ``sys`` is the kernel's sysfs (``/``, or the DaemonSet's ``/host`` with the
  host's ``/sys`` mounted there): pyudev netlink monitor on the subsystems we publish (udev
  source when udevd runs and this process sees it, else raw kernel uevents, which reach every
  network namespace of the initial user namespace, a pod's too); inotify cannot see sysfs changes;
  software devices below /devices/virtual/ (a veth at every pod start) are ignored, vfio's kept;
- a fixture root (a tree of files): file events below the parts of ROOT/sys discovery reads
  (tests, demos), from the ``watchdog`` package's inotify observer (``FileWatch``);
- both: a periodic full rescan as a safety net (netlink drops events under bursts).

Events name the PCI function they are about (uevent DEVPATH, file path -> deepest PCI
address), so the rescan re-reads only those (``discovery.inventory.IncrementalScanner``);
an event naming none (NUMA, /sys/class, dropped uevents) asks for a full rescan.

``Debouncer`` turns a burst into one rescan: the first event arms a timer of ``debounce``
seconds, later events within the window ride along, so latency stays <= debounce + scan.
A debouncer made ``held`` keeps what it is told until ``release``: the daemon arms its event
sources before its first scan and applies what they saw meanwhile once that scan is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Callable

from discovery.inventory import bdf_of_path
from discovery.sysfs import is_sysfs

log = logging.getLogger("sysdra.watch")

SUBSYSTEMS = ("pci", "net", "infiniband", "infiniband_verbs", "drm", "accel", "vfio",
              "fpga_region", "fpga_manager", "fpga_bridge", "dfl")
# Below a fixture root's sys/, what discovery reads (tests/test_watch.py holds it to a traced scan
# of every fixture). The rest changes nothing discovery sees: sys/kernel's iommu_groups, 40 % of
# the benchmark node's 10,551 directories, cost ~2.6 MB of inotify watches in watchdog's tables.
READ_BELOW_SYS = ("bus", "class", "devices", "module")


class Debouncer:
    """Calls ``action(first_event_time)`` once per burst; never runs two actions at once.

    With ``with_changes=True`` it calls ``action(first_event_time, changed)``: the PCI
    functions the burst's events named (``trigger(bdf)``), or None when any event named
    none (``trigger()``): then the action must look at everything."""

    def __init__(self, delay: float, action: Callable[..., "asyncio.Future | None"], with_changes: bool = False,
                 held: bool = False):
        self.delay = delay
        self.action = action
        self.with_changes = with_changes
        self.held = held  # events are kept, and acted on only after release()
        self.events = 0
        self.runs = 0
        self._first: float | None = None
        self._changed: set[str] | None = set()
        self._task: asyncio.Task | None = None

    def trigger(self, bdf: str | None = None) -> None:
        self.events += 1
        if self._first is None:
            self._first = time.monotonic()
        if bdf is None:
            self._changed = None
        elif self._changed is not None:
            self._changed.add(bdf)
        self._schedule()

    def release(self) -> None:
        """Act on the events kept while held (at once if their window has passed), and on
        every later one."""
        self.held = False
        if self._first is not None:
            self._schedule()

    def _schedule(self) -> None:
        if not self.held and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self._first is not None:
            await asyncio.sleep(max(0.0, self._first + self.delay - time.monotonic()))
            first, self._first = self._first, None
            changed, self._changed = self._changed, set()
            self.runs += 1
            try:
                result = self.action(first, changed) if self.with_changes else self.action(first)
                if asyncio.iscoroutine(result):
                    await result
            except Exception:  # noqa: BLE001 - a failed rescan must not stop later ones
                log.exception("rescan after hardware change failed")

    def cancel(self) -> None:
        if self._task:
            self._task.cancel()


def udev_source() -> str:
    # udevd re-broadcasts processed events (device nodes exist by then); without it only the kernel's arrive
    return "udev" if os.path.exists("/run/udev/control") else "kernel"


class UdevSource:
    """pyudev netlink monitor wired into the event loop with ``add_reader``."""

    def __init__(self, callback: Callable[[object], None], subsystems=SUBSYSTEMS, source: str | None = None):
        import pyudev

        self.source = source or udev_source()
        self.monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source=self.source)
        for subsystem in subsystems:
            self.monitor.filter_by(subsystem)
        self.callback = callback
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.monitor.start()
        self._loop = loop
        loop.add_reader(self.monitor.fileno(), self._drain)

    def _drain(self) -> None:
        while True:
            try:
                device = self.monitor.poll(timeout=0)
            except OSError as err:  # ENOBUFS: the kernel dropped events; a rescan covers them
                log.warning("uevent monitor: %s; rescanning", err)
                self.callback(None)
                return
            if device is None:
                return
            log.debug("uevent %s %s (%s)", device.action, device.device_path, device.subsystem)
            self.callback(device)

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.monitor.fileno())
            self._loop = None


# Only changes: subscribing to opens and reads would make every rescan flood the inotify queue.
# Parent directories' "modified" events are left out: the entry's own event names the function.
_CHANGES = ("FileCreatedEvent", "FileDeletedEvent", "FileModifiedEvent", "FileMovedEvent", "FileClosedEvent",
            "FileAttribEvent", "DirCreatedEvent", "DirDeletedEvent", "DirMovedEvent", "DirAttribEvent", "EventsLostEvent")


class FileWatch:
    """File events below ``paths`` (each directory below them too when ``recursive``; symlinks
    not followed), from the ``watchdog`` package's inotify observer: ``callback(path)`` runs on
    ``loop`` for every change, the moved entry's old and new path for a move, the watched root
    itself when the kernel's queue overflowed (events were lost: look at everything).

    Arming walks the tree (one to a few seconds of a core on the 10,000-directory benchmark
    node), so the daemon makes one in a worker thread. ``complete`` is False when a tree could not be watched (the user's
    inotify watch limit): its changes are then seen only by the periodic rescan."""

    def __init__(self, paths: list[str], callback: Callable[[str], None], recursive: bool = True,
                 loop: asyncio.AbstractEventLoop | None = None):
        from watchdog import events
        from watchdog.observers import Observer

        self._loop = loop or asyncio.get_running_loop()
        self._callback = callback
        self.complete = True
        handler = events.FileSystemEventHandler()
        handler.on_any_event = self._deliver
        self._observer = Observer()
        self._observer.daemon = True
        self._observer.start()
        changes = [getattr(events, name) for name in _CHANGES]
        for path in paths:
            if not os.path.isdir(path):
                continue
            try:
                self._observer.schedule(handler, path, recursive=recursive, event_filter=changes)
            except OSError as err:
                self.complete = False
                log.warning("cannot watch %s: %s; changes there are seen by the periodic rescan", path, err)

    def _deliver(self, event) -> None:  # the observer's thread
        for path in (event.src_path, getattr(event, "dest_path", "")):
            if path:
                with contextlib.suppress(RuntimeError):  # the loop closed under a late event
                    self._loop.call_soon_threadsafe(self._callback, os.fsdecode(path))

    def stop(self) -> None:
        self._observer.stop()
        self._observer.join(timeout=5)


def start_file_observer(paths: list[str], callback: Callable[[str], None], recursive: bool = True,
                        loop: asyncio.AbstractEventLoop | None = None) -> FileWatch:
    """File events: ``callback(path)`` on ``loop`` (the running one by default) for every
    change below ``paths``; ``.stop()`` ends them. Blocks while it arms (see ``FileWatch``)."""
    return FileWatch(paths, callback, recursive=recursive, loop=loop)


def _device_bdf(device) -> str | None:
    """PCI function of a uevent (DEVPATH); None for ENOBUFS (``device is None``) and others."""
    if device is None:
        return None
    try:
        return bdf_of_path(device.device_path)
    except Exception:  # noqa: BLE001 - a strange event only costs a full rescan
        return None


# Software devices below /devices/virtual/ that discovery reads: the vfio group nodes of functions
# on vfio-pci. Others there (veths, bridges, bonds at every pod start) never change the inventory,
# which is PCI functions; the uplink they may carry is followed by default routes (routewatch).
_VIRTUAL_KEPT = frozenset({"vfio"})


def _inventory_event(device) -> bool:
    """Whether a uevent can change the inventory (``device`` None: events were lost, yes)."""
    if device is None:
        return True
    path = getattr(device, "device_path", "") or ""
    return not path.startswith("/devices/virtual/") or getattr(device, "subsystem", None) in _VIRTUAL_KEPT


class HardwareWatcher:
    """Starts the right event source for ``root`` and feeds the debouncer."""

    def __init__(self, root: str, debouncer: Debouncer, on_event: Callable[[str], None] | None = None):
        self.root = root
        self.debouncer = debouncer
        self.on_event = on_event  # metrics: called with the source ("udev", "kernel", "file") per event
        self._udev: UdevSource | None = None
        self._observer = None
        self.uevents = is_sysfs(os.path.join(root, "sys"))  # else file events below root/sys

    @property
    def arms_at_once(self) -> bool:
        """Whether ``start`` is instant (a netlink socket), or walks a tree (a fixture root's
        file watch: seconds on a 10,000-directory node, in a worker thread)."""
        return self.uevents

    async def start(self) -> None:
        """Arm the event source; from now on every change reaches the debouncer."""
        loop = asyncio.get_running_loop()
        if self.arms_at_once:
            try:
                udev = UdevSource(lambda device: self._uevent(udev.source, device))
                udev.start(loop)
            except Exception as err:  # noqa: BLE001 - no libudev / AF_NETLINK: periodic rescans still work
                log.warning("no uevent monitor (%s): relying on periodic rescans", err)
                return
            self._udev = udev  # only a started source: reports() tells health what events cover
            log.info("watching %s uevents for %s", udev.source, ", ".join(SUBSYSTEMS))
        else:
            sys_dir = os.path.join(self.root, "sys")
            root = os.path.abspath(self.root)
            self._observer = await asyncio.to_thread(
                start_file_observer, [os.path.join(sys_dir, part) for part in READ_BELOW_SYS],
                lambda p: self._event("file", bdf_of_path(os.path.relpath(p, root))), loop=loop)
            log.info("watching file events below %s/{%s}", sys_dir, ",".join(READ_BELOW_SYS))

    def reports(self) -> tuple[bool, bool]:
        """(functions, links): whether this watcher's events report PCI functions added,
        removed, bound and unbound, and NIC link changes (for the health monitor, which then
        need not poll them). uevents carry no link state (rtnetlink does: health's own
        LinkWatch); file events below a fixture root's sys/ see every write there."""
        files = self._observer is not None and self._observer.complete
        return (self._udev is not None or files), files

    def _uevent(self, source: str, device) -> None:
        if _inventory_event(device):
            self._event(source, _device_bdf(device))

    def _event(self, source: str, bdf: str | None = None) -> None:
        """``bdf``: the PCI function the event is about (an incremental rescan re-reads it
        alone); None when the event names none: a full rescan."""
        if self.on_event is not None:
            self.on_event(source)
        self.debouncer.trigger(bdf)

    def stop(self) -> None:
        if self._udev:
            self._udev.stop()
        if self._observer:
            self._observer.stop()
