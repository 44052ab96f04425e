"""The inventory: frozen records of what discovery found. Nothing here does I/O.

Absent values are ``None`` (never -1 or ""); why a value is absent is kept in
``Device.problems`` so an operator can see it in ``sysdra scan``.

Records are msgspec Structs, frozen and keyword-only: discovery builds every value itself,
with the types already right, so nothing is validated on construction (pydantic cost a
whole-process scan ~100 ms of imports and ~13 MB of the agent's memory), and a Struct is
built in C (~6x faster than a frozen dataclass; its class ~20x faster, which was ~12 ms of
every start). What comes from outside goes through a checking constructor
(:meth:`AttributeValue.from_api`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

Kind = Literal["gpu", "nic", "fpga", "accelerator"]
KINDS: tuple[str, ...] = ("gpu", "nic", "fpga", "accelerator")



class Record(msgspec.Struct, frozen=True, gc=False):
    """Frozen (assignment raises AttributeError) and, each record declared ``kw_only``
    (msgspec applies it to a class's own fields), keyword-only, so every constructor names
    its fields; equality and hashing by value. Not tracked by the cyclic collector (``gc``):
    records hold only values and other records, never a cycle."""

    def replace(self, **changes: Any):
        """A copy with ``changes``."""
        return msgspec.structs.replace(self, **changes)


_VALUE_FIELDS = ("int_", "bool_", "string", "version", "ints", "bools", "strings", "versions")
_LIST_FIELDS = ("ints", "bools", "strings", "versions")
# API name -> (Python field, exact type of the value or of each list item, is a list)
_API_FIELDS = {
    "int": ("int_", int, False), "bool": ("bool_", bool, False),
    "string": ("string", str, False), "version": ("version", str, False),
    "ints": ("ints", int, True), "bools": ("bools", bool, True),
    "strings": ("strings", str, True), "versions": ("versions", str, True),
}
_API_KEY = {f: f.rstrip("_") for f in _VALUE_FIELDS}  # Python field -> API name
_set = object.__setattr__  # how a frozen record's own constructor stores its fields


def _value_of(name: str) -> property:
    return property(lambda self: self.value if self.field == name else None,
                    doc=f"The value if the field set is {name}, else None.")


@dataclass(frozen=True, slots=True, init=False)
class AttributeValue:
    """One ResourceSlice DeviceAttribute: exactly one field is set.

    Stored as that field's Python name and its value (three slots, so the ~6,000 distinct
    values of a large node are built in a few µs each); ``int_``, ``string``, ... read it
    back, None for the others. Python names end in ``_`` where the API name is a builtin; the
    constructor also takes the API names (``AttributeValue(int=1)``), and ``to_api`` uses them.
    """

    field: str  # the one field set: "int_", "bool_", "string", "version", "ints", ...
    value: Any
    # ``to_api()``, built with the value. Discovery shares value objects between devices, and
    # so every device's slice entry shares this dict: read-only (entries are encoded, never
    # modified). A slot, not a property: read ~40,000 times per pool or ``scan -o json``.
    api: dict = field(repr=False, compare=False)

    int_ = _value_of("int_")
    bool_ = _value_of("bool_")
    string = _value_of("string")
    version = _value_of("version")
    ints = _value_of("ints")
    bools = _value_of("bools")
    strings = _value_of("strings")
    versions = _value_of("versions")

    def __init__(self, *, int_: int | None = None, bool_: bool | None = None, string: str | None = None,
                 version: str | None = None, ints: tuple[int, ...] | None = None, bools: tuple[bool, ...] | None = None,
                 strings: tuple[str, ...] | None = None, versions: tuple[str, ...] | None = None, **api_names):
        if api_names:
            int_, bool_ = _api_names(api_names, int_, bool_)
        values = (int_, bool_, string, version, ints, bools, strings, versions)
        set_fields = [(name, value) for name, value in zip(_VALUE_FIELDS, values) if value is not None]
        if len(set_fields) != 1:
            raise ValueError(f"exactly one value field must be set, got {[name for name, _ in set_fields]}")
        (name, value), = set_fields
        if name in _LIST_FIELDS and not value:
            raise ValueError(f"list attribute {name} must not be empty")
        _fill(self, name, value)

    @classmethod
    def trusted(cls, field: str, value) -> AttributeValue:
        """A value discovery built itself: ``field`` is a Python field name and ``value`` of its
        type (a non-empty tuple for a list). Nothing is checked."""
        out = cls.__new__(cls)  # _fill written out: ~5,850 distinct values per large-node scan
        _set(out, "field", field)
        _set(out, "value", value)
        _set(out, "api", {_API_KEY[field]: list(value) if isinstance(value, tuple) else value})
        return out

    @classmethod
    def from_api(cls, data: dict) -> AttributeValue:
        """A DeviceAttribute from outside (API encoding, e.g. ``{"int": 3}``), checked strictly:
        exactly one field, the value of exactly its type (a bool is not an int), lists
        non-empty and of that type throughout. Raises ValueError naming what is wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"attribute value must be an object, got {type(data).__name__}")
        items = [(k, v) for k, v in data.items() if v is not None]  # JSON null: not set (as Go decodes it)
        unknown = sorted(str(k) for k in data if k not in _API_FIELDS)
        if unknown:
            raise ValueError(f"unknown attribute value field(s) {unknown}")
        if len(items) != 1:
            raise ValueError(f"exactly one value field must be set, got {sorted(k for k, _ in items)}")
        (key, value), = items
        name, item_type, is_list = _API_FIELDS[key]
        if not is_list:
            if type(value) is not item_type:
                raise ValueError(f"{key}: expected {item_type.__name__}, got {type(value).__name__}")
            return cls.trusted(name, value)
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key}: expected a list, got {type(value).__name__}")
        if not value:
            raise ValueError(f"list attribute {key} must not be empty")
        for i, item in enumerate(value):
            if type(item) is not item_type:
                raise ValueError(f"{key}[{i}]: expected {item_type.__name__}, got {type(item).__name__}")
        return cls.trusted(name, tuple(value))

    def to_api(self) -> dict:
        """The API encoding as a new dict (``api`` is the shared one)."""
        return _encode(self.field, self.value)

    @property
    def value_count(self) -> int:
        """How many values this attribute counts for against the 48-value limit."""
        return len(self.value) if isinstance(self.value, tuple) else 1

    @property
    def is_list(self) -> bool:
        return self.field in _LIST_FIELDS


