"""NICs: netdevs below the function (virtio one level deeper), RDMA devices and their
``/dev/infiniband/uverbsN`` nodes."""

from __future__ import annotations

import os
import re

from discovery.devnodes import NodeResolver
from discovery.models import DeviceNode, NetInterface, NicInfo, PciFunction, Problem, RdmaDevice
from discovery.sysfs import AttrError, Dir, HostFS, printable_name

_UVERBS = re.compile(r"^uverbs(\d+)$")
_MAC = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5,19}$")
_IFNAME = re.compile(r"^[^/\s]{1,15}$")
_RATE = re.compile(r"^(\d+(?:\.\d+)?) Gb/sec\b")
VIRTIO_VENDOR = "1af4"  # every virtio PCI device (virtio spec, 4.1.2)


def _net_dirs(fs: HostFS, fn: PciFunction, d: Dir) -> list[str]:
    """Directories that hold netdevs: ``<fn>/net``, and a virtio device's ``<fn>/virtioN/net``
    (virtio's PCI vendor is 1af4, by its spec; only those are looked through)."""
    dirs = [f"{d.path}/net"] if d.has("net") else []
    if fn.vendor_id != VIRTIO_VENDOR:
        return dirs
    if d.names is None:
        try:
            d = fs.list_dir(d.path)
        except AttrError:
            return dirs
    virtio = [n for n in sorted(d.names) if n.startswith("virtio") and fs.is_dir(f"{d.path}/{n}")]  # real directories only
    return dirs + [f"{d.path}/{n}/net" for n in virtio]


def netdev_names(fs: HostFS, fn: PciFunction, d: Dir) -> list[str]:
    """The names of the function's netdevs as sysfs shows them now (those ``read_nic`` reads)."""
    out: list[str] = []
    for net_dir in _net_dirs(fs, fn, d):
        try:
            out += [name for name in fs.subdirs(net_dir) if printable_name(name) and _IFNAME.match(name)]
        except AttrError:
            continue
    return out


def hides_netdevs(fs: HostFS, fn: PciFunction, d: Dir) -> bool:
    """Whether sysfs has a netdev directory of the function that lists none: a netdev moved to
    another network namespace stays below it, listed only to that namespace's readers (the
    directory goes with the function's last netdev). A function that never had one (RDMA only,
    EFA, its driver still probing) has no such directory."""
    dirs = [p for p in _net_dirs(fs, fn, d) if fs.is_dir(p)]
    return bool(dirs) and not netdev_names(fs, fn, d)


# A netdev's published files and how each is parsed (``str``: as read).
_NETDEV_FILES = (("address", str), ("mtu", int), ("phys_port_name", str), ("speed", int))


def read_interface(fs: HostFS, path: str, name: str, problems: list[Problem]) -> NetInterface:
    """The published values of one netdev (its link state is for health to read)."""
    values: dict = {}
    for attr, parse in _NETDEV_FILES:
        try:
            if (text := fs.read_optional(f"{path}/{attr}")) is not None:
                values[attr] = parse(text)
        except AttrError as err:
            # speed reads EINVAL while the link is down; phys_port_name EOPNOTSUPP when the
            # driver has no switchdev ops: both expected, nothing wrong
            expected = attr == "speed" or (attr == "phys_port_name" and err.reason.startswith("not supported"))
            if err.reason != "missing" and not expected:
                problems.append(Problem(what=f"{name}/{attr}", reason=err.reason))
        except ValueError:
            if attr != "speed":  # an unparsable speed is no speed, as a down link's -1 is
                problems.append(Problem(what=f"{name}/{attr}", reason="unparsable"))
    mac = values.get("address", "").lower()
    speed = values.get("speed")
    return NetInterface(
        name=name,
        mac=mac if _MAC.match(mac) else None,
        mtu=values.get("mtu"),
        phys_port_name=values.get("phys_port_name"),
        speed_mbps=speed if speed is not None and 0 < speed < 10**8 else None,
    )


