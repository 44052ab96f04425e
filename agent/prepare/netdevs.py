"""A claim's netdevs for its pod: the names and network values their records and the claim's
``NicConfig`` share (checked the same way in both), and the pods a claim is reserved for.

The step that plans them at prepare is agent/prepare/steps/netdev.py; the NRI plugin moves them
(agent/nri/netdev.py) through agent/prepare/netmove.py.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, model_validator

from agent.names import is_label, is_uid
from agent.settings_net import ipam_config_problem

IFNAMSIZ = 16
IFNAME_ROOM = 12  # a base name's room when a number follows (names are at most 15 bytes)
MAX_ADDRESSES = 16  # status.devices[].networkData.ips holds at most 16
MAX_ROUTES = 32


def valid_name(name: str) -> bool:
    """A name the kernel takes for a netdev."""
    raw = name.encode()  # the kernel's dev_valid_name: no '/', ':' nor isspace() byte (its ctype: 0xA0 too)
    return 0 < len(raw) < IFNAMSIZ and name not in (".", "..") and not any(b in b"/: \t\n\v\f\r\x00\xa0" for b in raw)


def _ifname(v: str) -> str:
    if not valid_name(v):
        raise ValueError(f"{v[:40]!r} is not a netdev name")
    return v


def cidr(v: str) -> str:
    """``ip/prefix`` as the kernel gets it (the host bits kept: 192.0.2.5/24, not a network)."""
    try:
        iface = ipaddress.ip_interface(v)
    except ValueError:
        iface = None
    if iface is None or "/" not in v:
        raise ValueError(f"{v[:64]!r} is not an address with its prefix, e.g. 192.0.2.5/24 or 2001:db8::5/64")
    return iface.with_prefixlen


def _destination(v: str) -> str:
    if v == "default":
        return v
    try:
        return ipaddress.ip_network(v, strict=True).with_prefixlen
    except ValueError:
        raise ValueError(f"{v[:64]!r} is neither 'default' nor a network such as 198.51.100.0/24") from None


def _ip(v: str) -> str:
    try:
        return str(ipaddress.ip_address(v))
    except ValueError:
        raise ValueError(f"{v[:64]!r} is not an IP address") from None


def _pool(v: str) -> str:
    if not is_label(v):
        raise ValueError(f"{v[:64]!r} is not an IPAM pool's name (a DNS label)")
    return v


def _ipam_config(v: dict) -> dict:
    # a pool's configuration (at most 16 KiB) and the dataDir the agent writes into host-local's
    if problem := ipam_config_problem(v, limit=20 << 10):
        raise ValueError(f"IPAM configuration: {problem}")
    return v


IfName = Annotated[str, AfterValidator(_ifname)]
PoolName = Annotated[str, AfterValidator(_pool)]  # one of the node's nic_ipam pools (prepare/ipam.py)
IpamConfig = Annotated[dict[str, Any], AfterValidator(_ipam_config)]  # a pool's configuration, as a lease was asked with
Cidr = Annotated[str, AfterValidator(cidr)]
Destination = Annotated[str, AfterValidator(_destination)]
Ip = Annotated[str, AfterValidator(_ip)]


class Route(BaseModel):
    """A static route in the pod: ``destination`` (a network or ``default``) through ``gateway``,
    or on the link when there is none. ``default`` needs a gateway (it names the family)."""
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    destination: Destination
    gateway: Ip | None = None

    @model_validator(mode="after")
    def _families(self) -> Route:
        if self.destination == "default" and self.gateway is None:
            raise ValueError("a default route needs a gateway")
        if self.gateway is not None and self.destination != "default":
            if ipaddress.ip_network(self.destination).version != ipaddress.ip_address(self.gateway).version:
                raise ValueError(f"route {self.destination} via {self.gateway}: the gateway is of another IP family")
        return self


def reserved_pods(claim: dict) -> list[str]:
    """The UIDs of the pods a claim is reserved for (``status.reservedFor``)."""
    status = claim.get("status") if isinstance(claim.get("status"), dict) else {}
    return [r["uid"] for r in status.get("reservedFor") or () if isinstance(r, dict) and r.get("resource") == "pods"
            and is_uid(r.get("uid"))]


def group_consumers(claim: dict) -> str | None:
    """The consumers a claim is reserved for that are not pods (a PodGroup: DRAWorkloadResourceClaims),
    when it is reserved for no pod, as ``resource/name``; None otherwise."""
    status = claim.get("status") if isinstance(claim.get("status"), dict) else {}
    others = [r for r in status.get("reservedFor") or () if isinstance(r, dict) and r.get("resource") != "pods"]
    if not others or reserved_pods(claim):
        return None
    return ", ".join(f"{r.get('resource')}/{r.get('name')}" for r in others[:4])
