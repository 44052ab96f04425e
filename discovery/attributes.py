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
        out[PCI_BUS_ID] = string_value(fn.bdf)
        # upstream: link target below /sys/devices/pci*, basename == BDF
        if fn.pcie_root is not None and fn.sysfs_path.rsplit("/", 1)[-1] == fn.bdf:
            out[PCIE_ROOT] = string_value(fn.pcie_root)
    if fn.numa_node is not None:
        if list_attributes:
            out[NUMA_NODE] = _value("ints", tuple(close_nodes(fn.numa_node, numa)))
        else:
            out[NUMA_NODE] = int_value(fn.numa_node)
    return out


# Frozen values are shared: most attributes (type, vendorID, driver, ...) repeat across
# devices, and one object per device and attribute made a large node's inventory 2x bigger.
# Strings and integers, nearly all of them, are looked up by their value in a plain dict
# rather than through an lru_cache and its (field, value) key tuple; the room is for every
# value of a large node (~5 per device are unique: addresses, MACs, IOMMU groups), so that a
# full rescan finds them all again, and a table that fills up (an agent that has seen ever new
# VFs) starts over.
_TABLE_LIMIT = 65536
_STRINGS: dict[str, AttributeValue] = {}
_INTS: dict[int, AttributeValue] = {}  # ints only: True == 1, so bools have their own two values
_BOOLS = {True: AttributeValue.trusted("bool_", True), False: AttributeValue.trusted("bool_", False)}


def _new(table: dict, field: str, value) -> AttributeValue:
    if len(table) >= _TABLE_LIMIT:
        table.clear()
    made = table[value] = AttributeValue.trusted(field, value)
    return made


def string_value(v: str) -> AttributeValue:
    return _STRINGS.get(v) or _new(_STRINGS, "string", v)


def int_value(v: int) -> AttributeValue:
    return _INTS.get(v) or _new(_INTS, "int_", v)


def _value(field: str, value) -> AttributeValue:
    """The shared value of any field (``trusted``: discovery built it, of the field's type)."""
    if field == "string":
        return string_value(value)
    if field == "int_" and type(value) is int:
        return int_value(value)
    if field == "bool_":
        return _BOOLS[value]
    return _other_value(field, value)


@lru_cache(maxsize=4096)
def _other_value(field: str, value) -> AttributeValue:
    return AttributeValue.trusted(field, value)


# How an entry's value is checked before it is published. SHORT: a string whose format
# discovery checked when it parsed it (PCI ids, MAC addresses, interface names: at most 15
# bytes), within the limit by construction; TEXT: a string as read (driver names, models):
# its length is checked; INT: an integer.
SHORT, TEXT, INT = 0, 1, 2


def device_attributes(dev: Device, numa: tuple[NumaNode, ...], list_attributes: bool) -> tuple[dict, list[Problem]]:
    """All attributes of a device; documented one by one in docs/attributes.md. Absent values
    (None) are left out; a string longer than 64 bytes is left out with a problem. The entries
    are listed first and published by one loop (:func:`_publish`), each value found in its table: a helper call
    and an lru_cache lookup per attribute took 9.0 µs per device of the large node, this 3.6."""
    fn = dev.pci
    entries = [
        ("type", SHORT, dev.kind), ("vendorID", SHORT, fn.vendor_id), ("deviceID", SHORT, fn.device_id),
        ("subsystemVendorID", SHORT, fn.subsystem_vendor_id), ("subsystemDeviceID", SHORT, fn.subsystem_device_id),
        ("pciClass", SHORT, f"{fn.class_code:06x}"),
        ("pciAddress", TEXT, fn.bdf),  # also for 5-digit domains, where pciBusID is not published
        ("driver", TEXT, fn.driver), ("iommuGroup", INT, fn.iommu_group),
        ("pcieLinkSpeed", TEXT, fn.link.max_speed), ("pcieLinkWidth", INT, fn.link.max_width),
    ]  # fmt: skip
    if fn.physfn is not None:
        entries += (("sriovRole", SHORT, "vf"), ("pfPciAddress", TEXT, fn.physfn))
    elif fn.sriov is not None:
        entries += (("sriovRole", SHORT, "pf"), ("sriovTotalVFs", INT, fn.sriov.total_vfs),
                    ("sriovNumVFs", INT, fn.sriov.num_vfs))  # fmt: skip
    if dev.gpu is not None:
        entries += (("gpuVendor", TEXT, dev.gpu.vendor), ("model", TEXT, dev.gpu.model), ("uuid", TEXT, dev.gpu.nvidia_uuid))
    nic = dev.nic
    if nic is not None and nic.interfaces:
        first = nic.interfaces[0]
        entries += (("interfaceName", SHORT, first.name), ("macAddress", SHORT, first.mac), ("mtu", INT, first.mtu),
                    ("switchdevPortName", TEXT, first.phys_port_name))  # fmt: skip
    out = standard_attributes(fn, numa, list_attributes)
    problems: list[Problem] = []
    _publish(out, problems, entries)
    later: list = []  # after the NIC's list and bool values, in their order
    if nic is not None:
        if list_attributes and len(nic.interfaces) > 1:
            names = tuple(i.name for i in nic.interfaces if 0 < len(i.name.encode()) <= MAX_STRING)
            if names:
                out["interfaceNames"] = _value("strings", names)
        out["rdma"] = _BOOLS[bool(nic.rdma)]
        if nic.rdma:
            later.append(("rdmaDevice", TEXT, nic.rdma[0].name))
    if dev.fpga is not None:
        fpga = dev.fpga
        later += (("fpgaFamily", TEXT, fpga.family), ("afuID", TEXT, fpga.afu_id), ("interfaceID", TEXT, fpga.interface_id),
                  ("userPciAddress", TEXT, fpga.user_bdf if fpga.user_bdf != fn.bdf else None))  # fmt: skip
    if dev.accel is not None:
        later.append(("moduleID", INT, dev.accel.module_id))
    if later:
        _publish(out, problems, later)
    if len(out) + len(dev.capacity) > MAX_ENTRIES:
        # keep the standard ones and the first driver-local ones, in insertion order
        keep = list(out)[: MAX_ENTRIES - len(dev.capacity)]
        problems.append(Problem(what="attributes", reason=f"more than {MAX_ENTRIES} entries, dropped {len(out) - len(keep)}"))
        out = {k: out[k] for k in keep}
    return out, problems


def _publish(out: dict, problems: list[Problem], entries) -> None:
    """Each (name, check, value) entry's shared value into ``out``; None values left out, a
    TEXT one past the limit (or empty) left out with a problem."""
    strings, ints = _STRINGS.get, _INTS.get
    for name, check, v in entries:
        if v is None:
            continue
        if check == INT:
            out[name] = ints(v) or _new(_INTS, "int_", v)
        elif check == SHORT or (v and len(v) <= MAX_STRING and (v.isascii() or len(v.encode()) <= MAX_STRING)):
            out[name] = strings(v) or _new(_STRINGS, "string", v)
        else:
            problems.append(Problem(what=name, reason=f"value longer than {MAX_STRING} bytes"))


def quantity(n_bytes: int) -> str:
    """Bytes as a Kubernetes quantity, in the largest exact binary unit."""
    for suffix, factor in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n_bytes % factor == 0:
            return f"{n_bytes // factor}{suffix}"
    return str(n_bytes)
