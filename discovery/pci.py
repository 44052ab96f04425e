"""PCI functions from ``/sys/bus/pci/devices`` (one record per function).

Required values: vendor, device and class (from ``uevent``, else the ``vendor``, ``device``
and ``class`` files) — without them a function cannot be identified and goes to
``skipped``. Everything else is optional and costs only itself.
"""

from __future__ import annotations

import errno
import os
import re
from functools import lru_cache
from itertools import filterfalse

from discovery.models import PciFunction, PciLink, Problem, Sriov
from discovery.sysfs import AttrError, Dir, HostFS, os_reason

PCI_DEVICES = "sys/bus/pci/devices"
# Domain may be 5+ hex digits (Intel VMD 10000:, Hyper-V); never fixed width.
BDF_RE = re.compile(r"^([0-9a-f]{4,}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$")
ROOT_BUS_RE = re.compile(r"^pci([0-9a-f]{4,}):([0-9a-f]{2})$")
_ID_RE = re.compile(r"^0x([0-9a-f]{4})$")


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


def split_sysfs_path(real: str, address: str | None = None) -> tuple[str | None, tuple[str, ...]]:
    """``/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0`` -> ("pci0000:00", bridges...).

    Returns the root complex and the BDF components above the function. Non-BDF
    components (``virtio1``, VMD's ``pci10000:00``) are not bridges; a nested
    ``pciDDDD:BB`` (VMD) is not a new root complex for ``pcieRoot`` either. ``address``:
    the function's own PCI address, already checked; a last component equal to it needs
    no check again (the kernel's form, every function of a scan).
    """
    parent, _, last = real.rpartition("/")
    if last == address or BDF_RE.match(last):
        return _bridges_above(parent)
    parts = real.split("/")
    if len(parts) < 4 or parts[1] != "sys" or parts[2] != "devices" or not ROOT_BUS_RE.match(parts[3]):
        return None, ()
    chain = [p for p in parts[4:] if BDF_RE.match(p)]
    return parts[3], tuple(chain[:-1])


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"not an integer: {text[:40]!r}") from None


def _hex(text: str) -> int:
    try:
        return int(text, 16)  # "0x030200" or "030200"
    except ValueError:
        raise ValueError(f"not hex: {text[:40]!r}") from None


def _numa(text: str) -> int | None:
    n = _int(text)
    if n < 0:
        return None  # NUMA_NO_NODE: unknown, never publish it
    if n >= 1024:
        raise ValueError(f"numa_node {n} out of range")
    return n


@lru_cache(maxsize=256)
def _link(max_speed: str | None, max_width: int | None) -> PciLink:
    """Link records are shared: a node has a handful of distinct ones (frozen, like attribute values)."""
    return PciLink(max_speed=max_speed, max_width=max_width)


@lru_cache(maxsize=4096)
def _is_bdf(text: str) -> bool:
    """``BDF_RE`` remembered: the 64 VFs of a PF name the same PF in their ``physfn`` links."""
    return BDF_RE.match(text) is not None


@lru_cache(maxsize=4096)
def _bridges_above(parent: str) -> tuple[str | None, tuple[str, ...]]:
    """``split_sysfs_path`` of a function directly below ``parent``: the 64 VFs of a PF
    share one answer."""
    parts = parent.split("/")
    if len(parts) < 4 or parts[1] != "sys" or parts[2] != "devices" or not ROOT_BUS_RE.match(parts[3]):
        return None, ()
    return parts[3], tuple(p for p in parts[4:] if BDF_RE.match(p))


_UEVENT_IDS = re.compile(r"^([0-9A-Fa-f]{4}):([0-9A-Fa-f]{4})$")
_UEVENT_CLASS = re.compile(r"^[0-9A-Fa-f]{1,6}$")
_UEVENT_DRIVER = re.compile(r"^[^/\s]+$")


_H4 = "([0-9A-Fa-f]{4})"
# What the kernel prints for a PCI function (drivers/pci/pci-driver.c pci_uevent, after the
# driver core's DRIVER= line), each key once and in this order, up to the function's own
# PCI_SLOT_NAME and MODALIAS. That head is the same for every function of one model and
# driver (the 64 VFs of a PF): it is matched once per distinct text, not once per function.
_KERNEL_HEAD = re.compile(
    rf"(?:DRIVER=([^/\s]+)\n)?PCI_CLASS=([0-9A-Fa-f]{{1,6}})\nPCI_ID={_H4}:{_H4}\nPCI_SUBSYS_ID={_H4}:{_H4}"
)


