"""Which PCI functions carry the host's default routes (procfs ``net/route`` and
``net/ipv6_route`` under the root): those are the host's own and must never be handed to
a workload or a VM. Read-only, like all of discovery."""

from __future__ import annotations

import os
import re

from discovery.sysfs import AttrError, HostFS

_BDF = re.compile(r"[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_IFACE = re.compile(r"[^/\s]{1,15}")


def default_route_interfaces(fs: HostFS) -> set[str]:
    ifaces: set[str] = set()
    try:  # Iface Destination Gateway Flags RefCnt Use Metric Mask ...
        for line in fs.read_text(fs.path("proc/net/route"), limit=1 << 20).splitlines()[1:]:
            f = line.split()
            if len(f) >= 8 and f[1] == "00000000" and f[7] == "00000000":
                ifaces.add(f[0])
    except AttrError:
        pass
    try:  # dest prefixlen src srclen nexthop metric refcnt use flags iface
        for line in fs.read_text(fs.path("proc/net/ipv6_route"), limit=1 << 20).splitlines():
            f = line.split()
            if len(f) >= 10 and f[0] == "0" * 32 and f[1] == "00" and f[9] != "lo":
                ifaces.add(f[9])
    except AttrError:
        pass
    return {i for i in ifaces if _IFACE.fullmatch(i)}


def default_route_functions(root: str) -> dict[str, str]:
    """``{bdf: interface}`` of the PCI functions behind the default routes."""
    fs = HostFS(root)
    out = {}
    for iface in sorted(default_route_interfaces(fs)):
        link = fs.path("sys/class/net", iface, "device")
        try:
            bdf = os.path.basename(os.path.realpath(link)) if os.path.islink(link) else ""
        except OSError:
            continue
        if _BDF.fullmatch(bdf):
            out[bdf] = iface
    return out
