"""A simulated PCI driver core for a copied fixture tree: it reacts to writes into
``driver_override``, ``drivers/<d>/unbind``, ``drivers/<d>/bind`` and ``drivers_probe`` as
the kernel does, so the agent's VFIO transaction runs against something that behaves.

Why a stand-in: binding real functions needs real hardware and an IOMMU; this machine has
neither. The behaviour follows drivers/base/bus.c and drivers/pci/pci-driver.c:
- ``driver_override`` holds a driver name ("(null)" when unset); while set, only that driver
  may bind the function;
- unbind removes the ``driver`` link (and the ``DRIVER=`` line of the function's uevent,
  which the kernel prints from the same ``dev->driver``) and the driver's view of the function (its net/,
  infiniband/, drm/ directories vanish; they come back when the original driver binds it);
- vfio-pci creates ``/dev/vfio/<group>`` (a real character node with /dev/null's numbers
  when ``real_nodes``, so podman can inject it) and ``sys/class/vfio/<group>``;
- failures to inject: a file ``<root>/.simkernel/fail-bind-<driver>`` makes binds to that
  driver have no effect (probe failed), as in the NVIDIA driver issue where unbind worked
  and the bind to vfio-pci did not;
- a write that does not return (``hang``): the control file becomes a FIFO whose pipe is full,
  so a writer blocks in ``write()`` with the file open, as it does in a driver's ``remove``
  that waits for the device's users (NVIDIA's, issue #1076 of its DRA driver); ``release``
  drains it: the blocked write lands and is handled like any other.

It polls (a few ms) instead of using inotify so it also sees writes made while it was
stopped (it processes them when started again, like a kernel that was never down)."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import stat
import threading
import time

SYS_PCI = "sys/bus/pci"



def set_uevent_driver(dev_dir: str, driver: str | None) -> None:
    """The function's ``uevent`` as the kernel prints it with ``driver`` bound (None: none):
    ``DRIVER=`` first, the rest unchanged."""
    path = os.path.join(dev_dir, "uevent")
    lines = [ln for ln in open(path).read().splitlines() if not ln.startswith("DRIVER=")] if os.path.exists(path) else []
    with open(path, "w") as f:
        f.write("\n".join(([f"DRIVER={driver}"] if driver else []) + lines) + "\n")

# vfio-pci and variant drivers of it (drivers/vfio/pci/*): each makes the function a VFIO device,
# its group node /dev/vfio/<group>, as vfio-pci does
VFIO_DRIVERS = frozenset({"vfio-pci", "mlx5_vfio_pci", "nvgrace-gpu-vfio-pci", "hisi_acc_vfio_pci", "pds_vfio_pci",
                          "virtio_vfio_pci", "qat_vfio_pci", "xe-vfio-pci"})

_ADDRESS = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


class SimPciKernel:
    def __init__(self, root: str, real_nodes: bool = False, vfio_loaded: bool = True, poll: float = 0.002):
        self.root = root
        self.real_nodes = real_nodes
        self.poll = poll
        self.state = os.path.join(root, ".simkernel")
        os.makedirs(os.path.join(self.state, "stash"), exist_ok=True)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.log: list[str] = []
        # a group node's minor (default: the group's number); the kernel allocates it when the group is
        # made (vfio_group_alloc: the lowest free one), so a group made again may get another
        self.minors: dict[str, int] = {}
        self._fifos: dict[str, tuple[int, bool]] = {}  # control file -> (the FIFO's fd, held full)
        # the loop's drain and a test's hang or release, one at a time: a drain that read "not held"
        # must not empty the FIFO after hang() filled it (a writer's write would then not block)
        self._fifo_lock = threading.Lock()
        drivers = self.p(SYS_PCI, "drivers")
        if vfio_loaded:
            os.makedirs(os.path.join(drivers, "vfio-pci"), exist_ok=True)
        for d in os.listdir(drivers):
            for name in ("bind", "unbind"):
                self._touch(os.path.join(drivers, d, name))
        self._touch(self.p(SYS_PCI, "drivers_probe"))
        for bdf in os.listdir(self.p(SYS_PCI, "devices")):
            path = os.path.join(self.p(SYS_PCI, "devices", bdf), "driver_override")
            if not os.path.exists(path):
                with open(path, "w") as f:
                    f.write("(null)\n")

    def p(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    @staticmethod
    def _touch(path: str) -> None:
        if not os.path.exists(path):
            open(path, "w").close()

    def fail_binds(self, driver: str, on: bool = True) -> None:
        flag = os.path.join(self.state, f"fail-bind-{driver}")
        if on:
            open(flag, "w").close()
        elif os.path.exists(flag):
            os.unlink(flag)

    def hang(self, driver: str, op: str = "unbind") -> None:
        """Writes to ``drivers/<driver>/<op>`` block from now on (until ``release``)."""
        path = self.p(SYS_PCI, "drivers", driver, op)
        with self._fifo_lock:
            self._hang(path)

    def _hang(self, path: str) -> None:
        if path not in self._fifos:
            # made aside and known to the loop before it takes the control file's name: the loop
            # must never read it as a plain file (a read of a FIFO waits for a writer's end)
            tmp = path + ".fifo"
            os.mkfifo(tmp, 0o600)
            fd = os.open(tmp, os.O_RDWR | os.O_NONBLOCK)  # both ends: a writer's open does not block
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 4096)
            self._fifos[path] = (fd, False)
            os.rename(tmp, path)
        fd, _ = self._fifos[path]
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except BlockingIOError:  # full: a writer's write() waits for room
            pass
        self._fifos[path] = (fd, True)

    def release(self, driver: str, op: str = "unbind") -> None:
        """Writes to it return again; a blocked one lands and is handled."""
        path = self.p(SYS_PCI, "drivers", driver, op)
        with self._fifo_lock:
            fd, _ = self._fifos[path]
            self._fifos[path] = (fd, False)

    def _drain(self, path: str) -> str:
        """What was written to a FIFO control file (its filler left out); empty while held full."""
        with self._fifo_lock:
            fd, full = self._fifos[path]
            if full:
                return ""
            data = b""
            try:
                while chunk := os.read(fd, 65536):
                    data += chunk
            except OSError as err:
                if err.errno != errno.EAGAIN:
                    raise
        return data.replace(b"\0", b"").decode().strip()

    # --- the driver core --------------------------------------------------------------
    def dev(self, bdf: str) -> str:
        return self.p(SYS_PCI, "devices", bdf)

    def driver(self, bdf: str) -> str | None:
        try:  # (the loop may unbind it between a look and the read: no driver then)
            return os.path.basename(os.readlink(os.path.join(self.dev(bdf), "driver")))
        except (FileNotFoundError, OSError):
            return None

    def override(self, bdf: str) -> str | None:
        with open(os.path.join(self.dev(bdf), "driver_override")) as f:
            value = f.read().strip()
        return None if value in ("", "(null)") else value

    def group(self, bdf: str) -> str | None:
        link = os.path.join(self.dev(bdf), "iommu_group")
        return os.path.basename(os.readlink(link)) if os.path.islink(link) else None

    def unbind(self, driver: str, bdf: str) -> None:
        if self.driver(bdf) != driver:
            return  # -ENODEV: the function is not bound to this driver
        set_uevent_driver(self.dev(bdf), None)
        link = self.p(SYS_PCI, "drivers", driver, bdf)
        if os.path.islink(link):
            os.unlink(link)
        real = os.path.realpath(self.dev(bdf))
        stash = os.path.join(self.state, "stash", bdf)
        if driver in VFIO_DRIVERS:
            g = self.group(bdf)
            for path in (self.p("dev/vfio", g), self.p("sys/class/vfio", g)):
                if os.path.lexists(path):
                    os.unlink(path)
            shutil.rmtree(self.p("sys/devices/virtual/vfio", g), ignore_errors=True)
        else:
            os.makedirs(stash, exist_ok=True)
            with open(os.path.join(stash, "driver"), "w") as f:
                f.write(driver)
            for view in ("net", "infiniband", "infiniband_verbs", "drm"):
                if os.path.isdir(os.path.join(real, view)):
                    os.rename(os.path.join(real, view), os.path.join(stash, view))
        self.log.append(f"unbind {bdf} {driver}")
        os.unlink(os.path.join(real, "driver"))  # last: what the agent reads back to see it done

    def bind(self, driver: str, bdf: str) -> None:
        override = self.override(bdf)
        if self.driver(bdf) is not None or (override is not None and override != driver):
            return  # -EBUSY / the override forbids it
        if os.path.exists(os.path.join(self.state, f"fail-bind-{driver}")):
            self.log.append(f"bind {bdf} {driver} FAILED")
            return
        if driver in VFIO_DRIVERS and self.group(bdf) is None:
            return  # vfio-pci refuses a function without an IOMMU group
        drvdir = self.p(SYS_PCI, "drivers", driver)
        real = os.path.realpath(self.dev(bdf))
        set_uevent_driver(real, driver)
        os.symlink(os.path.relpath(real, drvdir), os.path.join(drvdir, bdf))
        if driver in VFIO_DRIVERS:
            self._vfio_nodes(self.group(bdf))
        else:
            stash = os.path.join(self.state, "stash", bdf)
            for view in ("net", "infiniband", "infiniband_verbs", "drm"):
                if os.path.isdir(os.path.join(stash, view)):
                    os.rename(os.path.join(stash, view), os.path.join(real, view))
        self.log.append(f"bind {bdf} {driver}")
        # last: the link is what the agent reads back, so everything else is in place by then
        os.symlink(os.path.relpath(drvdir, real), os.path.join(real, "driver"))

    def probe(self, bdf: str) -> None:
        if self.driver(bdf) is not None:
            return
        native = os.path.join(self.state, "stash", bdf, "driver")
        driver = self.override(bdf) or (open(native).read().strip() if os.path.exists(native) else None)
        if driver:
            self.bind(driver, bdf)

    def _vfio_nodes(self, group: str) -> None:
        major, minor = (1, 3) if self.real_nodes else (241, self.minors.get(group, int(group)))
        d = self.p("sys/devices/virtual/vfio", group)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "dev"), "w") as f:
            f.write(f"{major}:{minor}\n")
        os.makedirs(self.p("sys/class/vfio"), exist_ok=True)
        if not os.path.lexists(self.p("sys/class/vfio", group)):
            os.symlink(os.path.relpath(d, self.p("sys/class/vfio")), self.p("sys/class/vfio", group))
        os.makedirs(self.p("dev/vfio"), exist_ok=True)
        for node, numbers in ((group, (major, minor)), ("vfio", (1, 3) if self.real_nodes else (10, 196))):
            path = self.p("dev/vfio", node)
            if self.real_nodes and not (os.path.exists(path) and stat.S_ISCHR(os.stat(path).st_mode)):
                if os.path.lexists(path):
                    os.unlink(path)  # the fixture's placeholder file
                os.mknod(path, 0o666 | 0o020000, os.makedev(*numbers))
            elif not os.path.exists(path):
                open(path, "w").close()
        if self.real_nodes:
            misc = self.p("sys/devices/virtual/misc/vfio")
            os.makedirs(misc, exist_ok=True)
            with open(os.path.join(misc, "dev"), "w") as f:
                f.write("1:3\n")

    # --- the loop -----------------------------------------------------------------------
    def step(self) -> None:
        """Handle every pending write once."""
        drivers = self.p(SYS_PCI, "drivers")
        for d in sorted(os.listdir(drivers)):
            for op in ("unbind", "bind"):
                path = os.path.join(drivers, d, op)
                value = self._drain(path) if path in self._fifos else _take(path)
                # a FIFO may hold several writes, run together where one had no newline (the agent's
                # has none); the kernel takes each write() alone, so each address is one
                for one in _ADDRESS.findall(value) if path in self._fifos else value.split():
                    (self.unbind if op == "unbind" else self.bind)(d, one)
        value = _take(self.p(SYS_PCI, "drivers_probe"))
        if value:
            self.probe(value)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.step()
            time.sleep(self.poll)

    def start(self) -> "SimPciKernel":
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="simkernel", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Stopped, and every hung write released (its writer's thread ends) and the FIFOs closed."""
        for path, (fd, _) in list(self._fifos.items()):
            self._fifos[path] = (fd, False)
            self._drain(path)
        self.stop()
        for fd, _ in self._fifos.values():
            os.close(fd)
        self._fifos.clear()


def _take(path: str) -> str:
    """The value written to a control file, which is then emptied (a write is one event). A FIFO
    (a hang() that took the name after the loop looked) is not a plain file: nothing here."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    except FileNotFoundError:
        return ""
    with os.fdopen(fd, "r+") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        value = f.read().strip()
        if value:
            f.seek(0)
            f.truncate()
        return value
