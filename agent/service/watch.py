"""Hardware change triggers. Events never carry data we use: they only schedule a rescan.

- real root (``/``): pyudev netlink monitor on the subsystems we publish (udev source
  when udevd runs, else raw kernel uevents); inotify cannot see sysfs changes;
- fixture root: inotify file events below ROOT/sys (tests, demos; ``agent/service/inotify.py``);
- both: a periodic full rescan as a safety net (netlink drops events under bursts).

Events name the PCI function they are about (uevent DEVPATH, file path -> deepest PCI
address), so the rescan re-reads only those (``discovery.inventory.IncrementalScanner``);
an event naming none (NUMA, /sys/class, dropped uevents) asks for a full rescan.

``Debouncer`` turns a burst into one rescan: the first event arms a timer of ``debounce``
seconds, later events within the window ride along, so latency stays <= debounce + scan.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Callable

from discovery.inventory import bdf_of_path

log = logging.getLogger("sysdra.watch")

SUBSYSTEMS = ("pci", "net", "infiniband", "infiniband_verbs", "drm", "accel", "vfio",
              "fpga_region", "fpga_manager", "fpga_bridge", "dfl")


class Debouncer:
    """Calls ``action(first_event_time)`` once per burst; never runs two actions at once.

    With ``with_changes=True`` it calls ``action(first_event_time, changed)``: the PCI
    functions the burst's events named (``trigger(bdf)``), or None when any event named
    none (``trigger()``): then the action must look at everything."""

    def __init__(self, delay: float, action: Callable[..., "asyncio.Future | None"], with_changes: bool = False):
        self.delay = delay
        self.action = action
        self.with_changes = with_changes
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
        if self._task is None or self._task.done():
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


def start_file_observer(paths: list[str], callback: Callable[[str], None], recursive: bool = True):
    """File events: ``callback(path)`` on the running loop for every change below ``paths``
    (``agent.service.inotify.TreeWatch``; ``.stop()`` ends it). Call on the event loop."""
    from agent.service.inotify import TreeWatch

    return TreeWatch(paths, callback, recursive=recursive)


def _device_bdf(device) -> str | None:
    """PCI function of a uevent (DEVPATH); None for ENOBUFS (``device is None``) and others."""
    if device is None:
        return None
    try:
        return bdf_of_path(device.device_path)
    except Exception:  # noqa: BLE001 - a strange event only costs a full rescan
        return None


class HardwareWatcher:
    """Starts the right event source for ``root`` and feeds the debouncer."""

    def __init__(self, root: str, debouncer: Debouncer, on_event: Callable[[str], None] | None = None):
        self.root = root
        self.debouncer = debouncer
        self.on_event = on_event  # metrics: called with the source ("udev", "kernel", "file") per event
        self._udev: UdevSource | None = None
        self._observer = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if os.path.abspath(self.root) == "/":
            try:
                udev = UdevSource(lambda device: self._event(udev.source, _device_bdf(device)))
                udev.start(loop)
            except Exception as err:  # noqa: BLE001 - no libudev / AF_NETLINK: periodic rescans still work
                log.warning("no uevent monitor (%s): relying on periodic rescans", err)
                return
            self._udev = udev  # only a started source: reports() tells health what events cover
            log.info("watching %s uevents for %s", udev.source, ", ".join(SUBSYSTEMS))
        else:
            sys_dir = os.path.join(self.root, "sys")
            root = os.path.abspath(self.root)
            self._observer = start_file_observer([sys_dir], lambda p: self._event("file", bdf_of_path(os.path.relpath(p, root))))
            log.info("watching file events below %s (%d directories)", sys_dir, self._observer.watched)

    def reports(self) -> tuple[bool, bool]:
        """(functions, links): whether this watcher's events report PCI functions added,
        removed, bound and unbound, and NIC link changes (for the health monitor, which then
        need not poll them). uevents carry no link state (rtnetlink does: health's own
        LinkWatch); file events below a fixture root's sys/ see every write there."""
        files = self._observer is not None and self._observer.complete
        return (self._udev is not None or files), files

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
