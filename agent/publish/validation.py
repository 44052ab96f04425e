"""Check ResourceSlice devices the way the API server does, before we publish.

One bad device must never cost the whole slice (the API server rejects a slice as a
whole), so each device is checked on its own and left out with a reason.
Limits: ../shared/reference/kubelet-plugin-protocol.md §5.
"""

from __future__ import annotations

import functools
import re
from fractions import Fraction
from itertools import repeat

from agent.quantity import parse_quantity  # noqa: F401  (re-exported: callers import it from here)

from agent.apilimits import (MAX_ATTRIBUTE_VALUES, MAX_ATTRIBUTES_AND_CAPACITIES, MAX_COUNTER_CONSUMPTIONS,
                             MAX_COUNTERS, MAX_DOMAIN_LENGTH, MAX_ID_LENGTH, MAX_VALID_VALUES, MAX_VALUE_LENGTH)

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# semver.org 2.0.0 grammar
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)
_SCALAR_KEYS = ("int", "bool", "string", "version")
_LIST_KEYS = ("ints", "bools", "strings", "versions")


def is_dns_label(name: str) -> bool:
    return len(name) <= 63 and bool(_DNS_LABEL.match(name))


def is_dns_subdomain(name: str, max_len: int = 253) -> bool:
    return len(name) <= max_len and bool(_DNS_SUBDOMAIN.match(name))


@functools.lru_cache(maxsize=4096)  # a pool repeats the same few dozen names on every device
def qualified_name_problem(key: str) -> str | None:
    """Why ``key`` is not a valid attribute/capacity name, or None."""
    if key.count("/") > 1:
        return f"name {key!r} has more than one '/'"
    domain, _, ident = key.rpartition("/")
    if "/" in key and not is_dns_subdomain(domain, MAX_DOMAIN_LENGTH):
        return f"name {key!r}: domain must be a DNS subdomain of at most {MAX_DOMAIN_LENGTH} characters"
    if len(ident) > MAX_ID_LENGTH or not _C_IDENTIFIER.match(ident):
        return f"name {key!r}: must be a C identifier of at most {MAX_ID_LENGTH} characters"
    return None


def _value_problem(key: str, value: object) -> str | None:
    if type(value) is dict and len(value) == 1:  # fast path for the common valid scalars
        (kind, v), = value.items()
        if kind == "string" and type(v) is str and (len(v) * 4 <= MAX_VALUE_LENGTH or len(v.encode()) <= MAX_VALUE_LENGTH):
            return None
        if kind == "int" and type(v) is int and -2**63 <= v < 2**63:
            return None
        if kind == "bool" and type(v) is bool:
            return None
    if not isinstance(value, dict) or len(value) != 1:
        return f"attribute {key!r} must have exactly one value field"
    (kind, v), = value.items()
    items = v if kind in _LIST_KEYS else [v]
    if kind in _LIST_KEYS and (not isinstance(v, list) or not v):
        return f"attribute {key!r}: list must not be empty"
    if kind not in _SCALAR_KEYS + _LIST_KEYS:
        return f"attribute {key!r}: unknown value field {kind!r}"
    for item in items:
        if kind in ("string", "strings", "version", "versions"):
            if not isinstance(item, str):
                return f"attribute {key!r}: {kind} value must be a string"
            if len(item.encode()) > MAX_VALUE_LENGTH:
                return f"attribute {key!r}: value longer than {MAX_VALUE_LENGTH} bytes"
            if kind.startswith("version") and not _SEMVER.match(item):
                return f"attribute {key!r}: {item!r} is not a semantic version"
        elif kind in ("int", "ints") and (isinstance(item, bool) or not isinstance(item, int) or not -2**63 <= item < 2**63):
            return f"attribute {key!r}: not a 64-bit integer"
        elif kind in ("bool", "bools") and not isinstance(item, bool):
            return f"attribute {key!r}: not a boolean"
    return None


@functools.lru_cache(maxsize=1024)  # devices of a kind have the same names: one check per set
def _unique_names(keys: tuple[str, ...], driver: str) -> str | None:
    # "foo" is implicitly "<driver>/foo"; both spellings at once name the same thing twice
    seen: set[str] = set()
    for key in keys:
        full = key if "/" in key else f"{driver}/{key}"
        if full in seen:
            return f"name {key!r} appears twice (with and without the driver domain)"
        seen.add(full)
    return None


