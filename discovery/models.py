"""The inventory: frozen records of what discovery found. Nothing here does I/O.

Absent values are ``None`` (never -1 or ""); why a value is absent is kept in
``Device.problems`` so an operator can see it in ``sysdra scan``.

Records are frozen, slotted, keyword-only dataclasses: discovery builds every value itself,
with the types already right, so nothing is validated on construction. What comes from
outside goes through a checking constructor (:meth:`AttributeValue.from_api`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["gpu", "nic", "fpga", "accelerator"]
KINDS: tuple[str, ...] = ("gpu", "nic", "fpga", "accelerator")

# Frozen (assignment raises), keyword-only (every constructor names its fields), equal by value.
record = dataclass(frozen=True, slots=True, kw_only=True)


class Record:
    """What every record can do besides its fields."""

    __slots__ = ()

    def replace(self, **changes: Any):
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)


_VALUE_FIELDS = ("int_", "bool_", "string", "version", "ints", "bools", "strings", "versions")
LIST_FIELDS = frozenset(("ints", "bools", "strings", "versions"))
# API name -> (Python field, exact type of the value or of each list item, is a list)
_API_FIELDS = {
    "int": ("int_", int, False), "bool": ("bool_", bool, False),
    "string": ("string", str, False), "version": ("version", str, False),
    "ints": ("ints", int, True), "bools": ("bools", bool, True),
    "strings": ("strings", str, True), "versions": ("versions", str, True),
}  # fmt: skip
_API_NAME = {python: api for api, (python, _, _) in _API_FIELDS.items()}


@record
class AttributeValue(Record):
    """One ResourceSlice DeviceAttribute: exactly one field is set. Python names end in ``_``
    where the API name is a builtin (``int_``); :meth:`to_api` uses the API names."""

    int_: int | None = None
    bool_: bool | None = None
    string: str | None = None
    version: str | None = None
    ints: tuple[int, ...] | None = None
    bools: tuple[bool, ...] | None = None
    strings: tuple[str, ...] | None = None
    versions: tuple[str, ...] | None = None
    # the Python name of the one field set (``int_``, ``strings``, ...), found once
    field: str = dataclasses.field(init=False, repr=False, compare=False)
    # the API encoding, made once: Device.to_api's entries share it (discovery shares equal
    # values, so a large node's ~37,000 attribute entries need ~6,000 encodings); never modify it
    encoded: dict = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_fields = [name for name in _VALUE_FIELDS if getattr(self, name) is not None]
        if len(set_fields) != 1:
            raise ValueError(f"exactly one value field must be set, got {set_fields}")
        if set_fields[0] in LIST_FIELDS and not getattr(self, set_fields[0]):
            raise ValueError(f"list attribute {set_fields[0]} must not be empty")
        object.__setattr__(self, "field", set_fields[0])  # how a frozen dataclass sets a derived field
        object.__setattr__(self, "encoded", self.to_api())

    @property
    def value(self) -> Any:
        return getattr(self, self.field)

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
            return cls(**{name: value})
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key}: expected a list, got {type(value).__name__}")
        if not value:
            raise ValueError(f"list attribute {key} must not be empty")
        for i, item in enumerate(value):
            if type(item) is not item_type:
                raise ValueError(f"{key}[{i}]: expected {item_type.__name__}, got {type(item).__name__}")
        return cls(**{name: tuple(value)})

    def to_api(self) -> dict:
        """The API encoding, a new dict: ``{"int": 3}``, ``{"strings": ["a"]}`` (``encoded`` is the shared one)."""
        value = getattr(self, self.field)
        return {_API_NAME[self.field]: list(value) if self.field in LIST_FIELDS else value}

@record
class DeviceNode(Record):
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


@record
class Problem(Record):
    """Why an attribute or device node is missing (``what`` names it)."""

    what: str
    reason: str


@record
class PciLink(Record):
    max_speed: str | None = None  # max_link_speed, e.g. "16.0 GT/s PCIe"
    max_width: int | None = None  # max_link_width


@record
class Sriov(Record):
    total_vfs: int | None = None  # sriov_totalvfs
    num_vfs: int | None = None  # sriov_numvfs (a VF names its PF: PciFunction.physfn)


@record
class PciFunction(Record):
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


@record
class NetInterface(Record):
    """What is published of a netdev; its link state is health's (agent/health/checks.py)."""

    name: str
    mac: str | None = None
    mtu: int | None = None
    phys_port_name: str | None = None
    speed_mbps: int | None = None  # ``speed`` (None while the link is down): bandwidth of a shared NIC


@record
class RdmaDevice(Record):
    name: str  # mlx5_0
    uverbs: str | None = None  # uverbs0
    rate_gbps: float | None = None  # port 1's ``rate`` ("400 Gb/sec (4X NDR)"): bandwidth of a shared NIC


@record
class MigProfile(Record):
    """A MIG GPU-instance profile as NVML lists it (discovery/mig.py): its engines and the
    placements (start, size in memory slices) an instance of it may take."""

    id: int  # NVML's profile ID (19 for 1g.18gb on an H200), what instances are created with
    name: str  # "1g.18gb", "1g.18gb+me"
    slices: int  # compute slices
    memory_mb: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg: int
    ofa: int
    placements: tuple[tuple[int, int], ...]  # (start, size)


