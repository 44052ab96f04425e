"""Slices for devices whose node operations the kubelet may skip (KEP-5945).

``skipNodeOperations`` is a field of the slice, not of a device: it applies to every device in
it. So the devices of a kind the operator marks (``skip_node_operations``) get slices of their
own, one group per distinct list; unmarked devices keep their slices first, in pool order
(chunking stays sticky within each group)."""

from __future__ import annotations

from typing import Callable


def grouped_slices(entries: list[dict], kind_of: dict[str, str], skip: dict[str, list[str]],
                   previous: list[dict] | None, chunk: Callable[[list[dict], list[list[dict]] | None], list[list[dict]]]) -> list[dict]:
    """``entries`` (device API dicts, pool order) -> slice contents; ``previous``: the slice
    contents published before (for sticky placement within each group)."""
    groups: dict[tuple[str, ...], list[dict]] = {}
    for e in entries:
        kind = kind_of.get(e["name"]) or e["name"].split("-", 1)[0]  # partitions: named after their kind too
        groups.setdefault(tuple(skip.get(kind, ())), []).append(e)
    out: list[dict] = []
    for ops in sorted(groups):  # () first: the unmarked devices keep the low slice indexes
        prev = None
        if previous is not None:
            prev = [sl["devices"] for sl in previous if "devices" in sl and tuple(sl.get("skipNodeOperations", ())) == ops]
        extra = {"skipNodeOperations": list(ops)} if ops else {}
        out.extend({"devices": c, **extra} for c in chunk(groups[ops], prev))
    return out
