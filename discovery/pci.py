"""PCI functions from ``/sys/bus/pci/devices`` (one record per function).

Required files: ``vendor``, ``device``, ``class`` — without them a function cannot be
identified and goes to ``skipped``. Everything else is optional and costs only itself.
"""

from __future__ import annotations

import re
from functools import lru_cache

from discovery.models import PciFunction, PciLink, Problem, Sriov
from discovery.sysfs import AttrError, HostFS

PCI_DEVICES = "sys/bus/pci/devices"
# Domain may be 5+ hex digits (Intel VMD 10000:, Hyper-V); never fixed width.
BDF_RE = re.compile(r"^([0-9a-f]{4,}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$")
ROOT_BUS_RE = re.compile(r"^pci([0-9a-f]{4,}):([0-9a-f]{2})$")
_ID_RE = re.compile(r"^0x([0-9a-f]{4})$")
_VIRTFN_RE = re.compile(r"^virtfn(\d+)$")


class PciError(Exception):
    """The function cannot be identified (reason is shown under ``skipped``)."""


def parse_bdf(text: str) -> tuple[str, int, int, int]:
    """``"0000:1b:00.0"`` -> (domain hex string, bus, device, function)."""
    m = BDF_RE.match(text)
    if not m:
        raise ValueError(f"not a PCI address: {text!r}")
    return m.group(1), int(m.group(2), 16), int(m.group(3), 16), int(m.group(4))


def parse_id(text: str) -> str:
    """``"0x10DE"`` -> ``"10de"`` (4 lower-case hex digits)."""
    t = text.strip().lower()
    m = _ID_RE.match(t)
    if not m:
        raise ValueError(f"not a 16-bit PCI id: {text[:20]!r}")
    return m.group(1)


def split_sysfs_path(real: str) -> tuple[str | None, tuple[str, ...]]:
    """``/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0`` -> ("pci0000:00", bridges...).

    Returns the root complex and the BDF components above the function. Non-BDF
    components (``virtio1``, VMD's ``pci10000:00``) are not bridges; a nested
    ``pciDDDD:BB`` (VMD) is not a new root complex for ``pcieRoot`` either.
    """
    parts = real.split("/")
    if len(parts) < 4 or parts[1] != "sys" or parts[2] != "devices" or not ROOT_BUS_RE.match(parts[3]):
        return None, ()
    chain = [p for p in parts[4:] if BDF_RE.match(p)]
    return parts[3], tuple(chain[:-1])


def _read_id(fs: HostFS, path: str) -> str:
    try:
        return parse_id(fs.read_attr(path))
    except ValueError as err:
        raise AttrError(path, str(err)) from err


def _numa(fs: HostFS, path: str) -> int | None:
    n = fs.read_int(path)
    if n < 0:
        return None  # NUMA_NO_NODE: unknown, never publish it
    if n >= 1024:
        raise ValueError(f"numa_node {n} out of range")
    return n


def _vfs(fs: HostFS, d: str, names: frozenset[str]) -> tuple[str, ...]:
    indexed = []
    for name in names:
        m = _VIRTFN_RE.match(name)
        if m:
            try:
                target = fs.link_name(f"{d}/{name}")
            except AttrError:
                continue
            if BDF_RE.match(target):
                indexed.append((int(m.group(1)), target))
    return tuple(t for _, t in sorted(indexed))


@lru_cache(maxsize=256)
def _link(max_speed: str | None, max_width: int | None) -> PciLink:
    """Link records are shared: a node has a handful of distinct ones (frozen, like attribute values)."""
    return PciLink(max_speed=max_speed, max_width=max_width)


def read_function(fs: HostFS, bdf: str) -> tuple[PciFunction, list[Problem], frozenset[str] | None]:
    """Read one function: (record, problems, names in its directory, None if unlistable).
    Raises :class:`PciError` when it cannot be identified.

    The directory is listed once; optional attributes that the listing lacks are not
    looked for, and callers reuse the names (class views) instead of listing again."""
    link = fs.path(PCI_DEVICES, bdf)
    try:
        real_host = fs.follow(link)
    except AttrError as err:
        raise PciError(f"cannot resolve {link}: {err.reason}") from err
    if not fs.contains(real_host):
        raise PciError(f"link escapes the root: {link}")
    if not fs.is_dir(real_host):
        raise PciError("device directory missing or not a directory")
    real = fs.rel(real_host)
    d = real_host
    try:
        vendor = _read_id(fs, f"{d}/vendor")
        device = _read_id(fs, f"{d}/device")
        class_code = fs.read_hex(f"{d}/class")
    except AttrError as err:
        raise PciError(f"{err.path.rsplit('/', 1)[-1]}: {err.reason}") from err
    if not 0 <= class_code <= 0xFFFFFF:
        raise PciError(f"class: out of range {class_code:#x}")

    problems: list[Problem] = []
    pcie_root, bridges = split_sysfs_path(real)
    try:
        names: frozenset[str] | None = frozenset(fs.listdir(d))
    except AttrError:
        names = None

    def opt(what: str, read, *args):
        """One optional attribute (``what`` is its file name); a missing file is silent, other
        failures are recorded. Names the listing lacks are not looked for."""
        if names is not None and what not in names:
            return None
        try:
            return read(*args)
        except AttrError as err:
            if err.reason != "missing":
                problems.append(Problem(what=what, reason=err.reason))
        except ValueError as err:
            problems.append(Problem(what=what, reason=str(err)))
        return None

    sriov = None
    if names is not None and "sriov_totalvfs" in names:
        sriov = Sriov(
            total_vfs=opt("sriov_totalvfs", fs.read_int, f"{d}/sriov_totalvfs"),
            num_vfs=opt("sriov_numvfs", fs.read_int, f"{d}/sriov_numvfs"),
            vfs=_vfs(fs, d, names),
        )
    physfn = None
    if names is not None and "physfn" in names:
        physfn = opt("physfn", fs.link_name, f"{d}/physfn")
        if physfn is not None and not BDF_RE.match(physfn):
            problems.append(Problem(what="physfn", reason=f"odd target {physfn!r}"))
            physfn = None

    iommu = opt("iommu_group", fs.link_name, f"{d}/iommu_group")
    fn = PciFunction(
        bdf=bdf,
        sysfs_path=real,
        pcie_root=pcie_root,
        bridges=bridges,
        vendor_id=vendor,
        device_id=device,
        subsystem_vendor_id=opt("subsystem_vendor", _read_id, fs, f"{d}/subsystem_vendor"),
        subsystem_device_id=opt("subsystem_device", _read_id, fs, f"{d}/subsystem_device"),
        class_code=class_code,
        driver=opt("driver", fs.link_name, f"{d}/driver"),
        numa_node=opt("numa_node", _numa, fs, f"{d}/numa_node"),
        iommu_group=int(iommu) if iommu is not None and iommu.isdigit() else None,
        link=_link(opt("max_link_speed", fs.read_attr, f"{d}/max_link_speed"),
                   opt("max_link_width", fs.read_int, f"{d}/max_link_width")),
        sriov=sriov,
        physfn=physfn,
    )
    return fn, problems, names


def list_bdfs(fs: HostFS) -> list[str]:
    """Entries of /sys/bus/pci/devices that look like PCI addresses (sorted)."""
    return [n for n in fs.listdir(fs.path(PCI_DEVICES)) if BDF_RE.match(n)]


def host_dir(fs: HostFS, fn: PciFunction) -> str:
    """The function's real directory under the scan root."""
    return fs.path(fn.sysfs_path)
