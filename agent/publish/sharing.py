"""Devices shared by several claims (consumable capacity, KEP-5075; docs/sharing.md).

With ``--share gpu,nic`` those kinds are published with ``allowMultipleAllocations: true`` and
capacities that carry a ``requestPolicy``; the scheduler then hands out shares and accounts what
each consumes. What a kind's shares consume, and the policies, come from ``DEFAULT_POLICIES``
(agent/sharecaps.py, shared with prepare, which accounts shares against the same values)
merged with ``share_policies`` of the config file (one capacity's entry replaces its default;
``null`` drops that capacity). ``share_plan`` checks all of it at start, as the API server
would check it (``validation.policy_problems``), so a bad policy stops the agent with exit 78
instead of costing every device later.

Capacity values: ``value`` of the policy when given; else GPU ``memory`` from discovery (AMD VRAM
``mem_info_vram_total``; NVIDIA: NVML, or the PCI ID table of data-center GPUs); NIC ``bandwidth``
from the RDMA port rate or, without RDMA, the netdev's link speed. A capacity whose value is
unknown on a device is left out there (logged once per device): never a guessed size; so is one
its policy does not fit (less GPU memory than the smallest share plus one step): the API server
would refuse the device whole.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import MappingProxyType

from agent.publish.validation import policy_problems, qualified_name_problem
from agent.quantity import parse_quantity
from agent.sharecaps import (DEFAULT_POLICIES, SHAREABLE, capacity_values, discovered_value, merged_policies,
                              published_shared, unfit)
from cdi.claim import capacity_keys

__all__ = ["DEFAULT_POLICIES", "MAX_SHARED_CAPACITIES", "SHAREABLE", "SharePlan", "discovered_value", "share_plan",
           "is_shared", "shared_capacities", "shared_entry"]

MAX_SHARED_CAPACITIES = 8
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SharePlan:
    """Which kinds are shared and each kind's capacity policies (checked)."""

    kinds: frozenset[str]
    policies: MappingProxyType  # kind -> ((capacity, policy dict), ...)
    # (device, capacity) pairs already logged as unknown: once per device while this plan holds
    unknown_logged: set = field(default_factory=set, compare=False, repr=False)

    def __hash__(self) -> int:  # a cache key of build_pool
        return hash((self.kinds, tuple(sorted((k, repr(v)) for k, v in self.policies.items()))))

    def log_unknown(self, device, capacity: str, policy) -> None:
        if (device.name, capacity) in self.unknown_logged or len(self.unknown_logged) > 10000:
            return
        self.unknown_logged.add((device.name, capacity))
        value = str(policy["value"]) if policy.get("value") is not None else discovered_value(device, capacity)
        if value is None:
            log.warning("sharing: %s has no known %s; its shares do not offer %s (a share-policies value would)",
                        device.name, capacity, capacity)
        else:
            log.warning("sharing: %s: its %s of %s does not fit the policy (%s); its shares do not offer %s",
                        device.name, capacity, value, unfit(policy, value), capacity)


def _quantity_text(v: object, where: str) -> str:
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise ValueError(f"{where}: {v!r} is not a quantity")
    text = str(v)
    try:
        parse_quantity(text)
    except ValueError:
        raise ValueError(f"{where}: {text!r} is not a quantity") from None
    return text


_POLICY_KEYS = {"value", "default", "validValues", "validRange"}
_RANGE_KEYS = {"min", "max", "step"}


def _normalize(policy: object, where: str) -> dict:
    """A policy from the config file -> API form with quantity strings; ValueError if malformed."""
    if not isinstance(policy, dict):
        raise ValueError(f"{where}: must be a mapping with default and validValues or validRange")
    unknown = sorted(set(policy) - _POLICY_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(map(str, unknown))} (known: {', '.join(sorted(_POLICY_KEYS))})")
    out: dict = {}
    for key in ("value", "default"):
        if policy.get(key) is not None:
            out[key] = _quantity_text(policy[key], f"{where}.{key}")
    if policy.get("validValues") is not None:
        values = policy["validValues"]
        if not isinstance(values, list):
            raise ValueError(f"{where}.validValues: must be a list")
        out["validValues"] = [_quantity_text(v, f"{where}.validValues[{i}]") for i, v in enumerate(values)]
    if policy.get("validRange") is not None:
        rng = policy["validRange"]
        if not isinstance(rng, dict) or set(rng) - _RANGE_KEYS:
            raise ValueError(f"{where}.validRange: must be a mapping of min, max, step")
        out["validRange"] = {k: _quantity_text(rng[k], f"{where}.validRange.{k}") for k in ("min", "max", "step") if rng.get(k) is not None}
    return out