def _encode(field: str, value) -> dict:
    return {_API_KEY[field]: list(value) if isinstance(value, tuple) else value}


def _fill(value_obj: AttributeValue, field: str, value) -> None:
    """Store a value's three slots, as a frozen record's own constructor does."""
    _set(value_obj, "field", field)
    _set(value_obj, "value", value)
    _set(value_obj, "api", _encode(field, value))


def _api_names(api_names: dict, int_, bool_) -> tuple:
    """``int=``/``bool=``, the API names of ``int_``/``bool_`` (a builtin cannot be a parameter)."""
    unknown = set(api_names) - {"int", "bool"}
    if unknown:
        raise TypeError(f"AttributeValue got unexpected keyword argument(s) {sorted(unknown)}")
    if ("int" in api_names and int_ is not None) or ("bool" in api_names and bool_ is not None):
        raise TypeError("AttributeValue got a field under both its names")
    return api_names.get("int", int_), api_names.get("bool", bool_)


class DeviceNode(Record, kw_only=True):
    """A device node a container needs.

    ``path`` is where the node lives on the node and inside the container
    (``/dev/dri/renderD128``); ``host_path`` is the same file under the scan root
    (differs from ``path`` only when the root is not ``/``).
    """

    path: str
    host_path: str
    type: Literal["c", "b"] = "c"
    major: int
    minor: int
    source: str  # where major:minor came from: dev node, sysfs dev file, /proc/devices


class Problem(Record, kw_only=True):
    """Why an attribute or device node is missing (``what`` names it)."""

    what: str
    reason: str


class PciLink(Record, kw_only=True):
    max_speed: str | None = None  # max_link_speed, e.g. "16.0 GT/s PCIe"
    max_width: int | None = None  # max_link_width


