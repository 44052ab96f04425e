"""Version-neutral types between the gRPC services (v1, v1beta1) and the driver."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Awaitable, Protocol, Union


@dataclass(frozen=True)
class ClaimRef:
    """What the kubelet sends for a claim: nothing more is known at unprepare time."""

    namespace: str
    name: str
    uid: str


@dataclass
class PreparedDevice:
    requests: list[str]  # allocation request names as allocated ("req" or "req/sub")
    pool: str
    device: str
    cdi_ids: list[str]
    share_id: str | None = None  # sent on v1 only


@dataclass
class PrepareResult:
    devices: list[PreparedDevice] = field(default_factory=list)
    error: str | None = None  # set: the claim failed, devices are ignored
    status: list[dict] | None = None  # our status.devices entries; None: not reported


class DriverProtocol(Protocol):
    """The device logic behind the plugin. Methods may be plain (run in a worker thread)
    or async. Calls are serialized by the plugin; both must be idempotent."""

    def prepare_claims(
        self, claims: list[dict]
    ) -> Union[dict[str, PrepareResult], Awaitable[dict[str, PrepareResult]]]:
        """``claims``: ResourceClaims (dicts), already checked: UID matches, allocated.
        Returns a result for every claim UID."""

    def unprepare_claims(
        self, claims: list[ClaimRef]
    ) -> Union[dict[str, str | None], Awaitable[dict[str, str | None]]]:
        """Returns ``{uid: error or None}``; unknown claims succeed."""

    # optional: recorded_status(ref: ClaimRef) -> list[dict] | None, a prepared claim's
    # status.devices entries as recorded now (cheap, called in the status writer's thread right before
    # each write; None: nothing recorded, the entries the prepare returned are written)


def base_request(name: str) -> str:
    """``"req/sub"`` -> ``"req"``: the kubelet matches containers on base request names."""
    return name.split("/", 1)[0]
