"""The checkpoint's records as typed models (pydantic v2, strict): a claim's entry and the
record of each host-change step (prepare/steps/). What is read back from disk is untrusted:
every entry is validated against these models when it is loaded (a snapshot or a journal
record), and one that does not fit is moved aside and never used (checkpoint.py).

On disk the records keep their JSON names (``cdiDeviceIDs``, ``from``, ...); the steps read
and write them through these models, never as loose dict keys."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from agent.apilimits import MAX_ATTRIBUTES_AND_CAPACITIES
from agent.names import is_label, is_subdomain, is_uid
from agent.prepare.checkpoint_format import COMPLETED, STARTED
from agent.prepare.netdevs import MAX_ADDRESSES, MAX_ROUTES, Cidr, IfName, IpamConfig, PoolName, Route
from agent.quantity import parse_quantity
from discovery.partitions import COMPUTE_PARTS, MEMORY_PARTS

__all__ = ["COMPLETED", "STARTED", "ClaimEntry", "MigDevice", "MigModeOff", "ModeSwitch", "MpsUse", "NetdevMove", "PartitionUse", "TimeSlice",
           "VfioFunction", "check_entry", "describe", "entry_problem"]

BDF_PATTERN = r"^[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$"
Bdf = Annotated[str, StringConstraints(pattern=BDF_PATTERN)]
KernelDriver = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
Name = Annotated[str, StringConstraints(max_length=253)]


def _mode(text: str) -> str:
    compute, _, memory = text.partition("/")
    if compute not in COMPUTE_PARTS or memory not in MEMORY_PARTS:
        raise ValueError(f"{text[:40]!r} is not a GPU mode such as CPX/NPS1")
    return text


def _quantity(text: str) -> str:
    if parse_quantity(text) < 0:  # QuantityError (a ValueError) names what is wrong
        raise ValueError(f"{text!r} is negative")
    return text


def _label(text: str) -> str:
    if not is_label(text):
        raise ValueError(f"{text[:80]!r} is not a DNS label")
    return text


Mode = Annotated[str, AfterValidator(_mode)]
Label = Annotated[str, AfterValidator(_label)]
Quantity = Annotated[str, AfterValidator(_quantity)]


class Record(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, populate_by_name=True)

    def dump(self) -> dict:
        """The JSON form written to the checkpoint (names as on disk)."""
        return self.model_dump(by_alias=True)


# --- step records ---------------------------------------------------------------------------
class VfioFunction(Record):
    """A function moved to vfio-pci: what to give it back to. ``pending``: a write for it (the
    unbind from a driver that waits for the device's users) did not return: the kernel may
    still finish it, so it is given back only once no write for it is in flight. ``probe``: an
    adopted claim's (its record lost): the driver before is unknown, so it is given back to the
    one the kernel matches for it (``drivers_probe``)."""

    bdf: Bdf
    group: int
    driver: KernelDriver | None = None
    override: KernelDriver | None = None
    pending: bool = False
    probe: bool = False

    def dump(self) -> dict:
        out = super().dump()
        for flag in ("pending", "probe"):  # the entry as a sysdra without the field writes (and reads) it
            if not out[flag]:
                del out[flag]
        return out


class ModeSwitch(Record):
    """A GPU mode switch under way (its intent, durable before the first kernel write)."""

    gpu: Bdf
    from_: Mode = Field(alias="from")
    to: Mode


class PartitionUse(Record):
    """The GPUs (PCI address -> mode) a claim's partitions run in, and a pending switch."""

    uses: dict[Bdf, Mode]
    switch: ModeSwitch | None = None

    def dump(self) -> dict:
        return self.model_dump(by_alias=True, exclude_none=True)  # no switch once it is done


class MigDevice(Record):
    """A MIG device a claim creates (dynamic MIG): the GPU, profile and placement, durable
    before NVML is asked; the GPU and compute instance IDs NVML gave, once created. The
    placement, not the IDs, finds the instance again (placements never overlap)."""

    gpu: Bdf
    device: Name  # the way's device name (discovery/gpuways.py)
    profile: Annotated[int, Field(ge=0, lt=256)]  # NVML's GI profile ID
    start: Annotated[int, Field(ge=0, lt=16)]  # placement, in memory slices
    size: Annotated[int, Field(ge=1, le=16)]
    gi: Annotated[int, Field(ge=0, lt=64)] | None = None
    ci: Annotated[int, Field(ge=0, lt=64)] | None = None


class MigModeOff(Record):
    """A GPU whose MIG mode a claim of its whole GPU (or a share of it) needs off: the whole GPU
    of a GPU in MIG mode is no CUDA device (prepare/steps/migmode.py). Durable before NVML is
    asked; only where the agent turns MIG mode off for the claim, or took it over from the prepared
    claims of the whole GPU that did, or for an adopted claim. ``restore``: the mode the GPU was to
    have (its pending mode) was on before them: the last of them to go turns it back on; false for
    an operator's off pending a reset, and for an adopted claim (the mode before it is unknown)."""

    gpu: Bdf
    restore: bool


GpuUuid = Annotated[str, StringConstraints(pattern=r"^(GPU|MIG)-[0-9A-Za-z-]{1,64}$")]


class MpsUse(Record):
    """The NVIDIA GPUs (UUIDs) whose MPS control daemon this claim's shares are clients of."""

    gpus: list[GpuUuid]


class TimeSlice(Record):
    """A GPU whose time slice this claim set (and set back to Default when it goes)."""

    gpu: GpuUuid
    interval: Literal["Default", "Short", "Medium", "Long"]


SandboxId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,128}$")]
# "/" and 1-4,095 characters, none NUL. The length is max_length's, not a bounded repetition in the
# pattern: pydantic-core's regex engine builds one automaton state per repeat of the class, ~0.9 MB
# for {1,4095}, in every model that holds the field (~4.7 MB of the idle agent).
NetnsPath = Annotated[str, StringConstraints(max_length=4096, pattern=r"^/[^\x00]+$")]
# a sandbox's pod, namespace/name (a DNS label, a DNS subdomain): an IPAM plugin's K8S_POD_NAMESPACE, K8S_POD_NAME
PodRef = Annotated[str, StringConstraints(max_length=317, pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?/[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$")]
MAC_PATTERN = r"^[0-9a-f]{2}(:[0-9a-f]{2}){5,31}$"
Mac = Annotated[str, StringConstraints(pattern=MAC_PATTERN)]
RdmaName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,63}$")]
BUS_DEVICE_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}$"  # a PCI address, virtio0, ...
BusDevice = Annotated[str, StringConstraints(pattern=BUS_DEVICE_PATTERN)]


class NetdevMove(Record):
    """One netdev of a claim for its pod (prepare/steps/netdev.py), owned by the claim from
    prepare to unprepare. ``state``: ``planned`` (on the host under ``host``), ``moving`` (saved
    before the kernel is touched: it may be in ``netns`` already), ``in-pod`` (in ``netns`` as
    ``pod``, configured), ``returning`` (saved before it goes back: it may be back). Which link
    is the netdev, whatever its name now (the pod may rename it, the kernel returns it as
    ``dev<index>`` when its name is taken, another link may take its names), is read before it
    first moves (prepare/netmove.py ``identify``): ``parent`` (its bus device: a NIC's netdev,
    never a link the pod made), else ``index`` and ``mac``; ``hostMtu`` is set again when it
    comes back. ``rdma``: the RDMA device that moves with it (exclusive RDMA netns mode only).
    ``allowHostInUse``: the claim's ``NicConfig`` said so (each move checks the host's use again).
    ``ipamPool``: the node's IPAM pool its addresses come from, ``leased`` (and ``leasedRoutes``)
    what the pool gave for ``sandbox`` (prepare/ipam.py), beside the config's ``addresses``;
    ``ipamConfig``: the pool's configuration the sandbox's lease is asked and given back with."""

    device: Name
    request: Name
    bdf: Bdf | None = None  # the NIC's function, held for the claim (ownership.py)
    host: IfName
    pod: IfName
    mtu: int | None = Field(default=None, ge=68, le=65535)
    addresses: list[Cidr] = Field(default_factory=list, max_length=MAX_ADDRESSES)
    routes: list[Route] = Field(default_factory=list, max_length=MAX_ROUTES)
    rdma: RdmaName | None = None
    allowHostInUse: bool = False
    ipamPool: PoolName | None = None
    leased: list[Cidr] = Field(default_factory=list, max_length=MAX_ADDRESSES)  # the pool's lease for ``sandbox``
    leasedRoutes: list[Route] = Field(default_factory=list, max_length=MAX_ROUTES)
    ipamConfig: IpamConfig | None = None  # recorded before the ADD: the DEL uses it, whatever the pool says by then
    state: Literal["planned", "moving", "in-pod", "returning"] = "planned"
    sandbox: SandboxId | None = None
    netns: NetnsPath | None = None
    podRef: PodRef | None = None  # the sandbox's pod (namespace/name): the CNI_ARGS its lease is asked and given back with
    mac: Mac | None = None
    index: int | None = Field(default=None, ge=1, le=2**31 - 1)
    parent: BusDevice | None = None
    hostMtu: int | None = Field(default=None, ge=68, le=65535)

    def dump(self) -> dict:
        return self.model_dump(exclude_defaults=True)

    def changed(self, **fields) -> NetdevMove:
        """A copy with ``fields`` changed, validated as a loaded record is (what the runtime and
        the kernel said goes into the checkpoint only as a valid record: ValidationError)."""
        return NetdevMove.model_validate({**self.model_dump(), **fields})

    @property
    def away(self) -> bool:
        """The kernel may have it in a pod's namespace."""
        return self.state != "planned"


# --- the claim's entry ------------------------------------------------------------------------
class DeviceRecord(Record):
    requests: list[Name]
    pool: Name
    device: Name
    cdiDeviceIDs: list[str]
    shareID: Name | None = None
    cdiEnv: list[str] | None = None
    adminAccess: bool | None = None  # DRA admin access (prepare/ownership.py); omitted when not
    # a share's consumedCapacity, accounted against the device's capacities (prepare/ownership.py)
    consumedCapacity: Annotated[dict[Name, Quantity], Field(max_length=MAX_ATTRIBUTES_AND_CAPACITIES)] | None = None


class CdiSpecRecord(Record):
    path: str
    spec: dict


class MetadataRecord(Record):
    model_config = ConfigDict(strict=True, extra="allow", frozen=True)
    podClaimName: Label | None = None
    requests: dict[Label, dict]


class ClaimEntry(Record):
    """One claim's entry, as written by the driver (adopted claims have empty names)."""

    state: Literal["PrepareStarted", "PrepareCompleted"]
    namespace: str
    name: str
    bootID: str | None = None
    allocation: str = ""
    devices: list[DeviceRecord]
    cdiSpec: CdiSpecRecord | None = None
    metadata: MetadataRecord | None = None
    deviceStatus: list[dict] | None = None
    vfio: list[VfioFunction] | None = None
    partitions: PartitionUse | None = None
    mig: list[MigDevice] | None = None
    migMode: list[MigModeOff] | None = None
    mps: MpsUse | None = None
    timeslice: list[TimeSlice] | None = None
    netdevs: list[NetdevMove] | None = None  # moved into the pod by agent/nri/netdev.py
    pods: list[str] | None = None  # the pods the claim is reserved for
    # an adopted claim whose netdev records were lost with a damaged or invalid entry (why, where it
    # was kept): its pods are refused, nothing is moved on a guess (prepare/recovery.py)
    netdevsLost: str | None = Field(default=None, max_length=1024)


def check_entry(uid: object, entry: object) -> ClaimEntry:
    """``entry`` checked as a claim's entry -> its typed form; ValueError (pydantic's
    ValidationError is one) naming what is wrong. Names become paths, so they must have their
    Kubernetes formats; empty namespace/name is an adopted claim's."""
    if not isinstance(uid, str) or not is_uid(uid):
        raise ValueError(f"claim key {str(uid)[:80]!r} is not a UID")
    typed = ClaimEntry.model_validate(entry)
    if (typed.namespace or typed.name) and not (is_label(typed.namespace) and is_subdomain(typed.name)):
        raise ValueError(f"claim {uid}: namespace/name {typed.namespace[:80]!r}/{typed.name[:80]!r} are not Kubernetes names")
    return typed


def entry_problem(uid: object, entry: object) -> str | None:
    """Why ``entry`` is not a claim's entry as we write them (one line), or None."""
    try:
        check_entry(uid, entry)
    except ValueError as err:
        return describe(err)
    return None


def describe(err: ValueError) -> str:
    """``check_entry``'s error in one line of at most 500 characters."""
    if isinstance(err, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())[:500]
    return " ".join(str(err).split())[:500]