class Sriov(Record, kw_only=True):
    total_vfs: int | None = None  # sriov_totalvfs
    num_vfs: int | None = None  # sriov_numvfs (a VF names its PF: PciFunction.physfn)


class PciFunction(Record, kw_only=True):
    bdf: str  # "0000:1b:00.0" as pci.BDF_RE takes it; the domain may have 5+ hex digits (VMD)
    sysfs_path: str  # resolved /sys/devices/... path (node view)
    pcie_root: str | None  # "pci0000:00": first component below /sys/devices
    bridges: tuple[str, ...] = ()  # BDFs between the root complex and this function
    vendor_id: str  # 4 lower-case hex digits
    device_id: str
    subsystem_vendor_id: str | None = None
    subsystem_device_id: str | None = None
    class_code: int  # 0x030200
    driver: str | None = None  # basename of the driver link
    numa_node: int | None = None  # None when missing or -1
    iommu_group: int | None = None
    link: PciLink = PciLink()
    sriov: Sriov | None = None  # set on SR-IOV capable PFs
    physfn: str | None = None  # PF's BDF when this function is a VF

    @property
    def is_vf(self) -> bool:
        return self.physfn is not None


class NetInterface(Record, kw_only=True):
    """What is published of a netdev; its link state is health's (agent/health/checks.py)."""

    name: str
    mac: str | None = None
    mtu: int | None = None
    phys_port_name: str | None = None
    speed_mbps: int | None = None  # ``speed`` (None while the link is down): bandwidth of a shared NIC


class RdmaDevice(Record, kw_only=True):
    name: str  # mlx5_0
    uverbs: str | None = None  # uverbs0
    rate_gbps: float | None = None  # port 1's ``rate`` ("400 Gb/sec (4X NDR)"): bandwidth of a shared NIC


class GpuPartition(Record, kw_only=True):
    """One partition the kernel exposes now: an AMD compute partition (``index`` = its KFD
    function number) or an NVIDIA MIG compute instance (``gi``/``ci``)."""

    index: int
    nodes: tuple[DeviceNode, ...] = ()  # its own nodes only: a render node, or MIG cap nodes
    xcds: int | None = None  # AMD: XCCs in this partition (KFD num_xcc)
    gi: int | None = None
    ci: int | None = None


class Partitioning(Record, kw_only=True):
    """How a GPU is split now and how it could be (discovery/partitions.py)."""

    kind: Literal["amd", "mig"]
    compute_mode: str | None = None  # AMD: SPX..CPX
    memory_mode: str | None = None  # AMD: NPS1..NPS8
    compute_modes: tuple[str, ...] = ()  # available_compute_partition (empty: cannot switch)
    memory_modes: tuple[str, ...] = ()
    partitions: tuple[GpuPartition, ...] = ()
    xcds: int | None = None  # AMD: the GPU's XCCs (sum over its partitions)

    @property
    def switchable(self) -> bool:
        return bool(self.compute_modes)


class NvidiaFacts(Record, kw_only=True):
    """What a scheduler selects an NVIDIA GPU on (discovery/nvidia.py), each None when neither
    NVML nor the PCI ID table knows it. Versions are semantic versions ("580.159.4")."""

    product_name: str | None = None
    brand: str | None = None
    architecture: str | None = None
    compute_capability: str | None = None  # "9.0.0"
    driver_version: str | None = None
    cuda_driver_version: str | None = None  # "13.0.0"
    memory_bytes: int | None = None
    source: str = "table"  # "nvml" when NVML answered for this GPU


class GpuInfo(Record, kw_only=True):
    vendor: str  # nvidia | amd | intel | other
    drm_card: str | None = None  # card1
    drm_render: str | None = None  # renderD129
    nvidia_minor: int | None = None
    nvidia_uuid: str | None = None
    model: str | None = None
    partitioning: Partitioning | None = None
    nvidia: NvidiaFacts | None = None  # NVML / PCI ID table facts (discovery/nvidia.py)


class NicInfo(Record, kw_only=True):
    interfaces: tuple[NetInterface, ...] = ()
    rdma: tuple[RdmaDevice, ...] = ()


