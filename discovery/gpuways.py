"""The ways of running a partitionable GPU, each one a device: the whole GPU, each AMD
partition of each compute/memory mode the GPU can be put in, each created MIG compute
instance. Pure (no I/O): names, the mode a way needs, and the device a way is, shared by
publishing (agent/publish/partitions.py), prepare (agent/prepare/partitions.py) and the health
stream (which names each published partition).

Names: ``<gpu>-<compute>-<memory>-<index>`` (``gpu-0000-05-00-0-cpx-nps1-3``) and
``<gpu>-mig-gi<G>-ci<C>``; with NVML's MIG profiles (dynamic MIG) one way per profile and
placement, ``<gpu>-mig-<profile>-<start>`` (``gpu-0000-00-06-0-mig-1g-18gb-me-3``); the whole
GPU keeps its own name."""

from __future__ import annotations

from dataclasses import dataclass

from discovery.attributes import MAX_ATTRIBUTES_AND_CAPACITIES, _value, quantity
from discovery.models import Device, GpuPartition, MigProfile, Partitioning
from discovery.partitions import modes_fit, part_count

WHOLE_MODE = ("SPX", "NPS1")  # the whole GPU is its single-partition mode
_PARENT_ONLY = ("uuid",)  # a MIG instance has its own UUID (NVML's): the GPU's would be wrong
# parent attributes a MIG device leaves out first when its own would pass the API's limit
_LEAST_NEEDED = ("subsystemDeviceID", "subsystemVendorID", "pciClass", "pcieLinkSpeed", "pcieLinkWidth", "brand")


@dataclass(frozen=True)
class Way:
    name: str
    parent: Device
    kind: str  # "whole" | "amd" | "mig" (an existing instance) | "mig-placement" (dynamic MIG)
    compute: str | None = None  # the AMD mode this way runs in (None: any / not AMD)
    memory: str | None = None
    index: int = 0  # partition number in its mode
    parts: int = 1  # partitions of its mode
    instance: GpuPartition | None = None  # MIG: the compute instance
    profile: MigProfile | None = None  # dynamic MIG: the GI profile, and the placement below
    start: int = 0
    size: int = 0

    @property
    def mode(self) -> str | None:
        return f"{self.compute}/{self.memory}" if self.compute else None

    @property
    def group(self) -> str | None:
        """The compatibility group of its mode (``cpx-nps1``)."""
        return f"{self.compute}-{self.memory}".lower() if self.compute else None


def partitioning(device: Device) -> Partitioning | None:
    return device.gpu.partitioning if device.gpu is not None else None


def amd_modes(pt: Partitioning) -> list[tuple[str, str]]:
    """(compute, memory) pairs this GPU can run in: the available ones that fit together,
    or only the current one when the GPU cannot switch. Those of another memory mode than the
    current one need a driver reload (``reachable``): named, never published or switched to."""
    memory_now = pt.memory_mode or "NPS1"
    if not pt.switchable:
        return [(pt.compute_mode, memory_now)] if pt.compute_mode else []
    memories = pt.memory_modes or (memory_now,)
    return [(c, m) for m in memories for c in pt.compute_modes if modes_fit(c, m, pt.xcds)]


def reachable(pt: Partitioning, memory: str | None) -> bool:
    """Whether a mode of ``memory`` is one prepare can switch the GPU to: its memory mode is the
    current one. amdgpu takes a write to ``current_memory_partition`` as a request for the next
    driver reload (amdgpu_gmc_set_memory_partition), so the agent never writes it; compute modes
    switch at once, within the current memory mode."""
    return (memory or "NPS1") == (pt.memory_mode or "NPS1")


def ways(device: Device) -> list[Way]:
    """Every way of running ``device`` (the whole GPU first); [] for a GPU without partitions."""
    pt = partitioning(device)
    if pt is None:
        return []
    if pt.kind == "mig" and pt.profiles:
        return [Way(device.name, device, "whole")] + [
            Way(mig_name(device.name, p, start), device, "mig-placement", profile=p, start=start, size=size)
            for p in pt.profiles for start, size in p.placements]
    if pt.kind == "mig":
        if not pt.partitions:
            return []
        out = [Way(device.name, device, "whole")]
        for p in pt.partitions:
            out.append(Way(f"{device.name}-mig-gi{p.gi}-ci{p.ci}", device, "mig", index=p.index, instance=p))
        return out
    modes = amd_modes(pt)
    # the whole GPU is SPX/NPS1 where the GPU can be switched there; in another memory mode (NPS4)
    # it cannot without a driver reload: the whole GPU is then the GPU as it is, as for one that cannot switch
    now = [m for m in modes if reachable(pt, m[1])]
    whole = WHOLE_MODE if WHOLE_MODE in now or (pt.compute_mode, pt.memory_mode or "NPS1") == WHOLE_MODE else (None, None)
    out = [Way(device.name, device, "whole", compute=whole[0], memory=whole[1])]
    for compute, memory in modes:
        parts = part_count(compute, pt.xcds)
        if parts == 1:
            continue  # SPX: that is the whole GPU
        for i in range(parts):
            out.append(Way(f"{device.name}-{compute.lower()}-{memory.lower()}-{i}", device, "amd", compute, memory, i, parts))
    return out


