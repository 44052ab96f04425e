"""Who holds a PCI function's device files open (docs/vfio.md, "In use on the host").

A driver's ``remove`` waits for its users: NVIDIA's blocks while anybody (nvidia-persistenced,
DCGM, a container, a host process) has ``/dev/nvidia<minor>`` open, DRM waits for its card and
render nodes, vfio-pci for its VFIO user. An unbind written then does not return, so VFIO
passthrough looks first and refuses the claim, naming the processes.

A function's device files are found by number, not by name: every ``dev`` file of the class
devices below its sysfs directory (``drm/card0``, ``accel/accel0``, ``infiniband_verbs/uverbs0``,
``i2c-3/i2c-dev/i2c-3``, an FPGA's ``fpga_region/region0/dfl-port.0``), the NVIDIA minor the
driver reports in procfs (``/dev/nvidia<minor>`` has no sysfs class device), and an AMD GPU's
partitions' render nodes (below ``amdgpu_xcp_<N>`` platform devices, discovery/partitions.py). Holders are found
by walking ``/proc/<pid>/fd`` of the root's procfs (the host's, under ``--root=/host``) and
comparing each open file's ``st_rdev``: a node's path in a container or a renamed node cannot
hide it. Nodes shared by every device of a driver (``/dev/nvidiactl``, ``/dev/vfio/vfio``) are
not the function's and not looked for. procfs changes while it is read (processes end, fds
close): what vanishes is skipped; the work is capped (processes, fds, time)."""

from __future__ import annotations

import logging
import os
import re
import stat
import time
from dataclasses import dataclass, field

from agent.fsutil import read_bounded
from discovery.devnodes import NodeResolver, parse_dev
from discovery.gpu import NVIDIA_MAJOR, NVIDIACTL_MINOR, parse_nvidia_information
from discovery.partitions import amd_render_nodes
from discovery.sysfs import AttrError, HostFS

log = logging.getLogger(__name__)

