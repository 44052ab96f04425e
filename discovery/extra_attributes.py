"""Attributes the node's operator gives devices (``device_attributes``, docs/attributes.md): what no
file on the node says, such as the rail or fabric a NIC is cabled to, or the name another DRA driver
gives an attribute sysdra publishes (``dra.net/numaNode`` of dra-driver-sriov and dranet), so that a
claim's ``matchAttribute`` spans both drivers' devices.

A rule names devices as ``exclude_devices`` does (``pci:<glob>``, ``interface:<glob>``,
``kind:<kind>``; a device matches a rule when it matches any of them) and gives attributes: a
driver-local name (``rail``) or a qualified one (``example.com/rail``), and a string, integer or
bool value, or ``{copy: <attribute>}``, the device's own value of that attribute under the new name.
Names and values are checked as the API server checks them. A device's own attribute wins over an
operator's of the same name, and the API's 32 attributes and capacities over both (each refusal is
a problem of the device, shown by ``sysdra scan``). Pure: the scan applies them (discovery/inventory.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from discovery.attributes import MAX_ATTRIBUTES_AND_CAPACITIES, MAX_VALUE_LENGTH, _value
from discovery.exclude import Exclusions
from discovery.models import Problem

MAX_RULES = 64
MAX_PER_RULE = 16
_LOCAL = r"[A-Za-z_][A-Za-z0-9_]{0,31}"  # a C identifier of at most 32 characters
_DOMAIN = r"(?=.{1,63}/)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_NAME = re.compile(rf"^(?:{_DOMAIN}/)?{_LOCAL}$")
_RESERVED = "resource.kubernetes.io/"  # Kubernetes' own standard attributes
_INT64 = 1 << 63


@dataclass(frozen=True)
class Copy:
    """``{copy: name}``: the device's own value of attribute ``name``."""

    name: str


@dataclass(frozen=True)
class Rule:
    match: Exclusions
    attributes: tuple[tuple[str, object], ...]  # (name, str | int | bool | Copy)


@dataclass(frozen=True)
class ExtraAttributes:
    rules: tuple[Rule, ...] = ()

    @classmethod
    def parse(cls, entries, driver: str = "") -> ExtraAttributes:
        """Rules from the setting's list of ``{match: [...], attributes: {...}}``; ValueError names the first bad one.
        ``driver``: the DRA driver's name; ``<driver>/x`` is ``x`` to the API and to CEL, so it is taken as
        ``x`` (a device's own ``x`` then wins over it; with both the API server's validation fails the device)."""
        entries = list(entries or ())
        if len(entries) > MAX_RULES:
            raise ValueError(f"{len(entries)} rules, at most {MAX_RULES}")
        return cls(tuple(_rule(i, entry, f"{driver}/" if driver else "") for i, entry in enumerate(entries)))

    def __bool__(self) -> bool:
        return bool(self.rules)

    def apply(self, attrs: dict, bdf: str, kind: str, interfaces: list[str], capacity: int,
              problems: list[Problem]) -> dict:
        """``attrs`` with the attributes of every rule that names the device (the first rule
        giving a name wins); ``capacity``: how many capacities the device has."""
        out = dict(attrs)
        for rule in self.rules:
            if not (rule.match.function(bdf, kind) or rule.match.interfaces(interfaces)):
                continue
            for name, value in rule.attributes:
                if name in out:
                    if name in attrs:
                        problems.append(Problem(what=f"device_attributes {name}", reason="the device publishes its own"))
                    continue
                if isinstance(value, Copy) and (value := attrs.get(value.name)) is None:
                    continue  # the device has no such attribute: nothing to copy
                if len(out) + capacity >= MAX_ATTRIBUTES_AND_CAPACITIES:
                    problems.append(Problem(what=f"device_attributes {name}",
                                            reason=f"past the API's {MAX_ATTRIBUTES_AND_CAPACITIES} attributes and capacities"))
                    continue
                out[name] = value
        return out


def _rule(i: int, entry, own: str) -> Rule:
    where = f"rule {i + 1}"
    if not isinstance(entry, dict) or set(entry) != {"match", "attributes"}:
        raise ValueError(f"{where}: needs exactly 'match' and 'attributes'")
    match = entry["match"]
    if isinstance(match, str):
        match = [match]
    if not isinstance(match, list) or not match:
        raise ValueError(f"{where}: 'match' is a list of pci:<glob>, interface:<glob>, kind:<kind>")
    attributes = entry["attributes"]
    if not isinstance(attributes, dict) or not 0 < len(attributes) <= MAX_PER_RULE:
        raise ValueError(f"{where}: 'attributes' maps 1 to {MAX_PER_RULE} names to values")
    return Rule(Exclusions.parse(match), tuple((_local(_name(where, n), own), _checked(where, n, v, own))
                                               for n, v in attributes.items()))


def _local(name: str, own: str) -> str:
    """``name`` without the driver's own domain (``own``: ``<driver>/``, or "" when not known)."""
    return name[len(own):] if own and name.startswith(own) else name


def _name(where: str, name) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{where}: {name!r} is not an attribute name (a C identifier of at most 32 characters, "
                         "optionally after a DNS domain and '/')")
    if name.startswith(_RESERVED):
        raise ValueError(f"{where}: {name!r}: the {_RESERVED[:-1]} domain is Kubernetes' own")
    return name


def _checked(where: str, name: str, value, own: str = ""):
    """The attribute's value as the scan publishes it (a shared AttributeValue), or a Copy."""
    if isinstance(value, dict):
        if set(value) != {"copy"} or not isinstance(value["copy"], str) or not _NAME.match(value["copy"]):
            raise ValueError(f"{where}: {name}: a value is a string, an integer, a bool or {{copy: <attribute name>}}")
        return Copy(_local(value["copy"], own))
    if isinstance(value, bool):
        return _value("bool_", value)
    if isinstance(value, int):
        if not -_INT64 <= value < _INT64:
            raise ValueError(f"{where}: {name}: {value} is past a 64-bit integer")
        return _value("int_", value)
    if isinstance(value, str):
        if not 0 < len(value.encode()) <= MAX_VALUE_LENGTH:
            raise ValueError(f"{where}: {name}: a string of 1 to {MAX_VALUE_LENGTH} bytes")
        return _value("string", value)
    raise ValueError(f"{where}: {name}: a value is a string, an integer, a bool or {{copy: <attribute name>}}")
