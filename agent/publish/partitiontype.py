"""``partition_type_attribute``: the slices name a device attribute stating each partition's type
(``ResourceSliceSpec.partitionTypeAttribute``, gate DRAPartitionableDevicesType, alpha in 1.37),
which feeds the partition summary of a ResourcePoolStatusRequest (docs/partitions.md).

The server wants every counter-consuming device of such a slice to carry the attribute as a
string; kube-controller-manager v1.37.2 (resourcepoolstatusrequest, views.go) groups the pool's
devices by its value and flags the whole pool (``PartitionCostMismatch``, no summary) when two
devices of one value consume differently, the counter set's *name* included. A MIG profile alone
(``1g.18gb``) would so break on every node with two GPUs, and two placements of a profile
consume different memory slices. The value is therefore ``<counter set>/<type>``:

- a GPU's way: ``gpu-0000-05-00-0/CPX-NPS1`` (AMD mode), ``gpu-0000-18-00-0/1g.18gb`` (MIG instance),
  ``gpu-0000-00-06-0/1g.18gb@3`` (dynamic MIG: profile at its placement), ``<gpu>/whole``;
- with ``pf_vf_exclusive``: ``pf-0000-3b-00-0/pf`` and ``pf-0000-3b-00-0/vf``.
"""

from __future__ import annotations

from agent.publish.partitions import counter_set_name
from agent.publish.validation import device_problems, fitted
from discovery.gpuways import Way, by_name

ATTRIBUTE = "partitionType"  # driver-local: the slices name it <driver>/partitionType


def _way_type(way: Way) -> str:
    if way.kind == "whole":
        return "whole"
    if way.kind == "amd":
        return f"{way.compute}-{way.memory}"
    if way.kind == "mig-placement":
        return f"{way.profile.name}@{way.start}"
    profile = way.instance.profile if way.instance is not None else None
    return profile.name if profile is not None else "mig"  # static MIG: each instance costs one


def _type(entry: dict, ways: dict[str, Way], own_set: str | None) -> str | None:
    consumptions = entry.get("consumesCounters") or []
    if not consumptions:
        return None
    way = ways.get(entry["name"])
    # a GPU's way, the whole GPU only where it consumes its GPU's counters (a GPU PF may not)
    if way is not None and (way.kind != "whole" or any(c["counterSet"] == counter_set_name(way.parent.name) for c in consumptions)):
        return f"{counter_set_name(way.parent.name)}/{_way_type(way)}"
    first = consumptions[0]["counterSet"]
    return f"{first}/{'pf' if first == own_set else 'vf'}"


def typed(entries: list[dict], inventory, own_sets: dict[str, str], driver_name: str, list_attributes: bool) -> list[dict]:
    """Each counter-consuming entry with its ``partitionType`` (a new dict: entries may be cached).
    ``own_sets``: device name -> the PF counter set it would own. An entry the attribute would
    take past the API's limits stays as it was: its slice then names no attribute (``declare``)."""
    ways = by_name(d for d in inventory.devices if d.gpu is not None)
    out = []
    for entry in entries:
        value = _type(entry, ways, own_sets.get(entry["name"]))
        if value is not None:
            # an operator's own partitionType gives way (device_attributes keep the driver's domain bare)
            attributes = {**(entry.get("attributes") or {}), ATTRIBUTE: {"string": value}}
            candidate = fitted(dict(entry, attributes=dict(sorted(attributes.items()))))
            if not device_problems(candidate, driver_name, list_attributes):
                entry = candidate
        out.append(entry)
    return out


def declare(slices: list[dict], driver_name: str) -> list[dict]:
    """Device slices naming the attribute where every counter-consuming device carries it. A device
    that could not carry it (``typed``) goes to a slice of its own at the end, naming none: in its
    slice of before, none of the other devices would be in the pool's partition summary."""
    out, apart = [], []
    for s in slices:
        devices = s.get("devices") or []
        untyped = [d for d in devices if d.get("consumesCounters") and ATTRIBUTE not in (d.get("attributes") or {})]
        if untyped and len(untyped) < sum(1 for d in devices if d.get("consumesCounters")):
            apart.append({**s, "devices": untyped})
            s = {**s, "devices": [d for d in devices if all(d is not u for u in untyped)]}
            untyped = []
        if not untyped and any(d.get("consumesCounters") for d in devices):
            s = {**s, "partitionTypeAttribute": f"{driver_name}/{ATTRIBUTE}"}
        out.append(s)
    return out + apart
