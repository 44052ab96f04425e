"""Partitionable GPUs in the pool (``--partitions``): per GPU one counter set, one device per
way of running it (discovery/gpuways.py), each consuming its share (docs/partitions.md).

AMD: counters ``xcds`` (the GPU's XCCs) and ``memory`` (its VRAM); the whole GPU consumes
all of both, a partition of a mode with P partitions 1/P. Counters keep a whole GPU and its
partitions apart and bound how many partitions of one mode fit, but they cannot keep two
modes apart (a DPX and a CPX partition fit in the sum). So:

- with ``--compatibility-groups`` (cluster gate DRADeviceCompatibilityGroups) every mode the
  GPU can switch to is published, each consumption naming its mode's group: the compute modes
  of its current memory mode (amdgpu applies another memory mode only at a driver reload);
- without it only the whole GPU and the partitions of the mode the GPU is in now: counters
  alone keep that correct, and no claim ever needs a mode switch but the whole GPU (SPX).

NVIDIA MIG without NVML (static): counter ``compute-instances`` (how many exist), each instance
one; the whole GPU of a GPU with instances is in MIG mode, no CUDA device, so it is not
published (gpuways.whole_unusable). No groups are ever published for MIG.

Dynamic MIG (NVML's profiles): counters ``memory-slice-<i>`` (1 each), ``compute-slices`` and
``ofa-engines``; a profile's placement consumes the memory slices it covers, its compute slices
and its OFA, so the allocator never puts two overlapping placements (or two media-extension
instances) on one GPU, and the whole GPU consumes everything, so it never goes beside one.
"""

from __future__ import annotations

from agent.publish.validation import device_problems, fitted
from discovery.attributes import quantity
from discovery.gpuways import Way, countable, partitioning, published_ways, quantity_bytes, way_device, whole_unusable

XCDS, MEMORY, INSTANCES = "xcds", "memory", "compute-instances"
SLICE, COMPUTE_SLICES, OFA = "memory-slice-", "compute-slices", "ofa-engines"


def counter_set_name(gpu_name: str) -> str:
    return gpu_name  # gpu-<bdf>: a DNS label, and PF/VF counter sets are named pf-<bdf>


def _amd_counters(way: Way) -> dict[str, int]:
    pt = partitioning(way.parent)
    out = {XCDS: pt.xcds} if pt.xcds else {}
    if "memory" in way.parent.capacity:
        out[MEMORY] = quantity_bytes(way.parent.capacity["memory"])
    return out


def _mig_counters(way: Way) -> dict[str, int]:
    """Dynamic MIG: every memory slice a placement reaches, the profiles' largest compute
    slice count (the whole GPU's) and OFA count."""
    profiles = partitioning(way.parent).profiles
    slices = max(start + size for p in profiles for start, size in p.placements)
    out = {f"{SLICE}{i}": 1 for i in range(slices)}
    out[COMPUTE_SLICES] = max(p.slices for p in profiles)
    if ofa := max(p.ofa for p in profiles):
        out[OFA] = ofa
    return out


def _placement_share(way: Way) -> dict[str, int]:
    out = {f"{SLICE}{i}": 1 for i in range(way.start, way.start + way.size)}
    out[COMPUTE_SLICES] = way.profile.slices
    if way.profile.ofa:
        out[OFA] = way.profile.ofa
    return out


def _q(counter: str, n: int) -> str:
    return quantity(n) if counter == MEMORY else str(n)


def _consumption(set_name: str, totals: dict[str, int], way: Way, groups: bool) -> dict:
    share = {k: _q(k, v // way.parts) for k, v in totals.items()}
    if way.kind == "mig":
        share = {INSTANCES: "1"}
    elif way.kind == "mig-placement":
        share = {k: str(v) for k, v in _placement_share(way).items()}
    elif way.kind == "whole":
        share = {k: _q(k, v) for k, v in totals.items()}
    entry: dict = {"counterSet": set_name, "counters": {k: {"value": v} for k, v in share.items()}}
    if groups and way.group:
        entry["compatibilityGroups"] = [way.group]
    return entry


def expand(entries: list[dict], devices: dict, *, groups: bool, driver_name: str, list_attributes: bool,
           taints: dict[str, list[dict]] | None = None) -> tuple[list[dict], list[dict], list[tuple[str, str]]]:
    """-> (entries with each partitionable GPU followed by its partitions, counter sets,
    rejected (name, reason)). ``devices``: inventory name -> Device; ``taints``: a MIG device's
    own (an XID in its instance), by its name."""
    out: list[dict] = []
    counter_sets: list[dict] = []
    rejected: list[tuple[str, str]] = []
    # a name NVML's answers give twice (a placement listed twice, two sizes at one start) is one
    # device: the server refuses a slice naming it twice, the allocator a pool that does
    taken = {e["name"] for e in entries}
    for entry in entries:
        device = devices.get(entry["name"])
        gpu_ways = published_ways(device, groups) if device is not None else []
        if len(gpu_ways) < 2:
            out.append(entry)
            continue
        if gpu_ways[1].kind == "mig-placement":
            totals = _mig_counters(gpu_ways[1])
        elif gpu_ways[0].parent.gpu.partitioning.kind == "mig":
            totals = {INSTANCES: len(gpu_ways) - 1}
        else:
            totals = _amd_counters(gpu_ways[0])
            if not countable(gpu_ways):
                out.append(entry)
                rejected.append((entry["name"] + "-*", "partitions left out: the GPU's XCC count or memory is unknown"))
                continue
        set_name = counter_set_name(device.name)
        counter_sets.append({"name": set_name, "counters": {k: {"value": _q(k, v)} for k, v in totals.items()}})
        for way in gpu_ways:
            if way.kind == "whole" and whole_unusable(device):
                continue  # static MIG: only its MIG devices are devices CUDA sees
            if way.kind != "whole" and way.name in taken:
                rejected.append((way.name, "device name used twice in the pool"))
                continue
            taken.add(way.name)
            if way.kind == "whole":
                e = fitted(dict(way_device(way).to_api(), **{k: v for k, v in entry.items() if k not in ("name", "attributes")}))
                if problems := device_problems(e, driver_name, list_attributes):  # its mode's attributes added
                    rejected.append((way.name, "; ".join(problems)))
                    continue
            else:
                e = way_device(way).to_api()
                # a partition is no healthier than its GPU (--taint-unhealthy), and has faults of its own
                if tainted := entry.get("taints") or (taints or {}).get(way.name):
                    e["taints"] = [dict(t) for t in tainted]
                if problems := device_problems(e, driver_name, list_attributes):
                    rejected.append((way.name, "; ".join(problems)))
                    continue
            e["consumesCounters"] = list(e.get("consumesCounters") or []) + [_consumption(set_name, totals, way, groups)]
            out.append(e)
    return out, counter_sets, rejected
