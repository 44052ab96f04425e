"""The host's uplink: the PCI functions behind its default routes, which must never be handed to
a workload or a VM (docs/networking.md).

The default routes come from procfs under the root (``net/route``, ``net/ipv6_route``) of its
init, ``proc/1/net``: the host's network namespace. ``proc/net`` is the reading process's own,
which for the DaemonSet's agent (``--root=/host``, no hostNetwork) is its pod's, whose default
route is no NIC of the host's; a fixture tree without an init keeps them in ``proc/net``. Per
family the ones with the lowest metric, all of them when several tie (ECMP; each next hop of an
IPv6 multipath route is a line of its own). Their interfaces are followed down the uplink chain:
a bond's or team's slaves, a VLAN's or macvlan's parent (``lower_*`` links), a bridge's ports
(``brif/``), to the netdevs of PCI functions; the VFs of an uplink PF belong to it too. Read-only.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from discovery.sysfs import AttrError, HostFS

_BDF = re.compile(r"[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_IFACE = re.compile(r"[^/\s]{1,15}")
MAX_CHAIN = 256  # netdevs followed below the default routes' interfaces


@dataclass(frozen=True)
class Uplink:
    interfaces: tuple[str, ...] = ()  # of the default routes
    functions: dict[str, str] = field(default_factory=dict)  # bdf -> why it is the uplink's


def _lowest(routes: list[tuple[int, str]]) -> set[str]:
    if not routes:
        return set()
    best = min(metric for metric, _ in routes)
    return {iface for metric, iface in routes if metric == best}


def _route_table(fs: HostFS, name: str) -> str:
    init = fs.path("proc/1/net", name)
    return init if fs.exists(init) else fs.path("proc/net", name)


def _table(fs: HostFS, name: str) -> str:
    """A route table; an interface name in it that is not UTF-8 (the kernel allows any bytes)
    stays as its bytes (surrogate escapes), so its routes still count and its sysfs paths still
    resolve: a route table refused as a whole would leave the uplink allocatable."""
    return fs.read_bytes(_route_table(fs, name), limit=1 << 20).decode("utf-8", "surrogateescape")


def shown(name: str) -> str:
    """An interface name for a message: bytes that are not UTF-8 as escapes."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def default_route_interfaces(fs: HostFS) -> set[str]:
    """The interfaces of the lowest-metric default routes, IPv4 and IPv6, of the host's network
    namespace (its init's)."""
    v4: list[tuple[int, str]] = []
    v6: list[tuple[int, str]] = []
    try:  # Iface Destination Gateway Flags RefCnt Use Metric Mask ...
        for line in _table(fs, "route").splitlines()[1:]:
            f = line.split()
            if len(f) >= 8 and f[1] == "00000000" and f[7] == "00000000" and f[6].isascii() and f[6].isdigit():
                v4.append((int(f[6]), f[0]))
    except AttrError:
        pass
    try:  # dest prefixlen src srclen nexthop metric refcnt use flags iface
        for line in _table(fs, "ipv6_route").splitlines():
            f = line.split()
            if len(f) >= 10 and f[0] == "0" * 32 and f[1] == "00" and f[9] != "lo" and _hex(f[5]) is not None:
                v6.append((_hex(f[5]), f[9]))
    except AttrError:
        pass
    return {i for i in _lowest(v4) | _lowest(v6) if _IFACE.fullmatch(i)}


def _hex(text: str) -> int | None:
    try:
        return int(text, 16)
    except ValueError:
        return None


def _below(fs: HostFS, iface: str) -> list[str]:
    """The netdevs an interface sits on: lower devices (bond/team slaves, a VLAN's parent) and
    bridge ports."""
    base = fs.path("sys/class/net", iface)
    out = []
    try:
        names = fs.listdir(base)
    except AttrError:
        return []
    out += [n[len("lower_"):] for n in names if n.startswith("lower_")]
    if "brif" in names:
        try:
            out += list(fs.listdir(os.path.join(base, "brif")))
        except AttrError:
            pass
    return [n for n in out if _IFACE.fullmatch(n)]


def _function_of(fs: HostFS, iface: str) -> str | None:
    """The PCI function a netdev belongs to (the deepest PCI address in its device's path:
    a virtio netdev's device is the virtioN below the function)."""
    link = fs.path("sys/class/net", iface, "device")
    try:
        real = os.path.realpath(link) if os.path.islink(link) else ""
    except OSError:
        return None
    found = None
    for part in real.split("/"):
        if _BDF.fullmatch(part):
            found = part
    return found


def uplink(root: str) -> Uplink:
    """The host's uplink under ``root``: its default routes' interfaces and PCI functions."""
    fs = HostFS(root)
    routed = sorted(default_route_interfaces(fs))
    functions: dict[str, str] = {}
    seen: set[str] = set()
    todo = [(i, i) for i in routed]
    while todo and len(seen) < MAX_CHAIN:
        iface, via = todo.pop()
        if iface in seen:
            continue
        seen.add(iface)
        bdf = _function_of(fs, iface)
        if bdf is not None:
            what = f"default route via {shown(via)}" + (f" ({shown(iface)})" if iface != via else "")
            functions.setdefault(bdf, what)
        todo += [(lower, via) for lower in _below(fs, iface)]
    for pf, why in list(functions.items()):
        try:
            links = [n for n in fs.listdir(fs.path("sys/bus/pci/devices", pf)) if n.startswith("virtfn")]
        except AttrError:
            continue
        for name in links:
            vf = _function_of_link(fs, fs.path("sys/bus/pci/devices", pf, name))
            if vf is not None:
                functions.setdefault(vf, f"a VF of {pf}, {why}")
    return Uplink(tuple(shown(i) for i in routed), functions)


def _function_of_link(fs: HostFS, link: str) -> str | None:
    try:
        name = os.path.basename(os.path.realpath(link))
    except OSError:
        return None
    return name if _BDF.fullmatch(name) else None


def default_route_functions(root: str) -> dict[str, str]:
    """``{bdf: why}`` of the PCI functions of the host's uplink."""
    return uplink(root).functions
