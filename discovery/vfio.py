"""Functions bound to vfio-pci or a variant driver of it: the IOMMU group node and the container node."""

from __future__ import annotations

import re
from functools import partial

from discovery.devnodes import NodeResolver
from discovery.models import DeviceNode, PciFunction, Problem
from discovery.sysfs import AttrError, Dir, HostFS

VFIO_CONTAINER = ("/dev/vfio/vfio", 10, 196)  # misc device
# vfio-pci and its variant drivers (drivers/vfio/pci/*: mlx5_vfio_pci, nvgrace-gpu-vfio-pci for Grace
# Hopper, hisi_acc_vfio_pci, pds_vfio_pci, virtio_vfio_pci, qat_vfio_pci, xe-vfio-pci): the kernel binds
# a function meant for a VM to its variant driver where there is one, a VFIO device like vfio-pci's.
# The chart's classes match the same names (deploy/helm/sysdra/templates/deviceclasses.yaml).
VFIO_DRIVER_ENDINGS = ("vfio-pci", "vfio_pci")
_CDEV = re.compile(r"^vfio(\d+)$")


def is_vfio_driver(driver: str | None) -> bool:
    """Whether a function on ``driver`` is a VFIO device (vfio-pci or a variant driver of it)."""
    return driver is not None and driver.endswith(VFIO_DRIVER_ENDINGS)


def _container(fs: HostFS, resolver: NodeResolver, problems: list[Problem]) -> DeviceNode | None:
    path, major, minor = VFIO_CONTAINER
    misc_dev = fs.path("sys/class/misc/vfio/dev")
    node = resolver.resolve(path, [], sysfs_dev=misc_dev) if fs.exists(misc_dev) else None
    return node or resolver.resolve(path, problems, major=major, minor=minor)


def vfio_nodes(fs: HostFS, resolver: NodeResolver, fn: PciFunction, d: Dir, problems: list[Problem]) -> list[DeviceNode]:
    pci_dir = d.path
    nodes: list[DeviceNode] = []
    if fn.iommu_group is None:
        problems.append(Problem(what="/dev/vfio", reason="bound to vfio-pci but no iommu_group"))
    else:
        g = fn.iommu_group
        node = resolver.resolve(f"/dev/vfio/{g}", problems, sysfs_dev=fs.path(f"sys/class/vfio/{g}/dev"))
        if node is None and fs.exists(fs.path(f"sys/class/vfio/noiommu-{g}")):
            node = resolver.resolve(
                f"/dev/vfio/noiommu-{g}", problems, sysfs_dev=fs.path(f"sys/class/vfio/noiommu-{g}/dev")
            )
        if node is not None:
            nodes.append(node)
    node = resolver.shared(VFIO_CONTAINER[0], problems, partial(_container, fs, resolver))
    if node is not None:
        nodes.append(node)
    # iommufd character device (kernel 6.2+), when present
    try:
        cdevs = sorted(n for n in fs.listdir(f"{pci_dir}/vfio-dev") if _CDEV.match(n)) if d.has("vfio-dev") else []
    except AttrError:
        cdevs = []
    for name in cdevs:
        node = resolver.resolve(f"/dev/vfio/devices/{name}", problems, sysfs_dev=f"{pci_dir}/vfio-dev/{name}/dev")
        if node is not None:
            nodes.append(node)
    return nodes