class FpgaInfo(Record, kw_only=True):
    family: Literal["dfl", "alveo", "other"]
    # Intel DFL
    region: str | None = None  # fpga_region/regionN
    fme: str | None = None  # dfl-fme.N
    port: str | None = None  # dfl-port.N
    afu_id: str | None = None
    interface_id: str | None = None  # PR region compat_id
    bitstream_id: str | None = None
    # Xilinx Alveo (one device = mgmt PF + user PF of one card)
    mgmt_bdf: str | None = None
    user_bdf: str | None = None
    mgmt_instance: int | None = None
    ready: bool | None = None


class AccelInfo(Record, kw_only=True):
    accel: str | None = None  # accel0
    status: str | None = None  # habanalabs status ("operational")
    module_id: int | None = None


class Device(Record, kw_only=True):
    """A device we offer through DRA: one PCI function (an Alveo card: two).

    Not hashable (``attributes`` and ``capacity`` are dicts); never modify them: values and
    devices are shared between inventories and the publisher's caches."""

    name: str  # gpu-0000-1b-00-0
    kind: Kind
    pci: PciFunction
    device_nodes: tuple[DeviceNode, ...] = ()
    attributes: dict[str, AttributeValue] = {}
    capacity: dict[str, str] = {}  # quantities as strings
    gpu: GpuInfo | None = None
    nic: NicInfo | None = None
    fpga: FpgaInfo | None = None
    accel: AccelInfo | None = None
    problems: tuple[Problem, ...] = ()

    def to_api(self) -> dict:
        """The device as a ResourceSlice ``spec.devices[]`` entry (resource.k8s.io/v1)."""
        out: dict = {"name": self.name}
        if self.attributes:
            out["attributes"] = {k: v.to_api() for k, v in sorted(self.attributes.items())}
        if self.capacity:
            out["capacity"] = {k: {"value": v} for k, v in sorted(self.capacity.items())}
        return out


class Skipped(Record, kw_only=True):
    """A PCI function we looked at but do not offer, with the reason."""

    bdf: str
    reason: str
    class_code: int | None = None
    vendor_id: str | None = None
    device_id: str | None = None


class NumaNode(Record, kw_only=True):
    id: int
    cpulist: str | None = None
    distances: tuple[int, ...] = ()
    socket: int | None = None  # physical_package_id of its first CPU


class Inventory(Record, kw_only=True, gc=True, dict=True):
    """What one scan found. ``dict=True``: room for the ``by_name`` table beside the fields."""

    root: str
    devices: tuple[Device, ...] = ()
    skipped: tuple[Skipped, ...] = ()
    numa_nodes: tuple[NumaNode, ...] = ()
    problems: tuple[Problem, ...] = ()  # node-wide (no /sys/bus/pci, unreadable /proc/devices ...)

    def by_name(self) -> dict[str, Device]:
        """Name -> device; built once per inventory (prepare looks devices up on every call).
        Callers must not modify the returned dict."""
        table = self.__dict__.get("by_name_table")
        if table is None:
            table = self.__dict__["by_name_table"] = {d.name: d for d in self.devices}
        return table

    def to_json(self) -> dict:
        """``sysdra scan -o json``: devices in ResourceSlice encoding plus device nodes."""
        devices = []
        for d in self.devices:  # the shared, read-only ``AttributeValue.api`` dicts: this is only encoded
            attrs, cap = d.attributes, d.capacity  # keys sorted, not items: no tuple per entry
            entry = {"name": d.name, "kind": d.kind,
                     "attributes": {k: attrs[k].api for k in sorted(attrs)},
                     "capacity": {k: {"value": cap[k]} for k in sorted(cap)} if cap else {},
                     "deviceNodes": [{"path": n.path, "type": n.type, "major": n.major, "minor": n.minor}
                                     for n in d.device_nodes]}  # fmt: skip
            if d.problems:
                entry["problems"] = [{"what": p.what, "reason": p.reason} for p in d.problems]
            devices.append(entry)
        skipped = [{"bdf": s.bdf, "reason": s.reason} for s in self.skipped]
        out = {"devices": devices, "skipped": skipped}
        if self.problems:
            out["problems"] = [{"what": p.what, "reason": p.reason} for p in self.problems]
        return out