@lru_cache(maxsize=1024)
def _kernel_head(head: str) -> dict | None:
    """The fields of a head in the kernel's form, None for any other text; remembered for the
    next function with the same head (callers copy the dict before they add to it)."""
    if (m := _KERNEL_HEAD.fullmatch(head)) is None:
        return None
    driver, pci_class, vendor, device, sub_vendor, sub_device = m.groups()
    return {"class": int(pci_class, 16), "vendor": vendor.lower(), "device": device.lower(),
            "subsystem_vendor": sub_vendor.lower(), "subsystem_device": sub_device.lower(), "driver": driver}  # fmt: skip


def parse_uevent(text: str) -> dict:
    """What a PCI function's ``uevent`` says of it: the kernel prints the same ``pci_dev``
    fields as the ``vendor``, ``device``, ``class`` and ``subsystem_*`` files, and the
    driver's name (no ``DRIVER=`` line: none bound). One file instead of five and a link.
    Only well-formed fields are returned, with the attribute files' names; ``driver`` only
    when the text is a PCI uevent (has ``PCI_ID``), else the caller asks the files.

    A text of the kernel's form is taken by its head (:data:`_KERNEL_HEAD`); its slot name
    and modalias then only need to be printable, which rules out every line break
    ``splitlines()`` knows, so the text says exactly what reading it line by line says."""
    head, _, tail = text.partition("\nPCI_SLOT_NAME=")
    slot, sep2, modalias = tail.partition("\nMODALIAS=")
    if sep2 and slot.isprintable() and modalias.isprintable():
        if (fields := _kernel_head(head)) is not None:
            return fields.copy()
    return uevent_lines(text)


def uevent_lines(text: str) -> dict:
    """:func:`parse_uevent` line by line, for any order, repeated keys and other lines."""
    out: dict = {}
    driver = None
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key == "PCI_ID" and (m := _UEVENT_IDS.match(value)):
            out["vendor"], out["device"] = m.group(1).lower(), m.group(2).lower()
        elif key == "PCI_SUBSYS_ID" and (m := _UEVENT_IDS.match(value)):
            out["subsystem_vendor"], out["subsystem_device"] = m.group(1).lower(), m.group(2).lower()
        elif key == "PCI_CLASS" and _UEVENT_CLASS.match(value):
            out["class"] = int(value, 16)
        elif key == "DRIVER" and _UEVENT_DRIVER.match(value):
            driver = value
    if "vendor" in out:
        out["driver"] = driver
    return out


# The files of a function's values (absent ones cost nothing); the first three identify it.
_PARSE = {"vendor": parse_id, "device": parse_id, "class": _hex, "subsystem_vendor": parse_id,
          "subsystem_device": parse_id, "numa_node": _numa, "max_link_speed": str,
          "max_link_width": _int, "sriov_totalvfs": _int, "sriov_numvfs": _int}  # fmt: skip
_IDS = ("vendor", "device", "class", "subsystem_vendor", "subsystem_device")  # also in uevent
_ID_SET = frozenset(_IDS)
# read in one pass: uevent (which names the ids and the driver) and the files it does not cover
_FIRST_PASS = ("uevent",) + tuple(n for n in _PARSE if n not in _ID_SET)
# The links read, in this order: [unlistable][driver named by uevent] (physfn only when the
# listing shows it: an unlistable function is not taken for a VF).
_LINKS = ((("physfn", "iommu_group", "driver"), ("physfn", "iommu_group")), (("iommu_group", "driver"), ("iommu_group",)))


@lru_cache(maxsize=64)
def _dirs(fs: HostFS) -> tuple[str, str]:
    """(the bus's devices directory, the ``sys`` directory and a slash) under ``fs``'s root:
    joined once per root, not twice per function."""
    return fs.path(PCI_DEVICES), fs.path("sys") + "/"


def _real_dir(fs: HostFS, link: str, sys_dir: str) -> tuple[str, str]:
    """The function's directory behind its bus link: (host path, path as on the node).
    The kernel's link is ``../../../devices/...``, resolved by string below ``sys_dir``; any
    other target lexically, and it must stay under the root."""
    try:
        target = os.readlink(link)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOENT):  # EINVAL: no link, the entry itself
            raise PciError(f"cannot resolve {link}: {os_reason(err)}") from err
        target = None
    if target is not None and target.startswith("../../../devices/"):
        rest = target[9:].rstrip("/")
        if "/." not in rest and "//" not in rest:
            return sys_dir + rest, "/sys/" + rest
    real_host = link if target is None else os.path.normpath(os.path.join(os.path.dirname(link), target))
    if not fs.contains(real_host):
        raise PciError(f"link escapes the root: {link}")
    return real_host, fs.rel(real_host)


