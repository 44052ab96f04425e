"""A claim's netdevs as planned at prepare, for the NRI plugin to move into the pod
(agent/nri/netdev.py): which netdev, its name on the host, its name in the pod, and the pods
the claim is reserved for. Recorded in the claim's checkpoint entry (``netdevs``, ``pods``).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict

from agent.names import is_uid

IFNAMSIZ = 16
IFNAME_ROOM = 12  # a base name's room when a number follows (names are at most 15 bytes)


def valid_name(name: str) -> bool:
    """A name the kernel takes for a netdev."""
    return 0 < len(name.encode()) < IFNAMSIZ and name not in (".", "..") and not any(c in name for c in "/: \t\n\x00")


def _ifname(v: str) -> str:
    if not valid_name(v):
        raise ValueError(f"{v[:40]!r} is not a netdev name")
    return v


IfName = Annotated[str, AfterValidator(_ifname)]


class NetdevPlan(BaseModel):
    """One netdev of a prepared claim: ``host`` is its name on the host, ``pod`` its name
    inside the pod (the request's name, or the host name when that is no netdev name)."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    device: str
    request: str  # the device's (first) request: its metadata file gets the name in the pod
    host: IfName
    pod: IfName


def plan_netdevs(devices, by_name: dict) -> list[dict]:
    """At prepare: the netdevs of a claim's whole NICs and VFs (not shares of one: a shared
    NIC cannot be in one pod), each named in the pod after its request."""
    out: list[dict] = []
    taken: set[str] = set()
    for d in devices:
        dev = by_name.get(d.device)
        nic = getattr(dev, "nic", None)
        if d.share_id or nic is None or not nic.interfaces or not valid_name(nic.interfaces[0].name):
            continue
        host = nic.interfaces[0].name
        base = d.requests[0].rsplit("/", 1)[-1] if d.requests else host
        name = base if valid_name(base) else host
        n = 1
        while name in taken:
            name = f"{base[:IFNAME_ROOM]}{n}"
            n += 1
        taken.add(name)
        out.append(NetdevPlan(device=d.device, request=d.requests[0] if d.requests else "", host=host, pod=name).model_dump())
    return out



def reserved_pods(claim: dict) -> list[str]:
    """The UIDs of the pods a claim is reserved for (``status.reservedFor``)."""
    status = claim.get("status") if isinstance(claim.get("status"), dict) else {}
    return [r["uid"] for r in status.get("reservedFor") or () if isinstance(r, dict) and r.get("resource") == "pods"
            and is_uid(r.get("uid"))]
