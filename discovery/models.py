"""The inventory: frozen records of what discovery found. Nothing here does I/O.

Absent values are ``None`` (never -1 or ""); why a value is absent is kept in
``Device.problems`` so an operator can see it in ``sysdra scan``.
"""

from __future__ import annotations

from functools import cached_property
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

Kind = Literal["gpu", "nic", "fpga", "accelerator"]
KINDS: tuple[str, ...] = ("gpu", "nic", "fpga", "accelerator")


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


_VALUE_FIELDS = ("int_", "bool_", "string", "version", "ints", "bools", "strings", "versions")


class AttributeValue(Frozen):
    """One ResourceSlice DeviceAttribute: exactly one field is set.

    Python names end in ``_`` where the API name is a builtin; ``to_api`` uses the API names.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    int_: Optional[int] = Field(None, alias="int")
    bool_: Optional[bool] = Field(None, alias="bool")
    string: Optional[str] = None
    version: Optional[str] = None
    ints: Optional[tuple[int, ...]] = None
    bools: Optional[tuple[bool, ...]] = None
    strings: Optional[tuple[str, ...]] = None
    versions: Optional[tuple[str, ...]] = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "AttributeValue":
        set_fields = [k for k, v in self.__dict__.items() if v is not None]
        if len(set_fields) != 1:
            raise ValueError(f"exactly one value field must be set, got {set_fields}")
        for k in ("ints", "bools", "strings", "versions"):
            if getattr(self, k) == ():
                raise ValueError(f"list attribute {k} must not be empty")
        return self

    def _item(self) -> tuple[str, object]:
        d = self.__dict__  # the fields, and ``api`` once it was asked for
        (key, value), = ((k, d[k]) for k in _VALUE_FIELDS if d[k] is not None)
        return key.rstrip("_"), value

    def to_api(self) -> dict:
        key, value = self._item()
        return {key: list(value) if isinstance(value, tuple) else value}

    @cached_property
    def api(self) -> dict:
        """``to_api()`` built once. Discovery shares value objects between devices, and so
        every device's slice entry shares this dict: read-only (entries are encoded, never
        modified). A large node's pool is ~6 MB smaller for it."""
        return self.to_api()

    @classmethod
    def from_api(cls, data: dict) -> "AttributeValue":
        return cls.model_validate(data)

    @classmethod
    def trusted(cls, field: str, value) -> "AttributeValue":
        """A value discovery built itself (type already right, one field). Plain validation:
        pydantic-core checks it in ~2 us, model_construct takes three times that."""
        return cls(**{field: value})

    @property
    def value_count(self) -> int:
        """How many values this attribute counts for against the 48-value limit."""
        _, value = self._item()
        return len(value) if isinstance(value, tuple) else 1

    @property
    def is_list(self) -> bool:
        return any(getattr(self, k) is not None for k in ("ints", "bools", "strings", "versions"))


class DeviceNode(Frozen):
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
    source: str = Field(description="where major:minor came from: dev node, sysfs dev file, /proc/devices")


class Problem(Frozen):
    """Why an attribute or device node is missing (``what`` names it)."""

    what: str
    reason: str


class PciLink(Frozen):
    max_speed: str | None = None  # max_link_speed, e.g. "16.0 GT/s PCIe"
    max_width: int | None = None  # max_link_width


class Sriov(Frozen):
    total_vfs: int | None = None  # sriov_totalvfs
    num_vfs: int | None = None  # sriov_numvfs
    vfs: tuple[str, ...] = ()  # virtfnN targets (BDFs), by N


class PciFunction(Frozen):
    bdf: str  # "0000:1b:00.0"; the domain may have 5+ hex digits (VMD)
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


class NetInterface(Frozen):
    """What is published of a netdev; its link state is health's (agent/health/checks.py)."""

    name: str
    mac: str | None = None
    mtu: int | None = None
    phys_port_name: str | None = None
    speed_mbps: int | None = None  # ``speed`` (None while the link is down): bandwidth of a shared NIC