def read_function(fs: HostFS, bdf: str) -> tuple[PciFunction, list[Problem], Dir]:
    """Read one function (``bdf``: a PCI address as :func:`list_bdfs` lists them): (record,
    problems, its directory listed once; ``names`` None if unlistable). Raises
    :class:`PciError` when it cannot be identified.

    Optional attributes that the listing lacks are not looked for, and callers reuse the
    listing (class views) instead of listing again."""
    bus_dir, sys_dir = _dirs(fs)
    real_host, real = _real_dir(fs, f"{bus_dir}/{bdf}", sys_dir)
    try:  # held open while the function is read: its files are looked up by one name each
        dir_fd = fs.open_dir(real_host)
    except AttrError as err:
        if err.reason != "permission denied":  # missing, a symlink (ELOOP) or not a directory
            raise PciError("device directory missing or not a directory") from None
        dir_fd = None  # cannot be listed: its files are read by path
    try:
        return _read_listed(fs, bdf, real_host, real, dir_fd)
    finally:
        if dir_fd is not None:
            os.close(dir_fd)


def _read_listed(fs: HostFS, bdf: str, real_host: str, real: str, dir_fd: int | None):
    """:func:`read_function` with the function's directory open (``dir_fd``) or unlistable (None)."""
    try:
        d = fs.list_dir(real_host, dir_fd) if dir_fd is not None else Dir(real_host)
    except AttrError:
        d = Dir(real_host)
    problems: list[Problem] = []
    failed: dict[str, AttrError] = {}  # by name; the optional ones are the record's problems
    read = fs.attrs(d, _FIRST_PASS, failed, dir_fd)
    text = read.pop("uevent", None)
    values = parse_uevent(text) if text is not None else {}
    if failed:
        failed.pop("uevent", None)  # the id files say it then
    if not values.keys() >= _ID_SET:  # no uevent, unreadable or not a PCI one: the id files say it
        read.update(fs.attrs(d, list(filterfalse(values.__contains__, _IDS)), failed, dir_fd))  # no comprehension: it made ``values`` a cell
    for name, text in read.items():
        try:
            values[name] = _PARSE[name](text)
        except ValueError as err:
            failed[name] = AttrError(f"{real_host}/{name}", str(err))
    for name in ("vendor", "device", "class"):
        if name not in values:
            raise PciError(f"{name}: {failed[name].reason if name in failed else 'missing'}")
    class_code = values["class"]
    if not 0 <= class_code <= 0xFFFFFF:
        raise PciError(f"class: out of range {class_code:#x}")
    if failed:  # an optional value is None then; one that is there but unreadable is a problem
        problems += [Problem(what=n, reason=e.reason) for n, e in failed.items() if e.reason != "missing"]

    sriov = None
    if d.names is not None and "sriov_totalvfs" in d.names:
        # the VFs themselves are not read from the PF's virtfnN links: each VF's physfn link
        # says the same (2,048 readlinks of the large node's scan; nothing asked the list)
        sriov = Sriov(total_vfs=values.get("sriov_totalvfs"), num_vfs=values.get("sriov_numvfs"))
    # physfn only where the listing shows it; driver only where uevent did not name it
    bad_links: dict[str, AttrError] = {}
    links = fs.link_names(d, _LINKS[d.names is None]["driver" in values], bad_links, dir_fd)
    physfn = links.get("physfn")
    if physfn is not None and not _is_bdf(physfn):
        problems.append(Problem(what="physfn", reason=f"odd target {physfn!r}"))
        physfn = None
    if bad_links:
        problems += [Problem(what=n, reason=e.reason) for n, e in bad_links.items()]
    iommu = links.get("iommu_group")
    driver = values["driver"] if "driver" in values else links.get("driver")
    pcie_root, bridges = split_sysfs_path(real, bdf)
    fn = PciFunction(
        bdf=bdf,
        sysfs_path=real,
        pcie_root=pcie_root,
        bridges=bridges,
        vendor_id=values["vendor"],
        device_id=values["device"],
        subsystem_vendor_id=values.get("subsystem_vendor"),
        subsystem_device_id=values.get("subsystem_device"),
        class_code=class_code,
        driver=driver,
        numa_node=values.get("numa_node"),
        iommu_group=int(iommu) if iommu is not None and iommu.isdigit() else None,
        link=_link(values.get("max_link_speed"), values.get("max_link_width")),
        sriov=sriov,
        physfn=physfn,
    )
    return fn, problems, d


def list_bdfs(fs: HostFS) -> list[str]:
    """Entries of /sys/bus/pci/devices that look like PCI addresses (sorted)."""
    return [n for n in fs.listdir(fs.path(PCI_DEVICES)) if BDF_RE.match(n)]


def host_dir(fs: HostFS, fn: PciFunction) -> str:
    """The function's real directory under the scan root."""
    return fs.path(fn.sysfs_path)
