"""The claim's opaque configuration for this driver: a small versioned schema.

A ResourceClaim's ``status.allocation.devices.config`` holds the configs the allocator copied
from the DeviceClass (``source: FromClass``) and from the claim (``FromClaim``), each
``{requests: [...], opaque: {driver, parameters}}``. Ours are decoded here, strictly: an unknown
apiVersion, kind or field, or a value of the wrong type, is that claim's error (``ClaimFailed``),
never a guess. Precedence is upstream's (the dra-example-driver's helper, as the NVIDIA and AMD
drivers do it): class configs first, then claim configs, each in their order; for one allocation
result the last config that applies to its request wins. A config with no ``requests`` applies to
every request (of a device kind it is for, see ``config_for``); ``req`` also covers ``req/sub``.

Kinds (docs/claim-config.md documents every field; later issues add theirs to ``KINDS``):

- ``GpuConfig`` — GPUs: ``sharing.mpsLimits`` and extra ``env``.
- ``NicConfig`` — NICs: extra ``env``; the netdev's name, MTU, addresses and routes in the pod
  (docs/networking.md).
- ``VfioConfig`` — any PCI function: hand it to a VM bound to vfio-pci (docs/vfio.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, Union

import orjson
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator

from agent.apilimits import MAX_ALLOCATION_CONFIGS, MAX_OPAQUE_PARAMETERS_BYTES
from agent.kubeletplugin.types import base_request
from agent.prepare.allocation import ClaimFailed, allocated
from agent.prepare.netdevs import MAX_ADDRESSES, MAX_ROUTES, Cidr, IfName, PoolName, Route

API_VERSION = "sysdra.io/v1alpha1"
MAX_ENV = 32
RESERVED_ENV = ("SYSDRA_", "CUDA_MPS_")  # the driver's own variables (docs/sharing.md)


def _not_reserved(name: str) -> str:
    if name.startswith(RESERVED_ENV):
        raise ValueError(f"{name}: names starting with {' or '.join(RESERVED_ENV)} are the driver's own")
    return name


def _no_nul(value: str) -> str:
    # a process's environment is NUL-terminated strings: runc refuses to start the container
    if "\x00" in value:
        raise ValueError("a NUL character cannot be in a container's environment")
    return value


# a POSIX-portable variable name
EnvName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"), AfterValidator(_not_reserved)]
EnvValue = Annotated[str, StringConstraints(max_length=4096), AfterValidator(_no_nul)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class TimeSlicing(_Strict):
    interval: Literal["Default", "Short", "Medium", "Long"] = "Default"


class GpuSharing(_Strict):
    """How a share of a GPU (consumable capacity, docs/sharing.md) is handed to the container."""

    # NVIDIA: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE / CUDA_MPS_PINNED_DEVICE_MEM_LIMIT from the share;
    # they bind a process only when the node runs an MPS control daemon the container reaches
    mpsLimits: bool = True
    # NVIDIA, a whole GPU that several pods of one claim share: the driver's time slice for its
    # processes (nvidia-smi compute-policy --set-timeslice; docs/sharing.md, "Time-slicing")
    strategy: Literal["TimeSlicing"] | None = None
    timeSlicingConfig: TimeSlicing | None = None


class _Kind(_Strict):
    apiVersion: Literal["sysdra.io/v1alpha1"]
    # extra environment variables for the container, on each device the config applies to
    env: dict[EnvName, EnvValue] = Field(default_factory=dict, max_length=MAX_ENV)


class GpuConfig(_Kind):
    kind: Literal["GpuConfig"]
    sharing: GpuSharing = GpuSharing()


class NicConfig(_Kind):
    kind: Literal["NicConfig"]
    # the netdev inside the pod (docs/networking.md): its name (default: the request's name),
    # MTU, static addresses and routes, set after the move, before any container starts
    interfaceName: IfName | None = None
    mtu: int | None = Field(default=None, ge=68, le=65535)  # IPv4's minimum; IPv6 needs 1280
    addresses: list[Cidr] = Field(default_factory=list, max_length=MAX_ADDRESSES)
    routes: list[Route] = Field(default_factory=list, max_length=MAX_ROUTES)
    # addresses (and routes) from one of the node's IPAM pools, a lease per pod sandbox (prepare/ipam.py)
    ipamPool: PoolName | None = None
    # move a netdev the host uses (an address, a bond/bridge port: prepare/hostuse.py); only
    # where the node's allow_host_in_use_nics allows it (docs/networking.md)
    allowHostInUse: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> NicConfig:
        if len(set(self.addresses)) != len(self.addresses):
            raise ValueError("addresses: an address is listed twice")
        if self.mtu is not None and self.mtu < 1280 and any(":" in a for a in self.addresses):
            raise ValueError(f"mtu {self.mtu}: IPv6 addresses need at least 1280")
        return self


class VfioConfig(_Kind):
    kind: Literal["VfioConfig"]
    allowHostInUse: bool = False  # as NicConfig's: bind a NIC whose netdev the host uses


Config = Union[GpuConfig, NicConfig, VfioConfig]
# kind -> (model, the device kinds it configures)
KINDS: dict[str, tuple[type[_Kind], frozenset[str]]] = {
    "GpuConfig": (GpuConfig, frozenset({"gpu"})),
    "NicConfig": (NicConfig, frozenset({"nic"})),
    "VfioConfig": (VfioConfig, frozenset({"gpu", "nic", "fpga", "accelerator"})),
}


@dataclass(frozen=True)
class OpaqueConfig:
    """One decoded config of ours and where it applies."""

    source: str  # FromClass | FromClaim
    requests: tuple[str, ...]  # empty: every request
    config: Config
    index: int  # position in status.allocation.devices.config (for messages)

    def names(self, request: str) -> bool:
        return request in self.requests or base_request(request) in self.requests


def _errors(err: ValidationError) -> str:
    parts = []
    for e in err.errors()[:5]:
        loc = ".".join(str(x) for x in e["loc"]) or "parameters"
        parts.append(f"{loc}: {e['msg']}")
    return "; ".join(parts)


def _show(value: object) -> str:
    """A value of the claim in a message: a string quoted, anything else by its JSON type."""
    if isinstance(value, str):
        return repr(value[:64])
    return {dict: "(an object)", list: "(a list)", bool: "(a boolean)", type(None): "(missing)"}.get(type(value), "(a number)")


def decode(parameters: object) -> Config:
    """One ``opaque.parameters`` object -> its kind's model; ValueError saying what is wrong."""
    if not isinstance(parameters, dict):
        raise ValueError("parameters must be an object")
    try:
        size = len(orjson.dumps(parameters))
    except orjson.JSONEncodeError as err:  # nested deeper than any config of ours
        raise ValueError(f"parameters cannot be read: {err}") from None
    if size > MAX_OPAQUE_PARAMETERS_BYTES:
        raise ValueError(f"parameters are {size} bytes of JSON, at most {MAX_OPAQUE_PARAMETERS_BYTES}")
    version, kind = parameters.get("apiVersion"), parameters.get("kind")
    if version != API_VERSION:
        raise ValueError(f"apiVersion {_show(version)} is not supported (use {API_VERSION})")
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"kind {_show(kind)} is not one of {', '.join(KINDS)}")
    try:
        return KINDS[kind][0].model_validate(parameters)
    except ValidationError as err:
        raise ValueError(f"{kind}: {_errors(err)}") from None


