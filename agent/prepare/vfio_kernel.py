"""The kernel's PCI driver interface under a host root: who drives a function, and the
writes that move it to another driver (docs/vfio.md).

Order the kernel requires (Documentation/driver-api/vfio.rst): set ``driver_override`` so
only the wanted driver may claim the function, unbind it from its driver, then ask that
driver to bind it. Every write is checked by reading the result back: a write the kernel
accepted is not yet a driver bound (probe can fail asynchronously), so each step waits for
its effect with a deadline. Reads go through discovery's bounded reader; writes never
create files (sysfs has them all; a missing one means the driver or kernel lacks it)."""

from __future__ import annotations

import os
import re
import time

from discovery.sysfs import AttrError, HostFS

VFIO_DRIVER = "vfio-pci"
_BDF = re.compile(r"[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_DRIVER = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class KernelError(Exception):
    """A kernel write failed or its effect did not appear in time; the message says which."""


class PciKernel:
    def __init__(self, root: str, wait: float = 10.0, poll: float = 0.005):
        self.fs = HostFS(root)
        self.wait, self.poll = wait, poll

    # --- reading ---------------------------------------------------------------------
    def dev(self, bdf: str) -> str:
        if not _BDF.fullmatch(bdf):
            raise KernelError(f"{bdf!r} is not a PCI address")
        return self.fs.path("sys/bus/pci/devices", bdf)

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
        return int(name) if name.isdigit() else None

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

    # --- writing -----------------------------------------------------------------------
    def _write(self, path: str, value: str, what: str) -> None:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC | os.O_NOCTTY)
        except OSError as err:
            raise KernelError(f"{what}: cannot open {path}: {err.strerror or err}") from None
        try:
            os.write(fd, value.encode())
        except OSError as err:
            raise KernelError(f"{what}: the kernel refused writing {value.strip()!r} to {path}: {err.strerror or err}") from None
        finally:
            os.close(fd)

    def _until(self, done, what: str) -> None:
        deadline = time.monotonic() + self.wait
        while not done():
            if time.monotonic() > deadline:
                raise KernelError(f"{what}: no effect after {self.wait:.0f}s")
            time.sleep(self.poll)

    def set_override(self, bdf: str, driver: str | None) -> None:
        if driver is not None and not _DRIVER.fullmatch(driver):
            raise KernelError(f"{bdf}: {driver!r} is not a driver name")
        self._write(os.path.join(self.dev(bdf), "driver_override"), (driver or "") + "\n", f"{bdf}: driver_override")
        self._until(lambda: self.override(bdf) == driver, f"{bdf}: driver_override")

    def unbind(self, bdf: str) -> None:
        current = self.driver(bdf)
        if current is None:
            return
        self._write(self.fs.path("sys/bus/pci/drivers", current, "unbind"), bdf, f"{bdf}: unbind from {current}")
        self._until(lambda: self.driver(bdf) is None, f"{bdf}: unbind from {current}")

    def bind(self, bdf: str, driver: str) -> None:
        if not _DRIVER.fullmatch(driver):
            raise KernelError(f"{bdf}: {driver!r} is not a driver name")
        if not self.driver_loaded(driver):
            raise KernelError(f"{bdf}: driver {driver} is not loaded (modprobe {driver})")
        self._write(self.fs.path("sys/bus/pci/drivers", driver, "bind"), bdf, f"{bdf}: bind to {driver}")
        self._until(lambda: self.driver(bdf) == driver, f"{bdf}: bind to {driver}")

    def wait_group_node(self, bdf: str, group: int) -> str:
        self._until(lambda: self.group_node(group) is not None, f"{bdf}: /dev/vfio/{group}")
        return self.group_node(group) or ""
