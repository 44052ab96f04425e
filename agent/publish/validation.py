"""Check ResourceSlice devices the way the API server does, before we publish.

One bad device must never cost the whole slice (the API server rejects a slice as a
whole), so each device is checked on its own and left out with a reason.
Limits: the kubelet plugin protocol notes of the shared reference material, §5.
"""

from __future__ import annotations

import functools
import re
from fractions import Fraction

from agent.apilimits import (MAX_ATTRIBUTE_VALUES, MAX_ATTRIBUTES_AND_CAPACITIES, MAX_COUNTER_CONSUMPTIONS,
                             MAX_COUNTERS, MAX_DOMAIN_LENGTH, MAX_ID_LENGTH, MAX_VALID_VALUES, MAX_VALUE_LENGTH)
from agent.names import is_label, is_subdomain
from agent.quantity import parse_quantity  # noqa: F401  (re-exported: callers import it from here)
from discovery.gpuways import within_limit

_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# semver.org 2.0.0 grammar
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)
_SCALAR_KEYS = ("int", "bool", "string", "version")


# Cached: a pool of thousands of devices repeats the same few dozen names, and building the
# first pool of a large node is what an agent's start waits for.
@functools.lru_cache(maxsize=4096)
def qualified_name_problem(key: str) -> str | None:
    """Why ``key`` is not a valid attribute/capacity name, or None."""
    if key.count("/") > 1:
        return f"name {key!r} has more than one '/'"
    domain, _, ident = key.rpartition("/")
    if "/" in key and not (len(domain) <= MAX_DOMAIN_LENGTH and is_subdomain(domain)):
        return f"name {key!r}: domain must be a DNS subdomain of at most {MAX_DOMAIN_LENGTH} characters"
    if len(ident) > MAX_ID_LENGTH or not _C_IDENTIFIER.match(ident):
        return f"name {key!r}: must be a C identifier of at most {MAX_ID_LENGTH} characters"
    return None


def _string_problem(key: str, kind: str, item: object) -> str | None:
    if not isinstance(item, str):
        return f"attribute {key!r}: {kind} value must be a string"
    if len(item.encode()) > MAX_VALUE_LENGTH:
        return f"attribute {key!r}: value longer than {MAX_VALUE_LENGTH} bytes"
    return None


def _version_problem(key: str, kind: str, item: object) -> str | None:
    if problem := _string_problem(key, kind, item):
        return problem
    return None if _SEMVER.match(item) else f"attribute {key!r}: {item!r} is not a semantic version"


def _int_problem(key: str, kind: str, item: object) -> str | None:
    if type(item) is not int or not -2**63 <= item < 2**63:  # a bool is no integer here
        return f"attribute {key!r}: not a 64-bit integer"
    return None


def _bool_problem(key: str, kind: str, item: object) -> str | None:
    return None if type(item) is bool else f"attribute {key!r}: not a boolean"


# each value field -> the check of one value (of a list: of each item)
_ITEM_PROBLEM = {"string": _string_problem, "version": _version_problem, "strings": _string_problem,
                 "versions": _version_problem, "int": _int_problem, "ints": _int_problem,
                 "bool": _bool_problem, "bools": _bool_problem}  # fmt: skip


def _attribute_problem(key: str, value: object, list_attributes: bool) -> tuple[str | None, int]:
    """(why the API server would reject the attribute, or None; how many values it counts)."""
    if problem := qualified_name_problem(key):
        return problem, 1
    if not isinstance(value, dict) or len(value) != 1:
        return f"attribute {key!r} must have exactly one value field", 1
    (kind, v), = value.items()
    item_problem = _ITEM_PROBLEM.get(kind)
    if item_problem is None:
        return f"attribute {key!r}: unknown value field {kind!r}", 1
    if kind in _SCALAR_KEYS:
        return item_problem(key, kind, v), 1
    if not isinstance(v, list) or not v:
        return f"attribute {key!r}: list must not be empty", 1
    for item in v:
        if problem := item_problem(key, kind, item):
            return problem, 1
    if not list_attributes:
        return f"attribute {key!r} is a list but --list-attributes is off (the API would drop it)", 1
    return None, len(v)