def share_plan(share: tuple[str, ...] | list[str], share_policies: dict | None) -> SharePlan | None:
    """The checked plan for the ``share`` and ``share_policies`` settings (None: nothing shared).
    ValueError names the setting and what is wrong."""
    kinds = tuple(share or ())
    for kind in kinds:
        if kind not in SHAREABLE:
            raise ValueError(f"share: {kind!r} cannot be shared (shareable: {', '.join(SHAREABLE)})")
    overrides = share_policies or {}
    if not isinstance(overrides, dict):
        raise ValueError("share-policies: must be a mapping of device kind to capacity policies")
    for kind in overrides:
        if kind not in SHAREABLE:
            raise ValueError(f"share-policies.{kind}: not a shareable kind ({', '.join(SHAREABLE)})")
        if kind not in kinds:
            raise ValueError(f"share-policies.{kind}: a request policy needs allowMultipleAllocations, "
                             f"but {kind} is not shared (add it to share / --share)")
    if not kinds:
        return None
    policies = {}
    for kind in kinds:
        if not isinstance(overrides.get(kind) or {}, dict):
            raise ValueError(f"share-policies.{kind}: must be a mapping of capacity name to policy")
        caps = []
        for name, policy in merged_policies(kind, overrides).items():
            where = f"share-policies.{kind}.{name}"
            if problem := qualified_name_problem(str(name)):
                raise ValueError(f"{where}: {problem}")
            p = _normalize(policy, where)
            value = parse_quantity(p["value"]) if "value" in p else None
            problems = policy_problems({k: v for k, v in p.items() if k != "value"}, value)
            if problems:
                raise ValueError(f"{where}: " + "; ".join(problems))
            caps.append((str(name), MappingProxyType(p)))
        if len(caps) > MAX_SHARED_CAPACITIES:
            raise ValueError(f"share-policies.{kind}: {len(caps)} capacities, at most {MAX_SHARED_CAPACITIES}")
        try:  # each share's environment names every capacity (prepare/shares.py)
            capacity_keys(name for name, _ in caps)
        except ValueError as err:
            raise ValueError(f"share-policies.{kind}: {err}") from None
        policies[kind] = tuple(caps)
    return SharePlan(frozenset(kinds), MappingProxyType(policies))


def is_shared(device, plan: SharePlan | None) -> bool:
    """Whether ``device`` is published shared: its kind is, and it is not on vfio-pci (sharecaps)."""
    return plan is not None and published_shared(device, plan.kinds)


def shared_capacities(device, plan: SharePlan | None) -> dict[str, str] | None:
    """The capacities ``device`` is published with for its shares, by name (None: it is not
    shared). One with no known value is not among them: it is not accounted there."""
    if not is_shared(device, plan):
        return None
    return capacity_values(device, plan.policies[device.kind])


def shared_entry(entry: dict, device, plan: SharePlan | None) -> dict:
    """The device's slice entry, multi-allocatable with policies when it is shared."""
    if not is_shared(device, plan):
        return entry
    kept = {name for name, _ in plan.policies[device.kind]}
    # only the kind's shared capacities: on a multi-allocatable device every capacity is consumable,
    # and one without a policy (dropped by the operator, or discovery's, as AMD's computeUnits and
    # simdUnits) would be consumed whole by every share, so one share would take the device
    capacity = {name: v for name, v in (entry.get("capacity") or {}).items() if name in kept}
    values = shared_capacities(device, plan)
    for name, policy in plan.policies[device.kind]:
        value = values.get(name)
        if value is None:
            capacity.pop(name, None)  # unknown here, or its policy does not fit: not accounted on this device
            plan.log_unknown(device, name, policy)
            continue
        request_policy = {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
                          for k, v in policy.items() if k != "value"}
        capacity[name] = {"value": value, "requestPolicy": request_policy}
    out = dict(entry, allowMultipleAllocations=True)
    if capacity:
        out["capacity"] = dict(sorted(capacity.items()))
    return out

