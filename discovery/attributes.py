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
# A PciFunction's bdf is an address as discovery lists it (pci.BDF_RE: a domain of 4 or more
# hex digits, function 0-7); of those, upstream's form is exactly the ones of 12 characters.
UPSTREAM_BDF_LENGTH = 12
MAX_STRING = 64
MAX_ENTRIES = 32


def standard_attributes(fn: PciFunction, numa: tuple[NumaNode, ...], list_attributes: bool) -> dict[str, AttributeValue]:
    out: dict[str, AttributeValue] = {}
    if len(fn.bdf) == UPSTREAM_BDF_LENGTH:  # UPSTREAM_BDF, for an address BDF_RE took
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
# Strings and integers, nearly all of them, are looked up by their value in one plain dict
# (a string never equals an integer) rather than through an lru_cache and its (field, value)
# key tuple. It holds only values that can be published as they are (a string of 1 to 64
# bytes, an integer), so a value found there needs no check. The room is for every value of
# a large node (~5 per device are unique: addresses, MACs, IOMMU groups), so that a full
# rescan finds them all again, and a table that fills up (an agent that has seen ever new
# VFs) starts over.
_TABLE_LIMIT = 65536
_VALUES: dict[str | int, AttributeValue] = {}  # no bools: True == 1, so they have their own two values
_BOOLS = {True: AttributeValue.trusted("bool_", True), False: AttributeValue.trusted("bool_", False)}


def _publishable(v: str) -> bool:
    return bool(v) and len(v) <= MAX_STRING and (v.isascii() or len(v.encode()) <= MAX_STRING)


def _new(field: str, value) -> AttributeValue:
    """A value not met before, kept in the table when it can be published as it is."""
    made = AttributeValue.trusted(field, value)
    if field == "int_" or _publishable(value):
        if len(_VALUES) >= _TABLE_LIMIT:
            _VALUES.clear()
        _VALUES[value] = made
    return made


def string_value(v: str) -> AttributeValue:
    return _VALUES.get(v) or _new("string", v)


def int_value(v: int) -> AttributeValue:
    return _VALUES.get(v) or _new("int_", v)


def _value(field: str, value) -> AttributeValue:
    """The shared value of any field (``trusted``: discovery built it, of the field's type)."""
    if field == "string" and type(value) is str:
        return string_value(value)
    if field == "int_" and type(value) is int:
        return int_value(value)
    if field == "bool_":
        return _BOOLS[value]
    return _other_value(field, value)


@lru_cache(maxsize=4096)
def _other_value(field: str, value) -> AttributeValue:
    return AttributeValue.trusted(field, value)


