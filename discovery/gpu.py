"""GPUs: DRM nodes, NVIDIA's /dev/nvidiaN from procfs, AMD's /dev/kfd and VRAM size."""

from __future__ import annotations

import re
from typing import Callable

from discovery.devnodes import NodeResolver
from discovery.drm import drm_minors, drm_nodes
from discovery.models import DeviceNode, GpuInfo, Partitioning, PciFunction, Problem
from discovery.nvidia import NvidiaNode
from discovery.partitions import amd_kfd_nodes, part_count, compute_units, read_amd, read_mig, with_profiles
from discovery.sysfs import AttrError, Dir, HostFS

NVIDIA_MAJOR = 195  # registered static major of the NVIDIA driver
NVIDIACTL_MINOR = 255
_VENDORS = {"10de": "nvidia", "1002": "amd", "8086": "intel"}
# a GPU UUID as the driver spells it: it is published, and names the GPU's MPS directory (prepare/mps.py)
_GPU_UUID = re.compile(r"GPU-[0-9A-Za-z-]{1,60}")


def parse_nvidia_information(text: str) -> dict[str, str]:
    """``/proc/driver/nvidia/gpus/<bdf>/information``: ``Key: \\t value`` lines."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def _nvidia(fs: HostFS, resolver: NodeResolver, fn: PciFunction, problems: list[Problem]):
    info_path = fs.path("proc/driver/nvidia/gpus", fn.bdf, "information")
    try:
        info = parse_nvidia_information(fs.read_text(info_path, limit=16384))
    except AttrError as err:
        problems.append(Problem(what="/dev/nvidiaN", reason=f"{fs.rel(info_path)}: {err.reason}"))
        return None, None, None, []
    minor_text = info.get("Device Minor", "")
    minor = int(minor_text) if minor_text.isascii() and minor_text.isdigit() and int(minor_text) < NVIDIACTL_MINOR else None
    nodes: list[DeviceNode] = []
    if minor is None:
        problems.append(Problem(what="/dev/nvidiaN", reason=f"bad or missing Device Minor {minor_text[:20]!r}"))
    else:
        major = resolver.char_majors.get("nvidia-frontend") or resolver.char_majors.get("nvidia") or NVIDIA_MAJOR
        for path, mi in ((f"/dev/nvidia{minor}", minor), ("/dev/nvidiactl", NVIDIACTL_MINOR)):
            node = resolver.resolve(path, problems, major=major, minor=mi)
            if node is not None:
                nodes.append(node)
        for path, mi in (("/dev/nvidia-uvm", 0), ("/dev/nvidia-uvm-tools", 1)):
            node = resolver.resolve(path, problems, proc_name="nvidia-uvm", minor=mi)
            if node is not None:
                nodes.append(node)
    uuid = info.get("GPU UUID") or None
    if uuid is not None and not _GPU_UUID.fullmatch(uuid):
        problems.append(Problem(what="uuid", reason=f"GPU UUID {uuid[:40]!r} is not GPU-<letters, digits, dashes>"))
        uuid = None
    model = info.get("Model") or None
    return minor, uuid, model, nodes


def _vram_bytes(fs: HostFS, d: Dir, problems: list[Problem]) -> int | None:
    if not d.has("mem_info_vram_total"):
        return None
    try:
        n = fs.read_int(f"{d.path}/mem_info_vram_total")
    except AttrError as err:
        if err.reason != "missing":
            problems.append(Problem(what="memory", reason=f"mem_info_vram_total: {err.reason}"))
        return None
    if n >= 1 << 63:  # past the largest quantity: the API would refuse the whole GPU
        problems.append(Problem(what="memory", reason=f"mem_info_vram_total: {n} bytes is out of range"))
        return None
    return n if n > 0 else None


def read_gpu(fs: HostFS, resolver: NodeResolver, fn: PciFunction, d: Dir, problems: list[Problem],
             nvidia_node: Callable[[], NvidiaNode] | None = None):
    """-> (GpuInfo, device nodes, capacity). ``nvidia_node`` gives the node's NVIDIA driver
    (NVML, versions) for the facts of an NVIDIA GPU."""
    vendor = _VENDORS.get(fn.vendor_id, "other")
    card, render = drm_minors(fs, d)
    nodes: list[DeviceNode] = []
    capacity: dict[str, int] = {}
    minor = uuid = model = partitioning = facts = None
    if vendor == "nvidia" and fn.driver == "nvidia":
        minor, uuid, model, nodes = _nvidia(fs, resolver, fn, problems)
        if minor is not None:
            partitioning = read_mig(fs, resolver, minor, problems)
        node = nvidia_node() if nvidia_node else NvidiaNode(fs)
        facts = node.facts(fn.bdf, fn.device_id, uuid)
        if minor is not None and (profiles := node.mig_profiles(fn.bdf)):
            if node.static_mig:  # the operator's instances, with their profiles
                partitioning = with_profiles(partitioning, profiles, node.mig_instances(fn.bdf), problems)
            else:  # dynamic MIG: every profile and placement
                partitioning = (partitioning or Partitioning(kind="mig")).replace(profiles=profiles)
        if facts.memory_bytes:
            capacity["memory"] = facts.memory_bytes
    nodes += drm_nodes(fs, resolver, d.path, card, render, problems)
    if fn.driver == "amdgpu":
        kfd = resolver.resolve("/dev/kfd", problems, sysfs_dev=fs.path("sys/class/kfd/kfd/dev"))
        if kfd is not None:
            nodes.append(kfd)
        vram = _vram_bytes(fs, d, problems)
        if vram:
            capacity["memory"] = vram
        topology = amd_kfd_nodes(fs, fn.bdf, problems)
        if d.has("current_compute_partition"):
            partitioning = read_amd(fs, resolver, fn, d, problems, topology)
        whole = partitioning is None or (partitioning.compute_mode is not None
                                         and len(topology) == part_count(partitioning.compute_mode, partitioning.xcds))
        if whole and (counts := compute_units(topology)) is not None:  # (a partition missing: not the GPU's count)
            capacity["computeUnits"], capacity["simdUnits"] = str(counts[0]), str(counts[1])
    if fn.driver != "nvidia" and card is None and render is None:  # (vfio-pci: never read here, discovery/vfio.py)
        problems.append(Problem(what="drm", reason=f"driver {fn.driver} exposes no DRM card or render node"))
    if model is not None and not re.fullmatch(r"[\x20-\x7e]{1,64}", model):
        model = None
    info = GpuInfo(vendor=vendor, drm_card=card, drm_render=render, nvidia_minor=minor, nvidia_uuid=uuid, model=model,
                   partitioning=partitioning, nvidia=facts)
    return info, nodes, capacity
