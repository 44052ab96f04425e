"""Check ResourceSlice devices the way the API server does, before we publish.

One bad device must never cost the whole slice (the API server rejects a slice as a
whole), so each device is checked on its own and left out with a reason.
Limits: ../shared/reference/kubelet-plugin-protocol.md §5.
"""

from __future__ import annotations

import functools
import re
from fractions import Fraction

MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_ATTRIBUTE_VALUES = 48
MAX_VALUE_LENGTH = 64  # bytes, for string/version values and list elements
MAX_ID_LENGTH = 32
MAX_DOMAIN_LENGTH = 63
MAX_COUNTER_CONSUMPTIONS = 2
MAX_COUNTERS = 32

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# semver.org 2.0.0 grammar
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)
_QUANTITY = re.compile(r"^([+-]?)(\d+\.?\d*|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?\d+)?$")
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_SCALAR_KEYS = ("int", "bool", "string", "version")
_LIST_KEYS = ("ints", "bools", "strings", "versions")


def is_dns_label(name: str) -> bool:
    return len(name) <= 63 and bool(_DNS_LABEL.match(name))


def is_dns_subdomain(name: str, max_len: int = 253) -> bool:
    return len(name) <= max_len and bool(_DNS_SUBDOMAIN.match(name))


def parse_quantity(text: str) -> Fraction:
    """Value of a Kubernetes quantity string; ValueError when the syntax is wrong."""
    m = _QUANTITY.match(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"not a quantity: {text!r}")
    sign, number, suffix = m.group(1), m.group(2), m.group(3) or ""
    value = Fraction(number)
    if suffix in _BINARY:
        value *= _BINARY[suffix]
    elif suffix in _DECIMAL:
        value *= Fraction(10) ** _DECIMAL[suffix]
    else:  # decimal exponent, e.g. 1e3
        value *= Fraction(10) ** int(suffix[1:])
    return -value if sign == "-" else value


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
    """Everything the API server would reject about one ``spec.devices[]`` entry."""
    problems: list[str] = []
    name = device.get("name", "")
    if not is_dns_label(name):
        problems.append(f"device name {name!r} is not a DNS label (lower-case, <= 63 characters)")
    attributes = device.get("attributes") or {}
    capacity = device.get("capacity") or {}
    if len(attributes) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
        problems.append(f"{len(attributes) + len(capacity)} attributes and capacities, at most {MAX_ATTRIBUTES_AND_CAPACITIES}")
    values = 0
    for key, value in attributes.items():
        problem = qualified_name_problem(key) or _value_problem(key, value)
        if problem is None and not list_attributes and next(iter(value)) in _LIST_KEYS:
            problem = f"attribute {key!r} is a list but --list-attributes is off (the API would drop it)"
        if problem:
            problems.append(problem)
        elif next(iter(value)) in _LIST_KEYS:
            values += len(next(iter(value.values())))
        else:
            values += 1
    if values > MAX_ATTRIBUTE_VALUES:
        problems.append(f"{values} attribute values, at most {MAX_ATTRIBUTE_VALUES}")
    for key, cap in capacity.items():
        problem = qualified_name_problem(key)
        if problem is None:
            try:
                parse_quantity(cap.get("value") if isinstance(cap, dict) else None)
            except ValueError:
                problem = f"capacity {key!r}: {cap!r} is not a quantity"
        if problem:
            problems.append(problem)
    for problem in (_unique_names(attributes, driver), _unique_names(capacity, driver)):
        if problem:
            problems.append(problem)
    problems.extend(_consumption_problems(device.get("consumesCounters") or []))
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