def opaque_configs(claim: dict, driver_name: str) -> list[OpaqueConfig]:
    """Our configs of the claim's allocation in precedence order (class ones first), all
    decoded (a bad one fails the claim even where no result uses it, as upstream's helper)."""
    entries = allocated(claim, "config", MAX_ALLOCATION_CONFIGS)
    by_source: dict[str, list[OpaqueConfig]] = {"FromClass": [], "FromClaim": []}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ClaimFailed(f"config {i} is not an object")
        opaque = entry.get("opaque")
        if not isinstance(opaque, dict) or opaque.get("driver") != driver_name:
            continue  # another driver's, or not opaque
        source = entry.get("source")
        if not isinstance(source, str) or source not in by_source:
            raise ClaimFailed(f"config {i}: source {_show(source)} is neither FromClass nor FromClaim")
        requests = entry.get("requests") or []
        if not isinstance(requests, list) or not all(isinstance(r, str) for r in requests):
            raise ClaimFailed(f"config {i}: requests is not a list of names")
        try:
            config = decode(opaque.get("parameters"))
        except ValueError as err:
            raise ClaimFailed(f"config {i} ({source}) for {driver_name}: {err}") from None
        by_source[source].append(OpaqueConfig(source, tuple(requests), config, i))
    return by_source["FromClass"] + by_source["FromClaim"]


def config_for(configs: list[OpaqueConfig], request: str, device_kind: str, device: str = "") -> Config | None:
    """The config one allocation result of ``request`` on a ``device_kind`` device gets: the
    last that applies. A config naming the request but made for another kind of device is the
    claim's error; one that names no requests applies only to the kinds it is for."""
    for c in reversed(configs):
        kinds = KINDS[c.config.kind][1]
        if c.requests:
            if not c.names(request):
                continue
            if device_kind not in kinds:
                raise ClaimFailed(f"config {c.index} ({c.source}): {c.config.kind} names request {request!r}, "
                                  f"which got {device_kind} {device!r}; {c.config.kind} configures {', '.join(sorted(kinds))}")
            return c.config
        if device_kind in kinds:
            return c.config
    return None


def env_of(config: Config | None) -> list[str]:
    """The config's extra environment as CDI ``env`` entries, in a stable order."""
    if config is None:
        return []
    return [f"{k}={v}" for k, v in sorted(config.env.items())]

