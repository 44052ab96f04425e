"""Attributes and capacity published for each device (ResourceSlice encoding).

Standard attributes follow upstream's ``deviceattribute`` package exactly: pciBusID
only for a valid 4-digit-domain BDF; pcieRoot only when the bus link resolves below
/sys/devices/pci* and ends in the BDF; numaNode omitted when unknown (-1 would match
every NUMA-less device). Driver-local names need no domain (the driver's is implied).
Limits are respected here: <= 32 attributes+capacities, <= 48 values, strings <= 64 bytes.
"""

from __future__ import annotations

import re
from operator import attrgetter
from typing import NamedTuple

from discovery.models import (LIST_FIELDS, AccelInfo, AttributeValue, Device, FpgaInfo, GpuInfo, NicInfo, NumaNode,
                              PciFunction, Problem)
from discovery.numa import close_nodes
from discovery.pci import pcie_switch

STD = "resource.kubernetes.io/"
PCI_BUS_ID = STD + "pciBusID"
PCIE_ROOT = STD + "pcieRoot"
NUMA_NODE = STD + "numaNode"
UPSTREAM_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f]$")
# The API server's limits on a device (resource.k8s.io/v1); publish/validation.py checks them too.
MAX_VALUE_LENGTH = 64  # bytes, of a string or version value and of each list element
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_ATTRIBUTE_VALUES = 48  # a device's attribute values, each list element counted
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1  # an int value's range
# devlink's phys_port_name of a PCI_PF/VF/SF port, c<N> first for an external controller: a
# representor (a switchdev PF lists one per VF/SF under its own net/), not the function's port
_REPRESENTOR = re.compile(r"^(?:c\d+)?pf\d+(?:[vs]f\d+)?$")


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


# The shared values, one table per field (an int and a bool that are equal stay apart): a
# plain dict per field, as a scan looks up ~40,000 values on a large node; emptied when full.
_SHARED: dict[str, dict] = {}
_SHARED_MAX = 65536


def _value(field: str, value) -> AttributeValue | None:
    """The shared value, None for a string that cannot be published (empty, or longer than
    64 bytes). Shared: most attributes (type, vendorID, driver, ...) repeat across devices,
    and one object per device and attribute made a large node's inventory twice as big."""
    table = _SHARED.get(field)
    shared = None if table is None else table.get(value)
    return shared if shared is not None else _new_value(field, value)


def _new_value(field: str, value) -> AttributeValue | None:
    if field == "string" and not _fits(value):
        return None  # not kept: rare, and its check is cheap
    table = _SHARED.setdefault(field, {})
    if len(table) >= _SHARED_MAX:  # bounded: values come from untrusted files
        table.clear()
    shared = table[value] = AttributeValue(**{field: value})
    return shared


class DeviceParts(NamedTuple):
    """What :func:`device_attributes` reads of a device, as the scan has it before it makes the
    device (whose attributes and problems come from here): a Device made once, not twice."""

    kind: str
    pci: PciFunction
    capacity: dict
    gpu: GpuInfo | None = None
    nic: NicInfo | None = None
    fpga: FpgaInfo | None = None
    accel: AccelInfo | None = None