@record
class GpuPartition(Record):
    """One partition the kernel exposes now: an AMD compute partition (``index`` = its KFD
    function number) or an NVIDIA MIG compute instance (``gi``/``ci``)."""

    index: int
    nodes: tuple[DeviceNode, ...] = ()  # its own nodes only: a render node, or MIG cap nodes
    xcds: int | None = None  # AMD: XCCs in this partition (KFD num_xcc)
    gi: int | None = None
    ci: int | None = None
    # static MIG with NVML: the GPU instance's profile and placement (discovery/mig.py)
    profile: MigProfile | None = None
    start: int | None = None


@record
class Partitioning(Record):
    """How a GPU is split now and how it could be (discovery/partitions.py)."""

    kind: Literal["amd", "mig"]
    compute_mode: str | None = None  # AMD: SPX..CPX
    memory_mode: str | None = None  # AMD: NPS1..NPS8
    compute_modes: tuple[str, ...] = ()  # available_compute_partition (empty: cannot switch)
    memory_modes: tuple[str, ...] = ()
    partitions: tuple[GpuPartition, ...] = ()
    xcds: int | None = None  # AMD: the GPU's XCCs (sum over its partitions)
    profiles: tuple[MigProfile, ...] = ()  # MIG through NVML: every profile (dynamic MIG, discovery/mig.py)

    @property
    def switchable(self) -> bool:
        return bool(self.compute_modes)


@record
class NvidiaFacts(Record):
    """What a scheduler selects an NVIDIA GPU on (discovery/nvidia.py), each None when neither
    NVML nor the PCI ID table knows it. Versions are semantic versions ("580.159.4")."""

    product_name: str | None = None
    brand: str | None = None
    architecture: str | None = None
    compute_capability: str | None = None  # "9.0.0"
    driver_version: str | None = None
    cuda_driver_version: str | None = None  # "13.0.0"
    memory_bytes: int | None = None
    addressing_mode: str | None = None  # "None", "HMM", "ATS": how the GPU reaches the host's memory (NVML only)
    source: str = "table"  # "nvml" when NVML answered for this GPU


@record
class GpuInfo(Record):
    vendor: str  # nvidia | amd | intel | other
    drm_card: str | None = None  # card1
    drm_render: str | None = None  # renderD129
    nvidia_minor: int | None = None
    nvidia_uuid: str | None = None
    model: str | None = None
    partitioning: Partitioning | None = None
    nvidia: NvidiaFacts | None = None  # NVML / PCI ID table facts (discovery/nvidia.py)


@record
class NicInfo(Record):
    interfaces: tuple[NetInterface, ...] = ()
    rdma: tuple[RdmaDevice, ...] = ()


@record
class FpgaInfo(Record):
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


@record
class AccelInfo(Record):
    accel: str | None = None  # accel0
    status: str | None = None  # habanalabs status ("operational")
    module_id: int | None = None


@record
class Device(Record):
    """A device we offer through DRA: one PCI function (an Alveo card: two).

    Not hashable (``attributes`` and ``capacity`` are dicts); never modify them: values and
    devices are shared between inventories and the publisher's caches."""

    name: str  # gpu-0000-1b-00-0
    kind: Kind
    pci: PciFunction
    device_nodes: tuple[DeviceNode, ...] = ()
    attributes: dict[str, AttributeValue] = field(default_factory=dict)
    capacity: dict[str, str] = field(default_factory=dict)  # quantities as strings
    gpu: GpuInfo | None = None
    nic: NicInfo | None = None
    fpga: FpgaInfo | None = None
    accel: AccelInfo | None = None
    problems: tuple[Problem, ...] = ()

    def to_api(self) -> dict:
        """The device as a ResourceSlice ``spec.devices[]`` entry (resource.k8s.io/v1): a new
        dict whose attribute values are the values' shared encodings (never modify those)."""
        out: dict = {"name": self.name}
        if self.attributes:
            out["attributes"] = {k: v.encoded for k, v in sorted(self.attributes.items())}
        if self.capacity:
            out["capacity"] = {k: {"value": v} for k, v in sorted(self.capacity.items())}
        return out


@record
class Skipped(Record):
    """A PCI function we looked at but do not offer, with the reason."""

    bdf: str
    reason: str
    class_code: int | None = None
    vendor_id: str | None = None
    device_id: str | None = None
    physfn: str | None = None  # its PF's address when it is a VF: a rescan after its removal reads the PF again


@record
class NumaNode(Record):
    id: int
    cpulist: str | None = None
    distances: tuple[int, ...] = ()
    socket: int | None = None  # physical_package_id of its first CPU


@dataclass(frozen=True, kw_only=True)  # not slotted: its ``__dict__`` keeps the by_name table
class Inventory(Record):
    """What one scan found."""

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
        """``sysdra scan -o json``: devices in ResourceSlice encoding plus kind, device nodes
        and problems."""
        devices = []
        for d in self.devices:
            api = d.to_api()
            entry = {"name": d.name, "kind": d.kind, "attributes": api.get("attributes", {}),
                     "capacity": api.get("capacity", {}),
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
