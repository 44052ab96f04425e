"""Attributes and capacity published for each device (ResourceSlice encoding).

Standard attributes follow upstream's ``deviceattribute`` package exactly: pciBusID
only for a valid 4-digit-domain BDF; pcieRoot only when the bus link resolves below
/sys/devices/pci* and ends in the BDF; numaNode omitted when unknown (-1 would match
every NUMA-less device). Driver-local names need no domain (the driver's is implied).
Limits are respected here: <= 32 attributes+capacities, strings <= 64 bytes.
"""

from __future__ import annotations

import re
from functools import lru_cache

from discovery.models import AttributeValue, Device, NumaNode, PciFunction, Problem
from discovery.numa import close_nodes

STD = "resource.kubernetes.io/"
PCI_BUS_ID = STD + "pciBusID"
PCIE_ROOT = STD + "pcieRoot"
NUMA_NODE = STD + "numaNode"
UPSTREAM_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f]$")
MAX_STRING = 64
MAX_ENTRIES = 32


def standard_attributes(fn: PciFunction, numa: tuple[NumaNode, ...], list_attributes: bool) -> dict[str, AttributeValue]:
    out: dict[str, AttributeValue] = {}
    if UPSTREAM_BDF.match(fn.bdf):
        out[PCI_BUS_ID] = _value("string", fn.bdf)
        # upstream: link target below /sys/devices/pci*, basename == BDF
        if fn.pcie_root is not None and fn.sysfs_path.rsplit("/", 1)[-1] == fn.bdf:
            out[PCIE_ROOT] = _value("string", fn.pcie_root)
    if fn.numa_node is not None:
        if list_attributes:
            out[NUMA_NODE] = _value("ints", tuple(close_nodes(fn.numa_node, numa)))
        else:
            out[NUMA_NODE] = _value("int_", fn.numa_node)
    return out


@lru_cache(maxsize=65536)
def _value(field: str, value) -> AttributeValue:
    """Frozen values are shared: most attributes (type, vendorID, driver, ...) repeat across
    devices, and one object per device and attribute made a large node's inventory 2x bigger.
    Room for every value of a large node (~5 per device are unique: addresses, MACs, IOMMU
    groups), so that a full rescan finds them all again instead of evicting them in turn."""
    return AttributeValue.trusted(field, value)


def device_attributes(dev: Device, numa: tuple[NumaNode, ...], list_attributes: bool) -> tuple[dict, list[Problem]]:
    """All attributes of a device; documented one by one in docs/attributes.md. Absent values
    (None) are left out; a string longer than 64 bytes is left out with a problem."""
    fn = dev.pci
    problems: list[Problem] = []
    out = standard_attributes(fn, numa, list_attributes)
    value = _value

    def text(name: str, v: str | None) -> None:
        if v is None:
            return
        if not v or len(v) > MAX_STRING or (not v.isascii() and len(v.encode()) > MAX_STRING):
            problems.append(Problem(what=name, reason=f"value longer than {MAX_STRING} bytes"))
        else:
            out[name] = value("string", v)

    def short(name: str, v: str | None) -> None:
        """A string whose format discovery checked when it parsed it (PCI ids: 4 hex digits,
        MAC addresses, interface names: at most 15 bytes): within the limit by construction."""
        if v is not None:
            out[name] = value("string", v)

    def num(name: str, v: int | None) -> None:
        if v is not None:
            out[name] = value("int_", v)

    short("type", dev.kind)
    short("vendorID", fn.vendor_id)
    short("deviceID", fn.device_id)
    short("subsystemVendorID", fn.subsystem_vendor_id)
    short("subsystemDeviceID", fn.subsystem_device_id)
    short("pciClass", f"{fn.class_code:06x}")
    text("pciAddress", fn.bdf)  # also for 5-digit domains, where pciBusID is not published
    text("driver", fn.driver)
    num("iommuGroup", fn.iommu_group)
    text("pcieLinkSpeed", fn.link.max_speed)
    num("pcieLinkWidth", fn.link.max_width)
    if fn.physfn is not None:
        short("sriovRole", "vf")
        text("pfPciAddress", fn.physfn)
    elif fn.sriov is not None:
        short("sriovRole", "pf")
        num("sriovTotalVFs", fn.sriov.total_vfs)
        num("sriovNumVFs", fn.sriov.num_vfs)
    if dev.gpu is not None:
        text("gpuVendor", dev.gpu.vendor)
        text("model", dev.gpu.model)
        text("uuid", dev.gpu.nvidia_uuid)
    if dev.nic is not None:
        ifaces = dev.nic.interfaces
        if ifaces:
            short("interfaceName", ifaces[0].name)
            short("macAddress", ifaces[0].mac)
            num("mtu", ifaces[0].mtu)
            text("switchdevPortName", ifaces[0].phys_port_name)
            if list_attributes and len(ifaces) > 1:
                names = tuple(i.name for i in ifaces if 0 < len(i.name.encode()) <= MAX_STRING)
                if names:
                    out["interfaceNames"] = value("strings", names)
        out["rdma"] = value("bool_", bool(dev.nic.rdma))
        if dev.nic.rdma:
            text("rdmaDevice", dev.nic.rdma[0].name)
    if dev.fpga is not None:
        text("fpgaFamily", dev.fpga.family)
        text("afuID", dev.fpga.afu_id)
        text("interfaceID", dev.fpga.interface_id)
        text("userPciAddress", dev.fpga.user_bdf if dev.fpga.user_bdf != fn.bdf else None)
    if dev.accel is not None:
        num("moduleID", dev.accel.module_id)
    if len(out) + len(dev.capacity) > MAX_ENTRIES:
        # keep the standard ones and the first driver-local ones, in insertion order
        keep = list(out)[: MAX_ENTRIES - len(dev.capacity)]
        problems.append(Problem(what="attributes", reason=f"more than {MAX_ENTRIES} entries, dropped {len(out) - len(keep)}"))
        out = {k: out[k] for k in keep}
    return out, problems


def quantity(n_bytes: int) -> str:
    """Bytes as a Kubernetes quantity, in the largest exact binary unit."""
    for suffix, factor in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n_bytes % factor == 0:
            return f"{n_bytes // factor}{suffix}"
    return str(n_bytes)