def _bad_name(what: str, name: str) -> Problem:
    """A name left out (it could not be published, nor its problem printed): its bytes."""
    return Problem(what=what, reason=f"name {os.fsencode(name)!r} is not printable UTF-8")


def _port_rate(fs: HostFS, ibdev_dir: str) -> float | None:
    """Port 1's rate in Gb/s (``ports/1/rate``: "400 Gb/sec (4X NDR)"), None when unreadable."""
    try:
        m = _RATE.match(fs.read_attr(f"{ibdev_dir}/ports/1/rate"))
    except AttrError:
        return None
    return float(m.group(1)) if m and 0 < float(m.group(1)) < 10**5 else None


def read_nic(fs: HostFS, resolver: NodeResolver, fn: PciFunction, d: Dir, problems: list[Problem]):
    """-> (NicInfo, device nodes)."""
    interfaces = _interfaces(fs, fn, d, problems)
    nodes, verbs_by_ibdev = _uverbs(fs, resolver, d, problems)
    rdma = _rdma_devices(fs, d, verbs_by_ibdev, problems)
    return NicInfo(interfaces=tuple(interfaces), rdma=tuple(rdma)), nodes


def _interfaces(fs: HostFS, fn: PciFunction, d: Dir, problems: list[Problem]) -> list[NetInterface]:
    """The function's netdevs; a name that is not printable is left out, as a problem."""
    interfaces = []
    for net_dir in _net_dirs(fs, fn, d):
        try:
            names = fs.subdirs(net_dir)  # real directories only (d_type), as sysfs has them
        except AttrError:
            continue
        for name in names:
            if not printable_name(name):
                problems.append(_bad_name("netdev", name))
            elif _IFNAME.match(name):
                interfaces.append(read_interface(fs, f"{net_dir}/{name}", name, problems))
    return interfaces


def _uverbs(fs: HostFS, resolver: NodeResolver, d: Dir, problems: list[Problem]) -> tuple[list[DeviceNode], dict[str, str]]:
    """The ``/dev/infiniband/uverbsN`` nodes (by N) and which RDMA device each is for."""
    pci_dir = d.path
    nodes: list[DeviceNode] = []
    verbs_by_ibdev: dict[str, str] = {}
    verbs: list[tuple[int, str]] = []
    try:
        for n in fs.listdir(f"{pci_dir}/infiniband_verbs") if d.has("infiniband_verbs") else ():
            if m := _UVERBS.match(n):
                verbs.append((int(m.group(1)), n))
    except AttrError:
        verbs = []
    verbs.sort()
    for _, uverbs in verbs:
        base = f"{pci_dir}/infiniband_verbs/{uverbs}"
        try:
            verbs_by_ibdev[fs.read_attr(f"{base}/ibdev")] = uverbs
        except AttrError:
            pass
        node = resolver.resolve(f"/dev/infiniband/{uverbs}", problems, sysfs_dev=f"{base}/dev")
        if node is not None:
            nodes.append(node)
    return nodes, verbs_by_ibdev


def _rdma_devices(fs: HostFS, d: Dir, verbs_by_ibdev: dict[str, str], problems: list[Problem]) -> list[RdmaDevice]:
    """The function's RDMA devices with their uverbs node and port 1's rate."""
    pci_dir = d.path
    try:
        ibdevs = fs.listdir(f"{pci_dir}/infiniband") if d.has("infiniband") else []
    except AttrError:
        ibdevs = []
    rdma: list[RdmaDevice] = []
    for ib in ibdevs:
        if not printable_name(ib):
            problems.append(_bad_name("RDMA device", ib))
            continue
        rate = _port_rate(fs, f"{pci_dir}/infiniband/{ib}")
        rdma.append(RdmaDevice(name=ib, uverbs=verbs_by_ibdev.get(ib), rate_gbps=rate))
    return rdma
