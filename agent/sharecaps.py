"""What a shared device offers its shares (``--share``, docs/sharing.md): each kind's capacity
policies and the value of each capacity on a device. Neutral, so that one definition serves
both sides: publishing puts the values in the device's slice entry (publish/sharing.py, which
also checks the operator's policies at start), prepare accounts each device's shares against
them (prepare/ownership.py): a node never prepares more than it offered. A capacity is offered
only where its policy fits its value on the device: elsewhere the API server would refuse the
device, and a device without that capacity is still a device shared."""

from __future__ import annotations

from fractions import Fraction
from typing import Iterable, Mapping

from agent.quantity import plain
from discovery.vfio import is_vfio_driver

SHAREABLE = ("gpu", "nic")

# kind -> capacity -> policy (API form, plus an optional "value"); docs/sharing.md lists them
DEFAULT_POLICIES: dict[str, dict[str, dict]] = {
    "gpu": {
        "memory": {"default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}},
        "compute": {"value": "100", "default": "10", "validRange": {"min": "1", "max": "100", "step": "1"}},
    },
    "nic": {
        "bandwidth": {"default": "1G", "validRange": {"min": "100M", "step": "100M"}},
        "slots": {"value": "32", "default": "1", "validRange": {"min": "1", "step": "1"}},
    },
}


def published_shared(dev, kinds: Iterable[str]) -> bool:
    """Whether ``dev`` is published shared where ``kinds`` are: not on vfio-pci. A function there
    goes to one VM whole (vfio.sysdra.io): no VM takes a share, and a container's share would be
    /dev/vfio/<group>, no device of its kind; a share allocated anyway holds it whole."""
    return dev.kind in kinds and not is_vfio_driver(getattr(dev.pci, "driver", None))


def merged_policies(kind: str, overrides: Mapping | None) -> dict[str, object]:
    """``kind``'s capacity policies: the defaults, each replaced by the operator's
    ``share_policies`` entry of that name (``null`` drops it). Not checked here:
    ``publish.sharing.share_plan`` checks them at start (exit 78)."""
    merged: dict[str, object] = dict(DEFAULT_POLICIES.get(kind, {}))
    given = (overrides or {}).get(kind) or {}
    if isinstance(given, Mapping):
        merged.update({str(name): policy for name, policy in given.items()})
    return {name: policy for name, policy in merged.items() if policy is not None}


def _bits(mbps: Fraction) -> str:
    return f"{plain(mbps / 1000)}G" if (mbps / 1000).denominator == 1 else f"{plain(mbps)}M"


def discovered_value(device, capacity: str) -> str | None:
    """What discovery knows of a shared capacity on ``device`` (None: unknown)."""
    if capacity == "memory" and device.kind == "gpu":
        if device.capacity.get("memory"):
            return device.capacity["memory"]
    if capacity == "bandwidth" and device.kind == "nic" and device.nic:
        rates = [Fraction(r.rate_gbps).limit_denominator(1000) * 1000 for r in device.nic.rdma if r.rate_gbps]
        rates = rates or [Fraction(i.speed_mbps) for i in device.nic.interfaces if i.speed_mbps]
        if rates:
            return _bits(max(rates))
    return None


def capacity_values(device, policies: Iterable[tuple[str, Mapping]]) -> dict[str, str]:
    """The value of each capacity of ``policies`` on ``device``: the policy's ``value`` when
    given, else what discovery knows. One with no known value is left out: never a guess; so is
    one its policy does not fit (``unfit``)."""
    out = {}
    for name, policy in policies:
        value = str(policy["value"]) if policy.get("value") is not None else discovered_value(device, name)
        if value is not None and not unfit(policy, value):
            out[name] = value
    return out


def unfit(policy: Mapping, value: str) -> str | None:
    """Why the API server would refuse ``policy`` on a capacity of ``value`` (a GPU of less memory
    than the policy's smallest share plus one step, a NIC linked at 100 Mb/s), or None: refused,
    the whole device would be left out of its slice."""
    from agent.publish.validation import policy_problems, parse_quantity  # here: agent.publish imports this module

    try:
        problems = policy_problems({k: v for k, v in policy.items() if k != "value"}, parse_quantity(value))
    except ValueError as err:
        return str(err)
    return "; ".join(problems) or None
