"""NUMA nodes from ``/sys/devices/system/node``: cpulist, SLIT distances, socket."""

from __future__ import annotations

import re

from discovery.models import NumaNode, Problem
from discovery.sysfs import AttrError, HostFS

NODE_DIR = "sys/devices/system/node"
_NODE = re.compile(r"^node(\d+)$")


MAX_CPUS = 65536  # past Linux's NR_CPUS limit (8192)


def parse_cpulist(text: str) -> list[int]:
    """``"0-2,5,8-9"`` -> [0, 1, 2, 5, 8, 9]. Raises ValueError on garbage."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a or b - a > 65536:
            raise ValueError(f"bad cpulist range {part!r}")
        cpus.extend(range(a, b + 1))
        if len(cpus) > MAX_CPUS:  # a few KiB of ranges could otherwise name millions
            raise ValueError(f"cpulist names more than {MAX_CPUS} CPUs")
    return cpus


def read_numa_nodes(fs: HostFS, problems: list[Problem]) -> tuple[NumaNode, ...]:
    try:
        names = fs.listdir(fs.path(NODE_DIR))
    except AttrError:
        return ()  # CONFIG_NUMA=n or no sysfs: not a problem
    nodes = []
    for name in names:
        m = _NODE.match(name)
        if not m:
            continue
        nid = int(m.group(1))
        base = fs.path(NODE_DIR, name)
        cpulist = socket = None
        distances: tuple[int, ...] = ()
        try:
            cpulist = fs.read_text(f"{base}/cpulist").strip() or None
            cpus = parse_cpulist(cpulist or "")
            if cpus:
                socket = fs.read_int(fs.path(f"sys/devices/system/cpu/cpu{cpus[0]}/topology/physical_package_id"))
        except (AttrError, ValueError) as err:
            problems.append(Problem(what=f"{name}", reason=getattr(err, "reason", str(err))))
        try:
            distances = tuple(int(x) for x in fs.read_attr(f"{base}/distance").split())
        except (AttrError, ValueError) as err:
            problems.append(Problem(what=f"{name}/distance", reason=getattr(err, "reason", str(err))))
        nodes.append(NumaNode(id=nid, cpulist=cpulist, distances=distances, socket=socket))
    return tuple(sorted(nodes, key=lambda n: n.id))


def close_nodes(node: int, nodes: tuple[NumaNode, ...]) -> list[int]:
    """List form of numaNode, as upstream: the node itself, then the other nodes at the
    minimum non-self SLIT distance on the same socket (unknown socket counts as same)."""
    by_id = {n.id: n for n in nodes}
    me = by_id.get(node)
    if me is None or not me.distances:
        return [node]
    ids = sorted(by_id)
    if len(me.distances) != len(ids):
        return [node]
    others = [(d, nid) for nid, d in zip(ids, me.distances) if nid != node]
    if not others:
        return [node]
    best = min(d for d, _ in others)
    out = [node]
    for d, nid in others:
        other = by_id[nid]
        same_socket = me.socket is None or other.socket is None or other.socket == me.socket
        if d == best and same_socket:
            out.append(nid)
    return out