def _attribute_problem(key: str, value: object, list_attributes: bool) -> tuple[str | None, int]:
    """(why the API server would reject the attribute, or None; how many values it counts)."""
    problem = qualified_name_problem(key) or _value_problem(key, value)
    if problem is None and not list_attributes and next(iter(value)) in _LIST_KEYS:
        problem = f"attribute {key!r} is a list but --list-attributes is off (the API would drop it)"
    if problem is None and next(iter(value)) in _LIST_KEYS:
        return None, len(next(iter(value.values())))
    return problem, 1


class CheckedValues:
    """Attribute values found valid while one pool is checked (one ``list_attributes``).
    Discovery shares value objects between devices (a pool of 2,000 devices has a few
    thousand distinct ones among ~40,000 entries), so each is checked once, by its id; the
    value is held, so that its id cannot be reused meanwhile. A value found invalid is not
    kept: every device holding it is checked in full and reports it."""

    __slots__ = ("valid", "list_counts")

    def __init__(self) -> None:
        self.valid: dict[int, object] = {}
        self.list_counts: dict[int, int] = {}  # of the valid list values: how many values each counts


@functools.lru_cache(maxsize=1024)  # devices of a kind have the same names: one check per set
def _names_valid(keys: tuple[str, ...], driver: str) -> bool:
    return _unique_names(keys, driver) is None and not any(map(qualified_name_problem, keys))


def _values_valid(values, checked: CheckedValues, list_attributes: bool) -> int | None:
    """How many values ``values`` (a device's attribute values) count when every one of them
    is valid, else None. Values not met before in this pool are checked and remembered."""
    valid = checked.valid
    ids = list(map(id, values))
    if new := set(ids).difference(valid):
        for i, value in zip(ids, values):
            if i not in new:
                continue
            if _value_problem("", value) is not None:  # its message, with the key, comes from the full check
                return None
            if next(iter(value)) in _LIST_KEYS:
                if not list_attributes:
                    return None
                checked.list_counts[i] = len(next(iter(value.values())))
            valid[i] = value
    if not checked.list_counts:
        return len(ids)
    return sum(map(checked.list_counts.get, ids, repeat(1)))  # a list value: its count, else 1


def device_problems(device: dict, driver: str, list_attributes: bool, checked: CheckedValues | None = None) -> list[str]:
    """Everything the API server would reject about one ``spec.devices[]`` entry.

    ``checked``: kept by the caller while it checks one pool (same ``list_attributes``), so
    that each distinct value is checked once. A device whose names and values are all valid
    is settled by set operations on their ids; any other is checked entry by entry, which
    names every problem in the order of its attributes."""
    problems: list[str] = []
    name = device.get("name", "")
    if not is_dns_label(name):
        problems.append(f"device name {name!r} is not a DNS label (lower-case, <= 63 characters)")
    attributes = device.get("attributes") or {}
    capacity = device.get("capacity") or {}
    if len(attributes) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
        problems.append(f"{len(attributes) + len(capacity)} attributes and capacities, at most {MAX_ATTRIBUTES_AND_CAPACITIES}")
    keys = tuple(attributes)
    values = None
    if _names_valid(keys, driver):
        values = _values_valid(attributes.values(), checked if checked is not None else CheckedValues(), list_attributes)
    if values is None:
        values = 0
        for key, value in attributes.items():
            problem, count = _attribute_problem(key, value, list_attributes)
            if problem:
                problems.append(problem)
            else:
                values += count
    if values > MAX_ATTRIBUTE_VALUES:
        problems.append(f"{values} attribute values, at most {MAX_ATTRIBUTE_VALUES}")
    multiple = device.get("allowMultipleAllocations") is True
    for key, cap in capacity.items():
        problem = qualified_name_problem(key)
        if problem is None:
            try:
                value = parse_quantity(cap.get("value") if isinstance(cap, dict) else None)
            except ValueError:
                problem = f"capacity {key!r}: {cap!r} is not a quantity"
        if problem is None and cap.get("requestPolicy") is not None:
            if not multiple:
                problem = f"capacity {key!r}: requestPolicy: allowMultipleAllocations must be true"
            elif found := policy_problems(cap["requestPolicy"], value):
                problem = f"capacity {key!r}: requestPolicy: " + "; ".join(found)
        if problem:
            problems.append(problem)
    for problem in (_unique_names(keys, driver), _unique_names(tuple(capacity), driver) if capacity else None):
        if problem:
            problems.append(problem)
    if consumptions := device.get("consumesCounters"):
        problems.extend(_consumption_problems(consumptions))
    return problems