MAX_DIRS = 256  # class directories looked into below one function
DEPTH = 3  # fpga_region/region0/dfl-port.0/dev is the deepest a discovery reader knows
MAX_PIDS = 65536
MAX_FDS = 500_000  # open files stat()ed in one scan, all processes together
BUDGET = 5.0  # seconds for one scan; beyond it the scan says it is incomplete
SHOWN = 3  # holders named in a message
_SKIP = frozenset({"power", "msi_irqs", "driver", "subsystem", "firmware_node", "iommu_group", "physfn"})
_BDF = re.compile(r"[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
PERSISTENCED = "nvidia-persiste"  # nvidia-persistenced as /proc/<pid>/comm has it (15 characters)


def function_nodes(fs: HostFS, dev_dir: str, bdf: str) -> set[int]:
    """``st_rdev`` of the character devices that are the function's own (``dev_dir``: its sysfs
    directory), as the kernel shows them now. None found: nothing of it can be open."""
    found: set[int] = set()
    todo, seen = [(dev_dir, 0)], 0
    while todo and seen < MAX_DIRS:
        path, depth = todo.pop()
        seen += 1
        try:
            names = fs.subdirs(path) if depth < DEPTH else []
        except AttrError:  # gone meanwhile (the driver unbound it): nothing of it to hold
            continue
        for name in names:
            if name in _SKIP or name.startswith("virtfn") or _BDF.fullmatch(name):  # a bridge's functions are theirs
                continue
            sub = f"{path}/{name}"
            try:
                found.add(os.makedev(*parse_dev(fs.read_attr(f"{sub}/dev"))))
            except (AttrError, ValueError, OverflowError):  # no node of its own (net/eth0, hwmon), or a bad one
                pass
            todo.append((sub, depth + 1))
    if (minor := _nvidia_minor(fs, bdf)) is not None:
        found.add(os.makedev(_nvidia_major(fs), minor))
    return found | _partition_nodes(fs, dev_dir, bdf)


def _partition_nodes(fs: HostFS, dev_dir: str, bdf: str) -> set[int]:
    """An AMD GPU's partitions' render nodes: partitions 1..N's class devices are below
    ``amdgpu_xcp_<N>`` platform devices, not below the function, and unbinding amdgpu waits for
    their users too. Found as discovery finds them (KFD's ``drm_render_minor``)."""
    try:
        fn_dir = fs.follow(dev_dir)
    except AttrError:  # gone meanwhile
        return set()
    nodes = amd_render_nodes(fs, NodeResolver(fs), bdf, fn_dir, [])  # a node it cannot resolve: nothing to look for
    return {os.makedev(n.major, n.minor) for n in nodes}


def _nvidia_minor(fs: HostFS, bdf: str) -> int | None:
    try:
        text = fs.read_text(fs.path("proc/driver/nvidia/gpus", bdf, "information"), limit=16384)
    except AttrError:  # not a GPU the NVIDIA driver has
        return None
    minor = parse_nvidia_information(text).get("Device Minor", "")
    return int(minor) if minor.isascii() and minor.isdigit() and int(minor) < NVIDIACTL_MINOR else None


def _nvidia_major(fs: HostFS) -> int:
    majors = NodeResolver(fs).char_majors
    return majors.get("nvidia-frontend") or majors.get("nvidia") or NVIDIA_MAJOR


@dataclass(frozen=True)
class Holder:
    pid: int
    comm: str
    path: str  # what it opened, as its fd's link names it (/dev/nvidia0)


@dataclass
class Scan:
    holders: list[Holder] = field(default_factory=list)
    unreadable: int = 0  # processes whose fds could not be read (no CAP_SYS_PTRACE for them)
    incomplete: str = ""  # why the scan stopped early, or ""


def holders(root: str, rdevs: set[int] = frozenset(), files: set[tuple[int, int]] = frozenset()) -> Scan:
    """The processes of ``root``'s procfs holding open a character device numbered in ``rdevs``,
    or one of ``files`` (``(st_dev, st_ino)``); one entry per process and file."""
    scan = Scan()
    if not rdevs and not files:
        return scan
    proc = os.path.join(root, "proc")
    try:
        # in order (the message names the first); str.isdigit() alone takes "²", which int() does not
        pids = sorted(int(n) for n in os.listdir(proc) if n.isascii() and n.isdigit())[:MAX_PIDS]
    except OSError as err:
        scan.incomplete = f"cannot list {proc}: {err.strerror or err}"
        return scan
    deadline, budget = time.monotonic() + BUDGET, MAX_FDS
    for pid in pids:
        if budget <= 0 or time.monotonic() > deadline:
            scan.incomplete = f"stopped after {MAX_FDS - budget} open files (at most {MAX_FDS}, {BUDGET:g} s)"
            break
        budget -= _scan_pid(os.path.join(proc, str(pid)), pid, rdevs, files, scan, budget)
    return scan


def _scan_pid(base: str, pid: int, rdevs, files, scan: Scan, budget: int) -> int:
    """One process's open files into ``scan`` -> how many were looked at."""
    fd_dir = os.path.join(base, "fd")
    try:
        fds = os.listdir(fd_dir)[:budget]
    except FileNotFoundError:  # it ended meanwhile
        return 0
    except OSError:  # EACCES: another user's, and no CAP_SYS_PTRACE
        scan.unreadable += 1
        return 0
    seen: set[str] = set()
    for fd in fds:
        link = os.path.join(fd_dir, fd)
        try:
            st = os.stat(link)  # follows the magic link to the open file itself
        except OSError:  # closed meanwhile
            continue
        if (stat.S_ISCHR(st.st_mode) and st.st_rdev in rdevs) or (st.st_dev, st.st_ino) in files:
            try:
                path = os.readlink(link)
            except OSError:
                continue
            if path not in seen:
                seen.add(path)
                scan.holders.append(Holder(pid, _comm(base), _printable(path, 200)))
    return len(fds)


def _comm(base: str) -> str:
    try:
        raw = read_bounded(os.path.join(base, "comm"), 64)  # (a FIFO under a fixture root: refused, not waited on)
    except OSError:
        return "?"
    return _printable(raw.decode("utf-8", "replace").strip(), 16) or "?"


def _printable(text: str, limit: int) -> str:
    """Another process's name or file name, safe to put in a message."""
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


def describe(found: list[Holder]) -> str:
    """``/dev/nvidia0 is open by pid 812 (nvidia-persiste), pid 90 (python3) and 2 more``."""
    by_path: dict[str, list[Holder]] = {}
    for h in found:
        by_path.setdefault(h.path, []).append(h)
    parts = []
    for path, hs in by_path.items():
        names = ", ".join(f"pid {h.pid} ({h.comm})" for h in hs[:SHOWN])
        parts.append(f"{path} is open by {names}" + (f" and {len(hs) - SHOWN} more" if len(hs) > SHOWN else ""))
    return "; ".join(parts[:SHOWN]) + (f"; and {len(parts) - SHOWN} more files" if len(parts) > SHOWN else "")


def advice(found: list[Holder]) -> str:
    """What to do about a holder that is no workload ("" for none)."""
    if any(h.comm == PERSISTENCED for h in found):
        return (". nvidia-persistenced keeps the GPU open: the persistence daemon must release it first "
                "(stop it, or restart it without this GPU); `nvidia-smi -i <id> -pm 0` is the GPU's persistence-mode setting")
    return ""
