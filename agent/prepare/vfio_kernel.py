"""The kernel's PCI driver interface under a host root: who drives a function, and the
writes that move it to another driver (docs/vfio.md).

Order the kernel requires (Documentation/driver-api/vfio.rst): set ``driver_override`` so
only the wanted driver may claim the function, unbind it from its driver, then ask that
driver to bind it. Every write is checked by reading the result back: a write the kernel
accepted is not yet a driver bound (probe can fail asynchronously), so each step waits for
its effect with a deadline. Reads go through discovery's bounded reader; writes never
create files (sysfs has them all; a missing one means the driver or kernel lacks it).

A write itself may not return: a driver's ``remove`` waits for the device's users (NVIDIA's
while anybody holds ``/dev/nvidia<minor>`` open), and the unbind write waits with it. So an
unbind first looks for the function's users (prepare/devusers.py) and refuses, naming them;
and every write runs in a thread of its own, waited for with the same deadline: one that
does not return raises ``KernelHung`` (the caller, holding the node's serialize lock, lets
go) and is remembered until it does, and every later write for that function is refused
meanwhile (``settled``) instead of racing it."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass

from agent.prepare import devusers
from discovery.devnodes import parse_dev
from discovery.sysfs import AttrError, HostFS
from discovery.vfio import is_vfio_driver

log = logging.getLogger(__name__)

VFIO_DRIVER = "vfio-pci"
_BDF = re.compile(r"[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_DRIVER = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class KernelError(Exception):
    """A kernel write failed or its effect did not appear in time; the message says which."""


class KernelHung(KernelError):
    """A write to the kernel did not return in time: the kernel is still at it (``bdf``)."""

    def __init__(self, bdf: str, msg: str):
        super().__init__(msg)
        self.bdf = bdf


@dataclass
class _InFlight:
    what: str
    since: float
    done: threading.Event


# this process's writes that did not return, by the function's sysfs path: their threads are
# still in the kernel, and the kernel may finish them at any moment
_IN_FLIGHT: dict[str, _InFlight] = {}
_IN_FLIGHT_LOCK = threading.Lock()


def _write_file(path: str, value: str, what: str, failed: list[KernelError], done: threading.Event) -> None:
    """In its own thread: one write, as sysfs takes it (one write() call)."""
    try:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC | os.O_NOCTTY)
        except OSError as err:
            failed.append(KernelError(f"{what}: cannot open {path}: {err.strerror or err}"))
            return
        try:
            os.write(fd, value.encode())
        except OSError as err:
            failed.append(KernelError(f"{what}: the kernel refused writing {value.strip()!r} to {path}: {err.strerror or err}"))
        finally:
            os.close(fd)
    finally:
        done.set()


class PciKernel:
    def __init__(self, root: str, wait: float = 10.0, poll: float = 0.005):
        self.fs = HostFS(root)
        self.wait, self.poll = wait, poll

    # --- reading ---------------------------------------------------------------------
    def dev(self, bdf: str) -> str:
        if not _BDF.fullmatch(bdf):
            raise KernelError(f"{bdf!r} is not a PCI address")
        return self.fs.path("sys/bus/pci/devices", bdf)

    def present(self, bdf: str) -> bool:
        """Whether the function is on the node: its sysfs directory goes with it (hot-unplug,
        ``remove``, its PF's ``sriov_numvfs`` set to 0)."""
        return os.path.isdir(self.dev(bdf))

    def driver(self, bdf: str) -> str | None:
        return self._link_name(os.path.join(self.dev(bdf), "driver"))

    @staticmethod
    def _link_name(link: str) -> str | None:
        try:  # one readlink: the kernel may remove the link at any moment (unbind in progress)
            return os.path.basename(os.readlink(link))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as err:
            raise KernelError(f"cannot read {link}: {err.strerror or err}") from None

    def override(self, bdf: str) -> str | None:
        try:
            value = self.fs.read_attr(os.path.join(self.dev(bdf), "driver_override"))
        except AttrError as err:
            if err.reason == "empty":
                return None
            raise KernelError(f"{bdf}: cannot read driver_override: {err.reason}") from None
        return None if value == "(null)" else value

    def group(self, bdf: str) -> int | None:
        name = self._link_name(os.path.join(self.dev(bdf), "iommu_group")) or ""
        return int(name) if name.isascii() and name.isdigit() else None

    def group_members(self, group: int) -> list[str]:
        try:
            return sorted(n for n in self.fs.listdir(self.fs.path(f"sys/kernel/iommu_groups/{group}/devices")) if _BDF.fullmatch(n))
        except AttrError:
            return []

    def class_code(self, bdf: str) -> int:
        try:
            return int(self.fs.read_attr(os.path.join(self.dev(bdf), "class")), 16)
        except (AttrError, ValueError):
            return 0

    def num_vfs(self, bdf: str) -> int:
        try:
            return int(self.fs.read_attr(os.path.join(self.dev(bdf), "sriov_numvfs")))
        except (AttrError, ValueError):
            return 0

    def group_node(self, group: int) -> str | None:
        for name in (str(group), f"noiommu-{group}"):
            path = self.fs.path("dev/vfio", name)
            if os.path.exists(path):
                return path
        return None

    def driver_loaded(self, driver: str) -> bool:
        return os.path.isdir(self.fs.path("sys/bus/pci/drivers", driver))

    # --- users and writes still in the kernel ---------------------------------------------
    def in_use(self, bdf: str, to_open: bool = False) -> str | None:
        """Why unbinding the function from its driver would wait (who holds its device files
        open), or None. On vfio-pci its VFIO group node counts: a VM has it open. ``to_open``: the
        function stays on vfio-pci for a VM, which could not open the group while they have it."""
        rdevs = devusers.function_nodes(self.fs, self.dev(bdf), bdf)
        if is_vfio_driver(self.driver(bdf)) and (group := self.group(bdf)) is not None:
            try:
                rdevs.add(os.makedev(*parse_dev(self.fs.read_attr(self.fs.path(f"sys/class/vfio/{group}/dev")))))
            except (AttrError, ValueError, OverflowError):
                pass  # no group node (or none the kernel could have written): nobody can have it open
        scan = devusers.holders(self.fs.root, rdevs)
        if scan.unreadable or scan.incomplete:
            log.warning("%s: who holds its device files open is partly unknown: %d processes' files unreadable "
                        "(no CAP_SYS_PTRACE?)%s", bdf, scan.unreadable, f"; {scan.incomplete}" if scan.incomplete else "")
        if not scan.holders:
            return None
        if to_open:
            return (f"{bdf} is in use on the host: {devusers.describe(scan.holders)}; a VM given it could not open its "
                    "IOMMU group until they close it (it opens once)")
        return (f"{bdf} is in use on the host: {devusers.describe(scan.holders)}; its driver would not let go of it "
                f"until they close it{devusers.advice(scan.holders)}")

    def in_flight(self, bdf: str) -> str | None:
        """This process's earlier write for the function that has not returned yet, or None."""
        key = self.dev(bdf)
        with _IN_FLIGHT_LOCK:
            w = _IN_FLIGHT.get(key)
            if w is not None and w.done.is_set():
                del _IN_FLIGHT[key]
                return None
        return None if w is None else f"{w.what}: written {time.monotonic() - w.since:.0f}s ago, the kernel has not finished it"

    def writers(self, bdf: str, drivers: list[str | None]) -> list[devusers.Holder]:
        """Processes (another instance of the agent) with the ``unbind``/``bind`` of one of
        ``drivers`` or the function's ``driver_override`` open: a write in the kernel is held
        open by its writer until it returns, so none means none is in flight."""
        files = set()
        paths = [self.fs.path("sys/bus/pci/drivers", d, name) for d in drivers if d for name in ("unbind", "bind")]
        for path in paths + [os.path.join(self.dev(bdf), "driver_override")]:
            try:
                st = os.stat(path)
                files.add((st.st_dev, st.st_ino))
            except OSError:
                pass
        return devusers.holders(self.fs.root, files=files).holders

    def settled(self, bdf: str) -> None:
        """Raises KernelError while a write of this process for the function is in the kernel."""
        if (why := self.in_flight(bdf)) is not None:
            raise KernelError(why)

    # --- writing -----------------------------------------------------------------------
    def _write(self, bdf: str, path: str, value: str, what: str) -> None:
        self.settled(bdf)
        failed: list[KernelError] = []
        done = threading.Event()
        threading.Thread(target=_write_file, args=(path, value, what, failed, done), name=f"sysfs-write {bdf}",
                         daemon=True).start()
        if not done.wait(self.wait):  # the thread stays in the kernel; the caller lets go of the lock
            with _IN_FLIGHT_LOCK:
                _IN_FLIGHT[self.dev(bdf)] = _InFlight(what, time.monotonic() - self.wait, done)
            raise KernelHung(bdf, f"{what}: the kernel has not finished the write after {self.wait:.0f}s")
        if failed:
            raise failed[0]

    def _until(self, done, what: str) -> None:
        deadline = time.monotonic() + self.wait
        while not done():
            if time.monotonic() > deadline:
                raise KernelError(f"{what}: no effect after {self.wait:.0f}s")
            time.sleep(self.poll)

    def set_override(self, bdf: str, driver: str | None) -> None:
        if driver is not None and not _DRIVER.fullmatch(driver):
            raise KernelError(f"{bdf}: {driver!r} is not a driver name")
        self._write(bdf, os.path.join(self.dev(bdf), "driver_override"), (driver or "") + "\n", f"{bdf}: driver_override")
        self._until(lambda: self.override(bdf) == driver, f"{bdf}: driver_override")

    def unbind(self, bdf: str) -> None:
        current = self.driver(bdf)
        if current is None:
            return
        if (why := self.in_use(bdf)) is not None:  # the write would wait for them, holding the node's lock
            raise KernelError(why)
        try:
            self._write(bdf, self.fs.path("sys/bus/pci/drivers", current, "unbind"), bdf, f"{bdf}: unbind from {current}")
        except KernelHung:
            raise KernelHung(bdf, f"{bdf}: the kernel has not finished unbinding it from {current} after {self.wait:.0f}s "
                                  "(its driver waits until nobody holds the device open)") from None
        self._until(lambda: self.driver(bdf) is None, f"{bdf}: unbind from {current}")

    def bind(self, bdf: str, driver: str) -> None:
        if not _DRIVER.fullmatch(driver):
            raise KernelError(f"{bdf}: {driver!r} is not a driver name")
        if not self.driver_loaded(driver):
            raise KernelError(f"{bdf}: driver {driver} is not loaded (modprobe {driver})")
        self._write(bdf, self.fs.path("sys/bus/pci/drivers", driver, "bind"), bdf, f"{bdf}: bind to {driver}")
        self._until(lambda: self.driver(bdf) == driver, f"{bdf}: bind to {driver}")

    def probe(self, bdf: str) -> str | None:
        """The function given to whichever driver the kernel matches for it (``drivers_probe``, as at
        hot-plug: its ID tables, dynamic IDs, ``driver_override``) -> that driver, None when none did."""
        self._write(bdf, self.fs.path("sys/bus/pci/drivers_probe"), bdf, f"{bdf}: drivers_probe")
        try:
            self._until(lambda: self.driver(bdf) is not None, f"{bdf}: drivers_probe")
        except KernelError:
            return None  # no driver matched (or its module is not loaded): left without one
        return self.driver(bdf)

    def wait_group_node(self, bdf: str, group: int) -> str:
        self._until(lambda: self.group_node(group) is not None, f"{bdf}: /dev/vfio/{group}")
        return self.group_node(group) or ""