def _milli(q: Fraction) -> bool:
    return (q * 1000).denominator == 1


def policy_problems(policy: dict, capacity: Fraction | None) -> list[str]:
    """What the API server rejects in a ``requestPolicy`` (validateRequestPolicy, v1.37, with
    DRAFractionalCapacityRange on: values in milli units); ``capacity`` None skips the checks
    against the capacity value (the value is known per device only)."""
    try:
        default = parse_quantity(policy["default"]) if policy.get("default") is not None else None
        values = [parse_quantity(v) for v in policy.get("validValues") or []]
        rng = {k: parse_quantity(v) for k, v in (policy.get("validRange") or {}).items() if v is not None}
    except (ValueError, TypeError, AttributeError) as err:
        return [f"bad quantity ({err})"]
    problems = []
    if values and policy.get("validRange") is not None:
        return ['exactly one policy can be specified, cannot specify "validValues" and "validRange" at the same time']
    if (values or policy.get("validRange") is not None) and default is None:
        problems.append("default is required with validValues or validRange")
    if values:
        if len(values) > MAX_VALID_VALUES:
            problems.append(f"validValues has {len(values)} entries, at most {MAX_VALID_VALUES}")
        if any(a >= b for a, b in zip(values, values[1:])):
            problems.append("validValues must be sorted in ascending order, without duplicates")
        if capacity is not None and any(v > capacity for v in values):
            problems.append(f"a valid value is larger than the capacity value {capacity}")
        if default is not None and default not in values:
            problems.append("default must be one of validValues")
    if policy.get("validRange") is not None:
        lo, hi, step = rng.get("min"), rng.get("max"), rng.get("step")
        if lo is None:
            return problems + ["validRange.min is required"]
        if not all(_milli(q) for q in (lo, hi, step, default) if q is not None):
            problems.append("validRange and default must have at most 3 decimals (milli units)")
        if lo < 0:
            problems.append("validRange.min must not be negative")
        if capacity is not None and lo > capacity:
            problems.append(f"validRange.min is larger than the capacity value {capacity}")
        if default is not None and default < lo:
            problems.append("default is less than validRange.min")
        if hi is not None:
            if lo > hi:
                problems.append("validRange.min is larger than validRange.max")
            if capacity is not None and hi > capacity:
                problems.append(f"validRange.max is larger than the capacity value {capacity}")
            if default is not None and default > hi:
                problems.append("default is more than validRange.max")
        if step is not None:
            if step <= 0:
                problems.append("validRange.step must be greater than zero")
            else:
                if capacity is not None and lo + step > capacity:
                    problems.append(f"one step above validRange.min is larger than the capacity value {capacity}")
                if default is not None and (default - lo) % step:
                    problems.append("default is not validRange.min plus a multiple of validRange.step")
                if hi is not None and (hi - lo) % step:
                    problems.append("validRange.max is not validRange.min plus a multiple of validRange.step")
    return problems


def _consumption_problems(consumptions: list[dict]) -> list[str]:
    problems = []
    if len(consumptions) > MAX_COUNTER_CONSUMPTIONS:
        problems.append(f"consumes {len(consumptions)} counter sets, at most {MAX_COUNTER_CONSUMPTIONS}")
    sets = [c.get("counterSet", "") for c in consumptions]
    if len(set(sets)) != len(sets):
        problems.append("consumes the same counter set twice")
    for c in consumptions:
        counters = c.get("counters") or {}
        if not is_dns_label(c.get("counterSet", "")) or len(counters) > MAX_COUNTERS:
            problems.append(f"bad counter consumption {c!r}")
    return problems