def published_ways(device: Device, groups: bool) -> list[Way]:
    """The ways ``--partitions`` publishes (agent/publish/partitions.py): for MIG all of them;
    for AMD with compatibility groups the whole GPU and the partitions of every compute mode of
    the GPU's current memory mode (another memory mode needs a driver reload: ``reachable``),
    else the whole GPU and the partitions of the mode the GPU is in now (counters alone cannot
    keep two modes apart)."""
    gpu_ways = ways(device)
    if not gpu_ways or gpu_ways[0].parent.gpu.partitioning.kind == "mig":
        return gpu_ways
    pt = partitioning(device)
    if groups:
        return [w for w in gpu_ways if w.kind == "whole" or reachable(pt, w.memory)]
    now = current_mode(device)
    return [w for w in gpu_ways if w.kind == "whole" or (w.compute, w.memory) == now]


def whole_unusable(device: Device) -> str | None:
    """Why the whole GPU is no device a container can use, or None. A GPU whose MIG instances
    procfs lists without dynamic MIG (no NVML, or ``nvidia_mig: static``) is in MIG mode: CUDA sees its MIG devices
    only, so its whole GPU is never published and a claim of it fails (as NVIDIA's own driver
    publishes only the MIG devices of a GPU in MIG mode). With NVML (dynamic MIG) the agent can
    turn MIG mode off instead (prepare/steps/migmode.py)."""
    pt = partitioning(device)
    if pt is None or pt.kind != "mig" or pt.profiles or not pt.partitions or "partitionOf" in device.attributes:
        return None  # (a way's device names its GPU: a MIG device, not the whole GPU)
    bdf = device.pci.bdf
    names = ", ".join(f"gi{p.gi}/ci{p.ci}" for p in pt.partitions[:4]) + (", ..." if len(pt.partitions) > 4 else "")
    return (f"GPU {bdf} is in MIG mode (MIG instances {names}): CUDA sees no device on the whole GPU; claim its MIG "
            f"devices (published with --partitions), or destroy them and turn MIG mode off (nvidia-smi mig -i {bdf} "
            f"-dci, then -dgi; nvidia-smi -i {bdf} -mig 0)")


def instances_beside(device: Device) -> bool:
    """Whether the whole GPU of a dynamic-MIG GPU (NVML's profiles) has MIG instances beside it. A node
    that publishes no partitions (``partitions`` off) leaves such a GPU out of its slices: they are the
    instances of claims prepared before ``partitions`` was turned off (or someone's), and a claim of the
    whole GPU would fail (MIG mode is not turned off under instances); back once they are destroyed."""
    pt = partitioning(device)
    return (pt is not None and pt.kind == "mig" and bool(pt.profiles) and bool(pt.partitions)
            and "partitionOf" not in device.attributes)


def countable(gpu_ways: list[Way]) -> bool:
    """Whether each way's share of its GPU can be counted: False for an AMD GPU whose XCC count
    and memory are unknown, or with a mode of more partitions than XCCs (published whole only)."""
    parent = gpu_ways[0].parent
    pt = partitioning(parent)
    if pt.kind == "mig":
        return True
    if not pt.xcds:
        return "memory" in parent.capacity
    return all(w.parts <= pt.xcds for w in gpu_ways)


def partition_names(device: Device, groups: bool) -> list[str]:
    """The partitions published beside ``device`` (the health stream reports each with the
    GPU's verdict); [] for a GPU published whole only."""
    gpu_ways = published_ways(device, groups)
    if len(gpu_ways) < 2 or not countable(gpu_ways):
        return []
    return [w.name for w in gpu_ways if w.kind != "whole"]


def mig_name(gpu: str, profile: MigProfile, start: int) -> str:
    """``gpu-0000-00-06-0-mig-1g-18gb-me-3``: a DNS label (profile names are checked in discovery/mig.py)."""
    return f"{gpu}-mig-{profile.name.replace('.', '-').replace('+', '-')}-{start}"