def device_attributes(dev: Device, numa: tuple[NumaNode, ...], list_attributes: bool) -> tuple[dict, list[Problem]]:
    """All attributes of a device; documented one by one in docs/attributes.md. Absent values
    (None) are left out; a string longer than 64 bytes is left out with a problem. The entries
    (name, string or integer) are listed first and published by one loop (:func:`_publish`)."""
    fn = dev.pci
    out = standard_attributes(fn, numa, list_attributes)
    problems: list[Problem] = []
    out.update(_identity(dev.kind, fn, problems))
    entries = [
        ("pciAddress", fn.bdf),  # also for 5-digit domains, where pciBusID is not published
        ("driver", fn.driver), ("iommuGroup", fn.iommu_group),
        ("pcieLinkSpeed", fn.link.max_speed), ("pcieLinkWidth", fn.link.max_width),
    ]  # fmt: skip
    if fn.physfn is not None:
        entries += (("sriovRole", "vf"), ("pfPciAddress", fn.physfn))
    elif fn.sriov is not None:
        entries += (("sriovRole", "pf"), ("sriovTotalVFs", fn.sriov.total_vfs), ("sriovNumVFs", fn.sriov.num_vfs))
    if dev.gpu is not None:
        entries += (("gpuVendor", dev.gpu.vendor), ("model", dev.gpu.model), ("uuid", dev.gpu.nvidia_uuid))
        if (nv := dev.gpu.nvidia) is not None:  # NVIDIA's own driver's names (docs/attributes.md)
            entries += (("productName", nv.product_name), ("brand", nv.brand), ("architecture", nv.architecture))
            for name, version in (("driverVersion", nv.driver_version), ("cudaDriverVersion", nv.cuda_driver_version),
                                  ("cudaComputeCapability", nv.compute_capability)):
                if version is not None:
                    out[name] = _value("version", version)
    nic = dev.nic
    if nic is not None and nic.interfaces:
        first = nic.interfaces[0]
        entries += (("interfaceName", first.name), ("macAddress", first.mac), ("mtu", first.mtu),
                    ("switchdevPortName", first.phys_port_name))  # fmt: skip
    _publish(out, problems, entries)
    later: list = []  # after the NIC's list and bool values, in their order
    if nic is not None:
        if list_attributes and len(nic.interfaces) > 1:
            names = tuple(i.name for i in nic.interfaces if 0 < len(i.name.encode()) <= MAX_STRING)
            if names:
                out["interfaceNames"] = _value("strings", names)
        out["rdma"] = _BOOLS[bool(nic.rdma)]
        if nic.rdma:
            later.append(("rdmaDevice", nic.rdma[0].name))
    if dev.fpga is not None:
        fpga = dev.fpga
        later += (("fpgaFamily", fpga.family), ("afuID", fpga.afu_id), ("interfaceID", fpga.interface_id),
                  ("userPciAddress", fpga.user_bdf if fpga.user_bdf != fn.bdf else None))  # fmt: skip
    if dev.accel is not None:
        later.append(("moduleID", dev.accel.module_id))
    if later:
        _publish(out, problems, later)
    if len(out) + len(dev.capacity) > MAX_ENTRIES:
        # keep the standard ones and the first driver-local ones, in insertion order
        keep = list(out.items())[: MAX_ENTRIES - len(dev.capacity)]  # no comprehension: it made ``out`` a cell
        problems.append(Problem(what="attributes", reason=f"more than {MAX_ENTRIES} entries, dropped {len(out) - len(keep)}"))
        out = dict(keep)
    return out, problems


# A device's first entries, the same for every function of one model: published once per
# distinct set of values (a large node has a handful), then copied.
_IDENTITY_NAMES = ("type", "vendorID", "deviceID", "subsystemVendorID", "subsystemDeviceID", "pciClass")
_IDENTITIES: dict[tuple, dict[str, AttributeValue]] = {}


def _identity(kind: str, fn: PciFunction, problems: list[Problem]) -> dict[str, AttributeValue]:
    key = (kind, fn.vendor_id, fn.device_id, fn.subsystem_vendor_id, fn.subsystem_device_id, fn.class_code)
    if (known := _IDENTITIES.get(key)) is not None:
        return known
    made: dict[str, AttributeValue] = {}
    refused: list[Problem] = []
    _publish(made, refused, zip(_IDENTITY_NAMES, (*key[:5], f"{fn.class_code:06x}")))
    if refused:  # not kept: every device with these values reports its problems
        problems += refused
        return made
    if len(_IDENTITIES) >= 4096:
        _IDENTITIES.clear()
    _IDENTITIES[key] = made
    return made


def _publish(out: dict, problems: list[Problem], entries) -> None:
    """Each (name, value) entry's shared value into ``out``; None values left out, a string
    past the limit (or empty) left out with a problem. A value in the table is published as
    found; only a new one is checked (a string's length; an integer is one by its field)."""
    get = _VALUES.get
    for name, v in entries:
        if v is None:
            continue
        if (value := get(v)) is None:
            if type(v) is int:
                value = _new("int_", v)
            elif _publishable(v):
                value = _new("string", v)
            else:
                problems.append(Problem(what=name, reason=f"value longer than {MAX_STRING} bytes"))
                continue
        out[name] = value


def quantity(n_bytes: int) -> str:
    """Bytes as a Kubernetes quantity: the shortest exact form, binary units first (``143771Mi``,
    and a datasheet's decimal size as ``80G`` rather than ``78125000Ki``)."""
    forms = [str(n_bytes)]
    for suffix, factor in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10),
                           ("T", 10**12), ("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n_bytes and n_bytes % factor == 0:
            forms.append(f"{n_bytes // factor}{suffix}")
    return min(forms, key=len)
