"""Kubernetes name formats, as the API server validates them. Every name the agent turns
into a path (namespaces, claim names, request names, UIDs, annotations) passes here first;
a bad one is refused with a message naming it, never trimmed or repaired."""

from __future__ import annotations

import re

_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_SUBDOMAIN_PART = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN = re.compile(rf"{_SUBDOMAIN_PART}(\.{_SUBDOMAIN_PART})*")
# types.UID: kubelet-supplied UIDs are RFC 4122 text; be as strict as paths need, no stricter
_UID = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9]{0,62}[A-Za-z0-9])?")
MAX_SUBDOMAIN = 253


class InvalidName(ValueError):
    """A name that is not of its Kubernetes format; ``str()`` says which and why."""


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_label(value: object) -> bool:
    return isinstance(value, str) and _LABEL.fullmatch(value) is not None


def is_subdomain(value: object) -> bool:
    return isinstance(value, str) and len(value) <= MAX_SUBDOMAIN and _SUBDOMAIN.fullmatch(value) is not None


def is_uid(value: object) -> bool:
    return isinstance(value, str) and _UID.fullmatch(value) is not None


def check_label(what: str, value: object) -> str:
    if not is_label(value):
        raise InvalidName(f"{what} {_show(value)} is not a DNS label (lower-case letters, digits, '-', at most 63)")
    return value  # type: ignore[return-value]


def check_subdomain(what: str, value: object) -> str:
    if not is_subdomain(value):
        raise InvalidName(f"{what} {_show(value)} is not a DNS subdomain (lower-case letters, digits, '-', '.', at most 253)")
    return value  # type: ignore[return-value]


def check_uid(what: str, value: object) -> str:
    if not is_uid(value):
        raise InvalidName(f"{what} {_show(value)} is not a UID")
    return value  # type: ignore[return-value]


def check_request(value: object) -> str:
    """An allocation result's ``request``: ``<request>`` or ``<request>/<subrequest>``
    (prioritized list), each a DNS label."""
    parts = value.split("/") if isinstance(value, str) else []
    if not 1 <= len(parts) <= 2 or not all(is_label(p) for p in parts):
        raise InvalidName(f"request name {_show(value)} is not '<request>' or '<request>/<subrequest>' of DNS labels")
    return value  # type: ignore[return-value]
