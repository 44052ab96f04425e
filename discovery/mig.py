"""MIG through NVML, read-only: a GPU's GPU-instance profiles with their placements, its MIG
mode, and the GPU and compute instances that exist (docs/partitions.md, "Dynamic MIG").

Every function takes NVML's Python bindings (``pynvml``, or the simulated one in tests) and a
device handle, and must run on the NVML thread (``discovery/nvml.py``): NVML is called from one
thread only, never from the event loop. NVML's answers are input: a profile whose name is not
``<n>g.<m>gb[+ext]`` or whose numbers are out of range is left out, never published.

The profile table NVML gives with MIG disabled is the same as with it enabled (measured on an
H200; the H200 facts sheet of the shared reference material), so the profiles are read once per GPU."""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass

from discovery.models import MigProfile

MAX_PLACEMENTS = 32  # more than any GPU has (an H200's 1g profiles have 7)
MAX_INSTANCES = 32  # GPU instances of one profile, compute instances of one GI
MAX_SLICES = 16  # memory slices per GPU (8 on A100/H100/H200); with 2 more, within a counter set's 32 counters
_NAME = re.compile(r"^(?:MIG )?(\d{1,2}g\.\d{1,4}gb(?:\+[a-z0-9]{1,8}){0,3})$")


@dataclass(frozen=True)
class GpuInstanceNow:
    """A GPU instance that exists now, with its compute instances' IDs."""

    gi: int
    profile: int  # the GI profile ID
    start: int
    size: int
    cis: tuple[int, ...]


def _text(v) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _count(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 20 else None


def mig_mode(nv, h) -> tuple[int, int] | None:
    """(current, pending) MIG mode (1 enabled), None when the GPU has no MIG."""
    try:
        current, pending = nv.nvmlDeviceGetMigMode(h)
    except nv.NVMLError:
        return None
    return int(current), int(pending)


def placements(nv, h, profile_id: int) -> tuple[tuple[int, int], ...]:
    """(start, size) of every placement a GPU instance of the profile may take."""
    arr = (nv.c_nvmlGpuInstancePlacement_t * MAX_PLACEMENTS)()
    count = ctypes.c_uint(MAX_PLACEMENTS)
    nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, arr, ctypes.byref(count))
    out = [(arr[i].start, arr[i].size) for i in range(min(count.value, MAX_PLACEMENTS))]
    return tuple(p for p in out if p[1] > 0 and p[0] + p[1] <= MAX_SLICES)


def profile(nv, h, index: int) -> MigProfile | None:
    """GI profile ``index`` (NVML_GPU_INSTANCE_PROFILE_*) of the GPU, None if it has none."""
    try:
        info = nv.nvmlDeviceGetGpuInstanceProfileInfo(h, index)  # version 2: with its name
        where = placements(nv, h, info.id)
    except nv.NVMLError:
        return None
    m = _NAME.match(_text(info.name).strip())
    numbers = [_count(getattr(info, f, None)) for f in ("id", "sliceCount", "multiprocessorCount", "copyEngineCount",
                                                         "decoderCount", "encoderCount", "jpegCount", "ofaCount")]
    memory = getattr(info, "memorySizeMB", None)
    if m is None or None in numbers or not numbers[1] or not where or not isinstance(memory, int) or not 0 < memory < 1 << 40:
        return None
    pid, slices, sms, ce, dec, enc, jpeg, ofa = numbers
    return MigProfile(id=pid, name=m.group(1), slices=slices, memory_mb=memory, multiprocessors=sms, copy_engines=ce,
                      decoders=dec, encoders=enc, jpeg=jpeg, ofa=ofa, placements=where)


def profiles(nv, h) -> tuple[MigProfile, ...]:
    """Every GI profile of a MIG-capable GPU (empty: no MIG), in NVML's order."""
    if mig_mode(nv, h) is None:
        return ()
    out: dict[int, MigProfile] = {}
    for index in range(getattr(nv, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0x12)):
        p = profile(nv, h, index)
        if p is not None and p.id not in out and p.name not in {q.name for q in out.values()}:
            out[p.id] = p
    return tuple(out.values())


def _handles(nv, lister, *args) -> list:
    arr = (nv.c_nvmlGpuInstance_t * MAX_INSTANCES)() if lister == nv.nvmlDeviceGetGpuInstances \
        else (nv.c_nvmlComputeInstance_t * MAX_INSTANCES)()
    count = ctypes.c_uint(MAX_INSTANCES)
    try:
        lister(*args, arr, ctypes.byref(count))
    except nv.NVMLError:
        return []  # a profile the GPU or GI has not
    return [arr[i] for i in range(min(count.value, MAX_INSTANCES))]


def compute_instances(nv, gi) -> list:
    """Handles of a GPU instance's compute instances, of every CI profile."""
    out = []
    for ci_profile in range(getattr(nv, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", 9)):
        out += _handles(nv, nv.nvmlGpuInstanceGetComputeInstances, gi, ci_profile)
    return out


def gpu_instances(nv, h, profile_ids) -> list[GpuInstanceNow]:
    """The GPU instances of the GPU now (of the given GI profiles), with their CIs."""
    out = []
    for pid in profile_ids:
        for gi in _handles(nv, nv.nvmlDeviceGetGpuInstances, h, pid):
            info = nv.nvmlGpuInstanceGetInfo(gi)
            cis = tuple(sorted(nv.nvmlComputeInstanceGetInfo(ci).id for ci in compute_instances(nv, gi)))
            out.append(GpuInstanceNow(gi=info.id, profile=info.profileId, start=info.placement.start,
                                      size=info.placement.size, cis=cis))
    return sorted(out, key=lambda g: (g.start, g.gi))
