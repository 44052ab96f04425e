"""List-typed attributes (KEP-5491) that the API server refuses. With DRAListTypeAttributes off
(alpha, off by default in 1.37) kube-apiserver v1.37.2 drops an attribute's list value and then
refuses the attribute left empty: the whole slice fails with a 422, every device in it. Retrying
the same slice never helps; the field errors on attributes we sent as lists say why, so the
publisher can hand the decision to the daemon (agent/service/listfallback.py)."""

from __future__ import annotations

import re

from agent.publish.store import Invalid, StoreError

LIST_MEMBERS = ("ints", "bools", "strings", "versions")  # DeviceAttribute's list members
_FIELD = re.compile(r"^spec\.devices\[(\d+)\]\.attributes\[([^\]]+)\]")


class ListAttributesRefused(StoreError):
    """The server refused attributes ``names`` that the slice carried as lists."""

    def __init__(self, names: tuple[str, ...], message: str):
        super().__init__(message)
        self.names = names


def refusal(obj: dict, err: Invalid) -> ListAttributesRefused | None:
    """``err`` as a refusal of ``obj``'s list attributes when a field error names an attribute
    ``obj`` carries as a list; None when none does (the slice is wrong some other way: retried)."""
    devices = obj.get("spec", {}).get("devices") or []
    names: set[str] = set()
    for field in err.fields:
        match = _FIELD.match(field)
        if match is None or int(match[1]) >= len(devices) or not isinstance(devices[int(match[1])], dict):
            continue
        value = (devices[int(match[1])].get("attributes") or {}).get(match[2])
        if isinstance(value, dict) and any(m in value for m in LIST_MEMBERS):
            names.add(match[2])
    return ListAttributesRefused(tuple(sorted(names)), str(err)) if names else None