def _profile(p: MigProfile, start: int, engines: bool, attrs: dict, capacity: dict) -> None:
    """A MIG device's profile, placement and capacities: its GPU instance's memory, and the
    instance's engines where the device has them all (``engines``: a dynamic MIG way, or the only
    compute instance of its GPU instance; compute instances of one GI split its engines)."""
    attrs["migProfile"] = _value("string", p.name)
    attrs["migPlacementStart"] = _value("int_", start)
    capacity["memory"] = quantity(p.memory_mb << 20)
    if engines:
        capacity.update(multiprocessors=str(p.multiprocessors), copyEngines=str(p.copy_engines),
                        decoders=str(p.decoders), encoders=str(p.encoders), jpegEngines=str(p.jpeg), ofaEngines=str(p.ofa))


def current_mode(device: Device) -> tuple[str | None, str | None]:
    pt = partitioning(device)
    return (pt.compute_mode, pt.memory_mode or "NPS1") if pt is not None and pt.kind == "amd" else (None, None)


def way_device(way: Way, now: Partitioning | None = None) -> Device:
    """The device a way is: the parent's attributes plus its partition's, its share of the
    GPU's memory, and (from ``now``, the partitions exposed at this moment) its nodes. An AMD
    partition whose mode is not the current one has no nodes yet."""
    parent = way.parent
    if way.kind == "whole":
        if way.compute is None:
            return parent
        attrs = dict(parent.attributes, computePartition=_value("string", way.compute),
                     memoryPartition=_value("string", way.memory))
        within_limit(attrs, parent.capacity)  # a GPU at the API's limit already: as a partition does
        return parent.replace(attributes=attrs)
    attrs = {k: v for k, v in parent.attributes.items() if k not in _PARENT_ONLY}
    attrs["partitionOf"] = _value("string", parent.name)
    if way.kind != "mig-placement":
        attrs["partitionIndex"] = _value("int_", way.index)
    capacity: dict[str, str] = {}
    if way.kind == "mig-placement":
        _profile(way.profile, way.start, True, attrs, capacity)
        nodes = parent.device_nodes  # its cap nodes once prepare created the instance (prepare/mig.py)
    elif way.kind == "mig":
        attrs["migGpuInstance"] = _value("int_", way.instance.gi)
        attrs["migComputeInstance"] = _value("int_", way.instance.ci)
        if (instance := way.instance).profile is not None:  # static MIG with NVML
            sole = sum(p.gi == instance.gi for p in partitioning(parent).partitions) == 1
            _profile(instance.profile, instance.start, sole, attrs, capacity)
        nodes = tuple(n for n in parent.device_nodes) + way.instance.nodes
    else:
        attrs["computePartition"] = _value("string", way.compute)
        attrs["memoryPartition"] = _value("string", way.memory)
        if "memory" in parent.capacity:
            capacity["memory"] = quantity(quantity_bytes(parent.capacity["memory"]) // way.parts)
        for count in ("computeUnits", "simdUnits"):  # a mode splits the XCCs, so their CUs, evenly
            if count in parent.capacity:
                capacity[count] = str(int(parent.capacity[count]) // way.parts)
        nodes = ()
        pt = now if now is not None else partitioning(parent)
        if pt is not None and (pt.compute_mode, pt.memory_mode or "NPS1") == (way.compute, way.memory):
            mine = next((p for p in pt.partitions if p.index == way.index), None)
            kfd = tuple(n for n in parent.device_nodes if n.path == "/dev/kfd")
            nodes = (mine.nodes + kfd) if mine is not None else ()
    within_limit(attrs, capacity)
    return parent.replace(name=way.name, device_nodes=nodes, attributes=dict(sorted(attrs.items())),
                   capacity=capacity, problems=())


def within_limit(attrs: dict, capacity: dict) -> None:
    """A way's own entries within resource.k8s.io/v1's 32 attributes and capacities: the GPU's
    least needed attributes left out first. (Publishing holds every device entry to it so: what it
    adds, a share's capacities or a VF's PF address, never costs a device at the limit.)"""
    for name in _LEAST_NEEDED:
        if len(attrs) + len(capacity) <= MAX_ATTRIBUTES_AND_CAPACITIES:
            break
        attrs.pop(name, None)


# every suffix ``attributes.quantity`` writes: a size of whole GBs (192000000000 bytes) is "192G"
_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity_bytes(q: str) -> int:
    """Inverse of ``attributes.quantity`` (binary or decimal suffixes, or plain bytes)."""
    for suffix in (q[-2:], q[-1:]):
        if suffix in _UNITS:
            return int(q[: -len(suffix)]) * _UNITS[suffix]
    return int(q)


def by_name(devices) -> dict[str, Way]:
    """Way name -> way, for every partitionable device of an inventory."""
    return {w.name: w for d in devices for w in ways(d)}
