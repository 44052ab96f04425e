"""PCI functions from ``/sys/bus/pci/devices`` (one record per function).

Required values: vendor, device and class (from ``uevent``, else the ``vendor``, ``device``
and ``class`` files) — without them a function cannot be identified and goes to
``skipped``. Everything else is optional and costs only itself.
"""

from __future__ import annotations

import re

from discovery.models import PciFunction, PciLink, Problem, Sriov
from discovery.sysfs import AttrError, Dir, HostFS

PCI_DEVICES = "sys/bus/pci/devices"
# Domain may be 5+ hex digits (Intel VMD 10000:, Hyper-V); never fixed width.
BDF_RE = re.compile(r"^([0-9a-f]{4,}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$")
ROOT_BUS_RE = re.compile(r"^pci([0-9a-f]{4,}):([0-9a-f]{2})$")
_ID_RE = re.compile(r"^0x([0-9a-f]{4})$")


class PciError(Exception):
    """The function cannot be identified (reason is shown under ``skipped``)."""


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


def pcie_switch(fn: PciFunction) -> str | None:
    """The upstream port of the topmost PCIe switch above ``fn``, None where the function sits
    on its root port (or a bridge without a switch below it). In the function's own PCI domain
    the bridges run root port, upstream port, downstream port, ... (a VMD controller, the
    bridge above a VMD domain, belongs to another domain). Two devices with the same switch
    reach each other without the root complex: the pairing GPUDirect RDMA wants."""
    domain = fn.bdf.rsplit(":", 2)[0]
    own = [b for b in fn.bridges if b.rsplit(":", 2)[0] == domain]
    return own[1] if len(own) >= 3 else None


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


_UEVENT_IDS = re.compile(r"^([0-9A-Fa-f]{4}):([0-9A-Fa-f]{4})$")
_UEVENT_CLASS = re.compile(r"^[0-9A-Fa-f]{1,6}$")
_UEVENT_DRIVER = re.compile(r"^[^/\s]+$")


def parse_uevent(text: str) -> dict:
    """What a PCI function's ``uevent`` says of it: the kernel prints the same ``pci_dev``
    fields as the ``vendor``, ``device``, ``class`` and ``subsystem_*`` files, and the
    driver's name (no ``DRIVER=`` line: none bound), so one file is read instead of five and
    a link. Only well-formed fields are returned, with the attribute files' names; ``driver``
    only when the text is a PCI uevent (has ``PCI_ID``), else the caller asks the files."""
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


# How each value file is parsed; absent ones cost nothing. The ids are also in ``uevent``.
_PARSE = {"vendor": parse_id, "device": parse_id, "class": _hex, "subsystem_vendor": parse_id,
          "subsystem_device": parse_id, "numa_node": _numa, "max_link_speed": str,
          "max_link_width": _int, "sriov_totalvfs": _int, "sriov_numvfs": _int}  # fmt: skip
_IDS = ("vendor", "device", "class", "subsystem_vendor", "subsystem_device")
_ID_SET = frozenset(_IDS)
_FILES = ("uevent", *(n for n in _PARSE if n not in _IDS))  # read first: the ids only when uevent lacks them


def _real_dir(fs: HostFS, link: str) -> tuple[str, str]:
    """The function's directory behind its bus link: (host path, path as on the node); it
    must stay under the root."""
    try:
        real_host = fs.follow(link)
    except AttrError as err:
        raise PciError(f"cannot resolve {link}: {err.reason}") from None
    if (real := fs.node_path(real_host)) is None:
        raise PciError(f"link escapes the root: {link}")
    return real_host, real


def read_function(fs: HostFS, bdf: str) -> tuple[PciFunction, list[Problem], Dir]:
    """Read one function (``bdf``: a PCI address as :func:`list_bdfs` lists them): (record,
    problems, its directory listed once; ``names`` None if unlistable). Raises
    :class:`PciError` when it cannot be identified.

    Optional attributes that the listing lacks are not looked for, and callers reuse the
    listing (class views) instead of listing again."""
    real_host, real = _real_dir(fs, fs.path(f"{PCI_DEVICES}/{bdf}"))
    d = _list_function(fs, real_host)
    values, failed = _read_values(fs, d, real_host)
    _check_identity(values, failed)
    # an optional value that is absent is None; one that is there but unreadable is a problem
    problems = [Problem(what=n, reason=e.reason) for n, e in failed.items()]
    links, physfn = _links(fs, d, values, problems)
    return _record(bdf, real, d, values, links, physfn), problems, d