def device_attributes(dev: Device | DeviceParts, numa: tuple[NumaNode, ...], list_attributes: bool) -> tuple[dict, list[Problem]]:
    """All attributes of a device; documented one by one in docs/attributes.md. Absent values
    (None) are left out; a string longer than 64 bytes is left out with a problem; past 32
    attributes and capacities, the last ones are dropped with a problem, past 48 values the
    lists (:func:`_within_values`)."""
    fn = dev.pci
    out = standard_attributes(fn, numa, list_attributes)
    problems: list[Problem] = []
    _publish(out, problems, _entries(dev, list_attributes))
    if len(out) + len(dev.capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
        # keep the standard ones and the first driver-local ones, in insertion order
        keep = list(out.items())[: MAX_ATTRIBUTES_AND_CAPACITIES - len(dev.capacity)]
        problems.append(Problem(what="attributes", reason=f"more than {MAX_ATTRIBUTES_AND_CAPACITIES} entries, "
                                                          f"dropped {len(out) - len(keep)}"))  # fmt: skip
        out = dict(keep)
    _within_values(out, problems)
    return out, problems


_FIELD = attrgetter("field")


def _within_values(out: dict, problems: list[Problem]) -> None:
    """Past 48 values, lists are left out, the last first, with a problem: the API server
    would refuse the whole device."""
    if len(out) <= MAX_ATTRIBUTE_VALUES and LIST_FIELDS.isdisjoint(map(_FIELD, out.values())):
        return  # one value each, and few enough: the common case, looked at without a loop in Python
    lists = {name: len(getattr(v, v.field)) for name, v in out.items() if v.field in LIST_FIELDS}
    total = len(out) - len(lists) + sum(lists.values())
    for name in reversed(lists):
        if total <= MAX_ATTRIBUTE_VALUES:
            break
        del out[name]
        total -= lists[name]
        problems.append(Problem(what=name, reason=f"{lists[name]} values, past the device's {MAX_ATTRIBUTE_VALUES}"))


def _entries(dev: Device | DeviceParts, list_attributes: bool) -> list[tuple[str, object]]:
    """A device's driver-local attributes as (name, value) in publishing order; None: absent."""
    fn = dev.pci
    entries: list[tuple[str, object]] = [
        ("type", dev.kind), ("vendorID", fn.vendor_id), ("deviceID", fn.device_id),
        ("subsystemVendorID", fn.subsystem_vendor_id), ("subsystemDeviceID", fn.subsystem_device_id),
        ("pciClass", f"{fn.class_code:06x}"),
        ("pciAddress", fn.bdf),  # also for 5-digit domains, where pciBusID is not published
        ("driver", fn.driver), ("iommuGroup", fn.iommu_group),
        ("pcieLinkSpeed", fn.link.max_speed), ("pcieLinkWidth", fn.link.max_width), ("pcieSwitch", pcie_switch(fn)),
    ]  # fmt: skip
    if fn.physfn is not None:
        entries += [("sriovRole", "vf"), ("pfPciAddress", fn.physfn)]
    elif fn.sriov is not None:
        entries += [("sriovRole", "pf"), ("sriovTotalVFs", fn.sriov.total_vfs), ("sriovNumVFs", fn.sriov.num_vfs)]
    if dev.gpu is not None:
        entries += [("gpuVendor", dev.gpu.vendor), ("model", dev.gpu.model), ("uuid", dev.gpu.nvidia_uuid)]
        if (nv := dev.gpu.nvidia) is not None:  # the names NVIDIA's own driver publishes (docs/nvidia.md)
            entries += [("productName", nv.product_name), ("brand", nv.brand), ("architecture", nv.architecture),
                        ("addressingMode", nv.addressing_mode)]
            entries += [(name, Version(v) if v else None) for name, v in (
                ("driverVersion", nv.driver_version), ("cudaDriverVersion", nv.cuda_driver_version),
                ("cudaComputeCapability", nv.compute_capability))]
    nic = dev.nic
    if nic is not None:
        first = nic.interfaces[0] if nic.interfaces else None
        if first is not None:
            entries += [("interfaceName", first.name), ("macAddress", first.mac), ("mtu", first.mtu),
                        ("switchdevPortName", first.phys_port_name)]  # fmt: skip
        if list_attributes and len(nic.interfaces) > 1:
            names = tuple(i.name for i in nic.interfaces
                          if _fits(i.name) and not _REPRESENTOR.match(i.phys_port_name or ""))
            entries.append(("interfaceNames", names or None))
        entries.append(("rdma", bool(nic.rdma)))
        if nic.rdma:
            entries.append(("rdmaDevice", nic.rdma[0].name))
    if dev.fpga is not None:
        fpga = dev.fpga
        entries += [("fpgaFamily", fpga.family), ("afuID", fpga.afu_id), ("interfaceID", fpga.interface_id),
                    ("bitstreamID", fpga.bitstream_id), ("userPciAddress", fpga.user_bdf if fpga.user_bdf != fn.bdf else None)]  # fmt: skip
    if dev.accel is not None:
        entries.append(("moduleID", dev.accel.module_id))
    return entries


def _utf8(v: str) -> bool:
    """False for a name read via surrogateescape that was not UTF-8 (it cannot be encoded)."""
    try:
        v.encode()
    except UnicodeEncodeError:
        return False
    return True


def _fits(v: str) -> bool:
    return _utf8(v) and 0 < len(v.encode()) <= MAX_VALUE_LENGTH


class Version(str):
    """A semantic version discovery built (``580.159.4``): published as a version value."""


_FIELD_OF = {bool: "bool_", int: "int_", str: "string", Version: "version", tuple: "strings"}


def _publish(out: dict, problems: list[Problem], entries: list[tuple[str, object]]) -> None:
    """Each (name, value) entry's shared value into ``out``: a bool, an integer, a string or a
    tuple of strings; None left out, a string past the limit (or empty) left out with a problem."""
    shared = _SHARED
    for name, v in entries:
        if v is None:
            continue
        field = _FIELD_OF[type(v)]
        if field == "int_" and not _INT64_MIN <= v <= _INT64_MAX:  # the API would refuse the device
            problems.append(Problem(what=name, reason="value not a 64-bit integer"))
            continue
        # the shared value's table looked up here: ~20 values a device, most of them shared
        value = table.get(v) if (table := shared.get(field)) is not None else None
        if value is None:
            value = _new_value(field, str(v) if field == "version" else v)
        if value is None:
            why = "not UTF-8" if field == "string" and not _utf8(v) else f"longer than {MAX_VALUE_LENGTH} bytes"
            problems.append(Problem(what=name, reason=f"value {why}"))
        else:
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