class RdmaDevice(Frozen):
    name: str  # mlx5_0
    uverbs: str | None = None  # uverbs0
    rate_gbps: float | None = None  # port 1's ``rate`` ("400 Gb/sec (4X NDR)"): bandwidth of a shared NIC


class GpuPartition(Frozen):
    """One partition the kernel exposes now: an AMD compute partition (``index`` = its KFD
    function number) or an NVIDIA MIG compute instance (``gi``/``ci``)."""

    index: int
    nodes: tuple[DeviceNode, ...] = ()  # its own nodes only: a render node, or MIG cap nodes
    xcds: int | None = None  # AMD: XCCs in this partition (KFD num_xcc)
    gi: int | None = None
    ci: int | None = None


class Partitioning(Frozen):
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


class GpuInfo(Frozen):
    vendor: str  # nvidia | amd | intel | other
    drm_card: str | None = None  # card1
    drm_render: str | None = None  # renderD129
    nvidia_minor: int | None = None
    nvidia_uuid: str | None = None
    model: str | None = None
    partitioning: Partitioning | None = None


class NicInfo(Frozen):
    interfaces: tuple[NetInterface, ...] = ()
    rdma: tuple[RdmaDevice, ...] = ()


class FpgaInfo(Frozen):
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


class AccelInfo(Frozen):
    accel: str | None = None  # accel0
    status: str | None = None  # habanalabs status ("operational")
    module_id: int | None = None


class Device(Frozen):
    """A device we offer through DRA: one PCI function (an Alveo card: two)."""

    name: str  # gpu-0000-1b-00-0
    kind: Kind
    pci: PciFunction
    device_nodes: tuple[DeviceNode, ...] = ()
    attributes: dict[str, AttributeValue] = Field(default_factory=dict)
    capacity: dict[str, str] = Field(default_factory=dict)  # quantities as strings
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


class Skipped(Frozen):
    """A PCI function we looked at but do not offer, with the reason."""

    bdf: str
    reason: str
    class_code: int | None = None
    vendor_id: str | None = None
    device_id: str | None = None


class NumaNode(Frozen):
    id: int
    cpulist: str | None = None
    distances: tuple[int, ...] = ()
    socket: int | None = None  # physical_package_id of its first CPU


class Inventory(Frozen):
    root: str
    devices: tuple[Device, ...] = ()
    skipped: tuple[Skipped, ...] = ()
    numa_nodes: tuple[NumaNode, ...] = ()
    problems: tuple[Problem, ...] = ()  # node-wide (no /sys/bus/pci, unreadable /proc/devices ...)

    def by_name(self) -> dict[str, Device]:
        """Name -> device; built once per inventory (prepare looks devices up on every call).
        Callers must not modify the returned dict."""
        return self._by_name

    @cached_property
    def _by_name(self) -> dict[str, Device]:
        return {d.name: d for d in self.devices}

    def to_json(self) -> dict:
        """``sysdra scan -o json``: devices in ResourceSlice encoding plus device nodes."""
        devices = []
        for d in self.devices:  # the shared, read-only ``AttributeValue.api`` dicts: this is only encoded
            entry = {"name": d.name, "kind": d.kind,
                     "attributes": {k: v.api for k, v in sorted(d.attributes.items())},
                     "capacity": {k: {"value": v} for k, v in sorted(d.capacity.items())},
                     "deviceNodes": [{"path": n.path, "type": n.type, "major": n.major, "minor": n.minor}
                                     for n in d.device_nodes]}  # fmt: skip
            if d.problems:
                entry["problems"] = [{"what": p.what, "reason": p.reason} for p in d.problems]
            devices.append(entry)
        skipped = [{"bdf": s.bdf, "reason": s.reason} for s in self.skipped]
        out = {"devices": devices, "skipped": skipped}
        if self.problems:
            out["problems"] = [p.model_dump() for p in self.problems]
        return out