def _list_function(fs: HostFS, real_host: str) -> Dir:
    """The function's directory listed; one that cannot be (permission denied) has its files read by path."""
    try:
        return fs.list_dir(real_host)
    except AttrError as err:
        if err.reason != "permission denied":  # missing, a symlink (ELOOP) or not a directory
            raise PciError("device directory missing or not a directory") from None
        return Dir(real_host)


def _read_values(fs: HostFS, d: Dir, real_host: str) -> tuple[dict, dict[str, AttrError]]:
    """The function's values, parsed (the ids from ``uevent``, the id files only where it lacks
    them), and the files that could not be read or parsed."""
    texts, failed = fs.read_attrs(d, _FILES)
    uevent = texts.pop("uevent", None)
    failed.pop("uevent", None)  # the id files say it then
    values = parse_uevent(uevent) if uevent is not None else {}
    if not values.keys() >= _ID_SET:  # no uevent, unreadable or not a PCI one: the id files say it
        more, more_failed = fs.read_attrs(d, tuple(n for n in _IDS if n not in values))
        texts.update(more)
        failed.update(more_failed)
    for name, text in texts.items():
        try:
            values[name] = _PARSE[name](text)
        except ValueError as err:
            failed[name] = AttrError(f"{real_host}/{name}", str(err))
    return values, failed


def _check_identity(values: dict, failed: dict[str, AttrError]) -> None:
    """:class:`PciError` unless vendor, device and a class in range are known."""
    for name in ("vendor", "device", "class"):
        if name not in values:
            raise PciError(f"{name}: {failed[name].reason if name in failed else 'missing'}")
    class_code = values["class"]
    if not 0 <= class_code <= 0xFFFFFF:
        raise PciError(f"class: out of range {class_code:#x}")


def _record(bdf: str, real: str, d: Dir, values: dict, links: dict[str, str], physfn: str | None) -> PciFunction:
    """The record of an identified function: ``real`` its path as on the node."""
    iommu = links.get("iommu_group")
    pcie_root, bridges = split_sysfs_path(real)
    sriov = None
    if d.entries is not None and "sriov_totalvfs" in d.entries:
        # the VFs are not read from the PF's virtfnN links: each VF's physfn link says the same
        sriov = Sriov(total_vfs=values.get("sriov_totalvfs"), num_vfs=values.get("sriov_numvfs"))
    return PciFunction(
        bdf=bdf,
        sysfs_path=real,
        pcie_root=pcie_root,
        bridges=bridges,
        vendor_id=values["vendor"],
        device_id=values["device"],
        subsystem_vendor_id=values.get("subsystem_vendor"),
        subsystem_device_id=values.get("subsystem_device"),
        class_code=values["class"],
        driver=values["driver"] if "driver" in values else links.get("driver"),
        numa_node=values.get("numa_node"),
        iommu_group=int(iommu) if iommu is not None and iommu.isascii() and iommu.isdigit() else None,
        link=PciLink(max_speed=values.get("max_link_speed"), max_width=values.get("max_link_width")),
        sriov=sriov,
        physfn=physfn,
    )


def _links(fs: HostFS, d: Dir, values: dict, problems: list[Problem]) -> tuple[dict[str, str], str | None]:
    """A function's links by name, and its PF's address when it is a VF. ``driver`` only when
    ``uevent`` did not name it; ``physfn`` only when the listing shows it (a function that
    cannot be listed is not taken for a VF)."""
    names = ("iommu_group",) if "driver" in values else ("iommu_group", "driver")
    if d.names is not None:
        names = ("physfn", *names)
    links, bad = fs.link_names(d, names)
    physfn = links.get("physfn")
    if physfn is not None and not BDF_RE.match(physfn):
        problems.append(Problem(what="physfn", reason=f"odd target {physfn!r}"))
        physfn = None
    problems += [Problem(what=n, reason=e.reason) for n, e in bad.items()]
    return links, physfn


def list_bdfs(fs: HostFS) -> list[str]:
    """Entries of /sys/bus/pci/devices that look like PCI addresses (sorted)."""
    return [n for n in fs.listdir(fs.path(PCI_DEVICES)) if BDF_RE.match(n)]


def host_dir(fs: HostFS, fn: PciFunction) -> str:
    """The function's real directory under the scan root."""
    return fs.path(fn.sysfs_path)
