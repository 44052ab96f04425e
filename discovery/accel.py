"""Compute accelerators of the DRM accel class (``accel/accelN``, ``accel_controlDN``)
and habanalabs' device status. The accel index follows probe order, not BDF order."""

from __future__ import annotations

import re

from discovery.devnodes import NodeResolver
from discovery.models import AccelInfo, DeviceNode, PciFunction, Problem
from discovery.sysfs import AttrError, Dir, HostFS

_ACCEL = re.compile(r"^accel(\d+)$")
_CONTROL = re.compile(r"^accel_controlD(\d+)$")


def read_accel(fs: HostFS, resolver: NodeResolver, fn: PciFunction, d: Dir, problems: list[Problem]):
    """-> (AccelInfo, device nodes)."""
    pci_dir = d.path
    try:
        names = fs.listdir(f"{pci_dir}/accel") if d.has("accel") else []
    except AttrError:
        names = []
    accels = sorted((int(m.group(1)), n) for n in names if (m := _ACCEL.match(n)))
    controls = sorted((int(m.group(1)), n) for n in names if (m := _CONTROL.match(n)))
    nodes: list[DeviceNode] = []
    for _, name in accels + controls:
        node = resolver.resolve(f"/dev/accel/{name}", problems, sysfs_dev=f"{pci_dir}/accel/{name}/dev")
        if node is not None:
            nodes.append(node)
    status = module_id = None
    if fn.driver == "habanalabs":
        try:
            status = fs.read_attr(f"{pci_dir}/status")
        except AttrError as err:
            problems.append(Problem(what="status", reason=err.reason))
        try:
            module_id = fs.read_int(f"{pci_dir}/module_id")
        except AttrError:
            pass
    info = AccelInfo(accel=accels[0][1] if accels else None, status=status, module_id=module_id)
    return info, nodes