def _unique_names(keys, driver: str) -> str | None:
    # "foo" is implicitly "<driver>/foo"; both spellings at once name the same thing twice
    seen: set[str] = set()
    for key in keys:
        full = key if "/" in key else f"{driver}/{key}"
        if full in seen:
            return f"name {key!r} appears twice (with and without the driver domain)"
        seen.add(full)
    return None


def device_problems(device: dict, driver: str, list_attributes: bool) -> list[str]:
    """Everything the API server would reject about one ``spec.devices[]`` entry, in the
    order of its attributes and capacities."""
    problems: list[str] = []
    name = device.get("name", "")
    if not is_label(name):
        problems.append(f"device name {name!r} is not a DNS label (lower-case, <= 63 characters)")
    attributes = device.get("attributes") or {}
    capacity = device.get("capacity") or {}
    if len(attributes) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
        problems.append(f"{len(attributes) + len(capacity)} attributes and capacities, at most {MAX_ATTRIBUTES_AND_CAPACITIES}")
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
        if problem := _capacity_problem(key, cap, multiple):
            problems.append(problem)
    for problem in (_unique_names(attributes, driver), _unique_names(capacity, driver)):
        if problem:
            problems.append(problem)
    if consumptions := device.get("consumesCounters"):
        problems.extend(_consumption_problems(consumptions))
    return problems


def _capacity_problem(key: str, cap: object, multiple: bool) -> str | None:
    if problem := qualified_name_problem(key):
        return problem
    try:
        value = parse_quantity(cap.get("value") if isinstance(cap, dict) else None)
    except ValueError:
        return f"capacity {key!r}: {cap!r} is not a quantity"
    if cap.get("requestPolicy") is None:
        return None
    if not multiple:
        return f"capacity {key!r}: requestPolicy: allowMultipleAllocations must be true"
    if found := policy_problems(cap["requestPolicy"], value):
        return f"capacity {key!r}: requestPolicy: " + "; ".join(found)
    return None


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
        problems += _valid_values_problems(values, default, capacity)
    if policy.get("validRange") is not None:
        problems += _range_problems(rng, default, capacity)
    return problems


def _valid_values_problems(values: list[Fraction], default: Fraction | None, capacity: Fraction | None) -> list[str]:
    """A ``validValues`` policy's rules."""
    problems = []
    if len(values) > MAX_VALID_VALUES:
        problems.append(f"validValues has {len(values)} entries, at most {MAX_VALID_VALUES}")
    if any(a >= b for a, b in zip(values, values[1:])):
        problems.append("validValues must be sorted in ascending order, without duplicates")
    if capacity is not None and any(v > capacity for v in values):
        problems.append(f"a valid value is larger than the capacity value {capacity}")
    if default is not None and default not in values:
        problems.append("default must be one of validValues")
    return problems


def _range_problems(rng: dict[str, Fraction], default: Fraction | None, capacity: Fraction | None) -> list[str]:
    """A ``validRange`` policy's rules: its bounds, then its step."""
    lo, hi, step = rng.get("min"), rng.get("max"), rng.get("step")
    if lo is None:
        return ["validRange.min is required"]
    problems = []
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
        problems += _step_problems(lo, hi, step, default, capacity)
    return problems


def _step_problems(lo: Fraction, hi: Fraction | None, step: Fraction, default: Fraction | None,
                   capacity: Fraction | None) -> list[str]:
    """A ``validRange.step``'s rules; none but its sign checked when it is not positive."""
    if step <= 0:
        return ["validRange.step must be greater than zero"]
    problems = []
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
        if not is_label(c.get("counterSet", "")) or len(counters) > MAX_COUNTERS:
            problems.append(f"bad counter consumption {c!r}")
    return problems


def fitted(entry: dict) -> dict:
    """``entry`` within the API's 32 attributes and capacities, its least needed attributes left
    out first (as a partition's, discovery/gpuways.py): a share's capacities, a VF's PF address or
    a partition's attributes added to a device the operator's attributes filled cost no device."""
    attributes, capacity = entry.get("attributes") or {}, entry.get("capacity") or {}
    if len(attributes) + len(capacity) <= MAX_ATTRIBUTES_AND_CAPACITIES:
        return entry
    attributes = dict(attributes)
    within_limit(attributes, capacity)
    return dict(entry, attributes=attributes)
