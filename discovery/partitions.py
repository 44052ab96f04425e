"""GPU partitions as the kernel exposes them now. Read-only, like all of discovery.

AMD Instinct (amdgpu): ``current_/available_compute_partition`` and
``current_/available_memory_partition`` in the PCI function's directory; each partition is a
KFD topology node whose ``location_id`` carries the GPU's bus/device with the partition
number as PCI function (``0000:05:00.3`` is partition 3 of ``0000:05:00.0``) and whose
``drm_render_minor`` names its render node: partition 0 uses the function's own, the others
one below ``/sys/devices/platform/amdgpu_xcp_<N>`` (reference/sysfs.md §3.1, features §12).

NVIDIA MIG without NVML: ``/proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<G>/ci<C>/access``
exist for created instances only; ``/proc/driver/nvidia-caps/mig-minors`` gives the minor of
``/dev/nvidia-caps/nvidia-cap<N>`` for each of them.
"""

from __future__ import annotations

import re

from discovery.devnodes import NodeResolver
from discovery.models import DeviceNode, GpuPartition, MigProfile, Partitioning, PciFunction, Problem
from discovery.sysfs import AttrError, Dir, HostFS

# partitions per compute mode, and memory partitions per memory mode (amdgpu_gfx.c / amdgpu_gmc.c)
COMPUTE_PARTS = {"SPX": 1, "DPX": 2, "TPX": 3, "QPX": 4, "CPX": 8}
CPX_XCCS = (2, 4, 6, 8)  # XCC counts whose GPUs offer CPX (amdgpu's supported modes per XCC count)
MEMORY_PARTS = {"NPS1": 1, "NPS2": 2, "NPS3": 3, "NPS4": 4, "NPS6": 6, "NPS8": 8}
KFD_NODES = "sys/class/kfd/kfd/topology/nodes"
MIG_MINORS = "proc/driver/nvidia-caps/mig-minors"
_XCP_DEVICE = re.compile(r"^amdgpu_xcp[._]\d+$")
_GI = re.compile(r"^gi(\d{1,3})$")
_CI = re.compile(r"^ci(\d{1,3})$")
_MIG_LINE = re.compile(r"^(gpu\d+/gi\d+(?:/ci\d+)?/access|config|monitor) (\d+)$")


def parse_modes(text: str, known: dict[str, int]) -> tuple[str, ...]:
    """``"SPX, DPX, QPX, CPX"`` -> the known modes in the kernel's order (unknown ones dropped)."""
    out: list[str] = []
    for word in re.split(r"[,\s]+", text.strip().upper()):
        if word in known and word not in out:
            out.append(word)
    return tuple(out)


def part_count(compute: str, xcds: int | None) -> int:
    """Partitions of ``compute`` on a GPU with ``xcds`` XCCs: CPX gives every XCC a partition of
    its own (amdgpu's ``num_xcp = NUM_XCC`` for CPX: 8 on an MI300X, 4 on an MI308X, 6 on an
    MI300A), the other modes a fixed count. 8 for CPX when the XCC count is unknown."""
    return xcds if compute == "CPX" and xcds else COMPUTE_PARTS[compute]


# memory modes each compute mode runs in (amdgpu's ``__aqua_vanjaram_get_px_mode_info``);
# TPX: NPS1, or the memory partitions split evenly (kernels differ: NPS3 or NPS4)
_COMPATIBLE_NPS = {"SPX": {"NPS1"}, "DPX": {"NPS1", "NPS2"}, "QPX": {"NPS1", "NPS4"}, "CPX": {"NPS1", "NPS4"}}


def modes_fit(compute: str, memory: str | None, xcds: int | None) -> bool:
    """Whether a compute mode can run in a memory mode on a GPU with ``xcds`` XCCs, as amdgpu's
    ``__aqua_vanjaram_is_valid_mode`` decides: DPX needs a multiple of 4 XCCs, TPX of 3, QPX
    two XCCs per partition, CPX more than one XCC; SPX runs in NPS1 only, DPX in NPS1/NPS2,
    QPX and CPX in NPS1/NPS4 (NPS4 takes QPX or CPX on an MI300X)."""
    parts = part_count(compute, xcds)
    memory = memory or "NPS1"
    mem = MEMORY_PARTS.get(memory, 1)
    if xcds is not None:
        need = {"SPX": xcds > 0, "DPX": xcds % 4 == 0, "TPX": xcds % 3 == 0, "QPX": xcds // 4 >= 2, "CPX": xcds > 1}
        if not need[compute] or xcds % mem:
            return False
    if compute in _COMPATIBLE_NPS:
        return memory in _COMPATIBLE_NPS[compute]
    return mem == 1 or (parts >= mem and parts % mem == 0)


def _props(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if (v := value.strip()).isascii() and v.isdigit():
            out[key] = int(v)
    return out


def kfd_gpu_nodes(fs: HostFS, problems: list[Problem]) -> list[dict[str, int]]:
    """Properties of every KFD GPU node (CPU nodes have no ``drm_render_minor``)."""
    base = fs.path(KFD_NODES)
    try:
        names = fs.listdir(base)
    except AttrError:
        return []
    out = []
    for name in names:
        if not name.isdigit():
            continue
        try:
            props = _props(fs.read_text(f"{base}/{name}/properties", limit=16384))
        except AttrError as err:
            problems.append(Problem(what=f"kfd node {name}", reason=err.reason))
            continue
        if props.get("simd_count") and "location_id" in props and "drm_render_minor" in props:
            out.append(props)
    return out


def _bus_dev(bdf: str) -> tuple[int, int, int, int]:
    dom, bus, rest = bdf.split(":")
    dev, fn = rest.split(".")
    return int(dom, 16), int(bus, 16), int(dev, 16), int(fn, 16)


def _render_node(fs: HostFS, resolver: NodeResolver, fn_dir: str, minor: int, problems: list[Problem]) -> DeviceNode | None:
    """``/dev/dri/renderD<minor>``, if its class device belongs to this GPU (its own function or
    an ``amdgpu_xcp`` platform device): a stale KFD entry must not hand out another GPU's node."""
    name = f"renderD{minor}"
    try:
        class_dir = fs.follow(fs.path("sys/class/drm", name))
        owner = fs.resolve_link(f"{class_dir}/device")
    except AttrError as err:
        problems.append(Problem(what=f"/dev/dri/{name}", reason=f"partition render node: {err.reason}"))
        return None
    if owner != fn_dir and not _XCP_DEVICE.match(owner.rsplit("/", 1)[-1]):
        problems.append(Problem(what=f"/dev/dri/{name}", reason=f"belongs to {fs.rel(owner)}, not this GPU's partitions"))
        return None
    return resolver.resolve(f"/dev/dri/{name}", problems, sysfs_dev=f"{class_dir}/dev")


def _mode(fs: HostFS, d: Dir, name: str, known: dict[str, int], problems: list[Problem]) -> str | None:
    if not d.has(name):
        return None
    try:
        value = fs.read_attr(f"{d.path}/{name}", limit=64).upper()
    except AttrError as err:
        problems.append(Problem(what=name, reason=err.reason))
        return None
    if value not in known:
        problems.append(Problem(what=name, reason=f"unknown mode {value[:16]!r}"))
        return None
    return value


def _available(fs: HostFS, d: Dir, name: str, known: dict[str, int]) -> tuple[str, ...]:
    if not d.has(name):
        return ()
    try:
        return parse_modes(fs.read_attr(f"{d.path}/{name}", limit=256), known)
    except AttrError:
        return ()


def amd_kfd_nodes(fs: HostFS, bdf: str, problems: list[Problem]) -> list[dict[str, int]]:
    """The KFD GPU nodes of the amdgpu GPU at ``bdf``, by partition number: one per compute
    partition (one for a GPU without partitions)."""
    dom, bus, dev, _ = _bus_dev(bdf)
    mine = [p for p in kfd_gpu_nodes(fs, problems)
            if (p.get("domain", 0), p["location_id"] >> 8, (p["location_id"] >> 3) & 0x1F) == (dom, bus, dev)]
    first = next((p for p in mine if p["location_id"] & 7 == 0), None)
    if first is not None and first.get("unique_id"):  # a multi-function card's other functions are not partitions
        mine = [p for p in mine if p.get("unique_id") == first["unique_id"]]
    return sorted(mine, key=lambda p: p["location_id"] & 7)


def amd_render_nodes(fs: HostFS, resolver: NodeResolver, bdf: str, fn_dir: str, problems: list[Problem]) -> list[DeviceNode]:
    """The render nodes of every compute partition of the amdgpu GPU at ``bdf`` (``fn_dir``: its
    sysfs directory, resolved), as its KFD nodes name them: partition 0's is the function's own,
    the others' are below ``amdgpu_xcp`` platform devices. None for a GPU without partitions."""
    if not fs.exists(f"{fn_dir}/current_compute_partition"):
        return []
    nodes = (_render_node(fs, resolver, fn_dir, p["drm_render_minor"], problems) for p in amd_kfd_nodes(fs, bdf, problems))
    return [n for n in nodes if n is not None]


def compute_units(nodes: list[dict[str, int]]) -> tuple[int, int] | None:
    """(compute units, SIMDs) of these KFD nodes together (a CU is ``simd_per_cu`` SIMDs), as
    AMD's DRA driver counts them; None without nodes or with a node that does not say."""
    if not nodes or not all(p.get("simd_per_cu") for p in nodes):
        return None
    return sum(p["simd_count"] // p["simd_per_cu"] for p in nodes), sum(p["simd_count"] for p in nodes)


def read_amd(fs: HostFS, resolver: NodeResolver, fn: PciFunction, d: Dir, problems: list[Problem],
             mine: list[dict[str, int]] | None = None) -> Partitioning | None:
    """The GPU's compute/memory modes and the partitions the kernel exposes now (None: the
    GPU has no compute partitions). ``mine``: its KFD nodes, when the caller has read them."""
    compute = _mode(fs, d, "current_compute_partition", COMPUTE_PARTS, problems)
    if compute is None:
        return None
    memory = _mode(fs, d, "current_memory_partition", MEMORY_PARTS, problems)
    if mine is None:
        mine = amd_kfd_nodes(fs, fn.bdf, problems)
    parts = []
    for p in mine:
        node = _render_node(fs, resolver, d.path, p["drm_render_minor"], problems)
        if node is not None:
            parts.append(GpuPartition(index=p["location_id"] & 7, nodes=(node,), xcds=p.get("num_xcc") or None))
    xcds = sum(p.xcds for p in parts) if parts and all(p.xcds for p in parts) else None
    if xcds and xcds > max(CPX_XCCS):  # CPX would make a partition of each: a count past any GPU's is no count
        problems.append(Problem(what="partitions",
                                reason=f"KFD nodes give {xcds} XCCs, more than any GPU has ({max(CPX_XCCS)}): XCC count unknown"))
        xcds = None
    if compute == "CPX" and xcds:  # a partition per XCC: one missing shows as a count amdgpu has not
        xcds = next((n for n in CPX_XCCS if n >= max(xcds, max(p.index for p in parts) + 1)), xcds)
    if len(parts) != (want := part_count(compute, xcds)):
        problems.append(Problem(what="partitions", reason=f"{compute} has {want} partitions, the kernel exposes {len(parts)}"))
    return Partitioning(
        kind="amd", compute_mode=compute, memory_mode=memory, partitions=tuple(parts), xcds=xcds,
        compute_modes=_available(fs, d, "available_compute_partition", COMPUTE_PARTS),
        memory_modes=_available(fs, d, "available_memory_partition", MEMORY_PARTS),
    )  # fmt: skip


def parse_mig_minors(text: str) -> dict[str, int]:
    """``gpu0/gi1/ci0/access 13`` lines -> {path: minor}; other lines are ignored."""
    out = {}
    for line in text.splitlines():
        m = _MIG_LINE.match(line.strip())
        if m:
            out[m.group(1)] = int(m.group(2))
    return out


def _access_minor(fs: HostFS, path: str) -> int | None:
    try:
        for line in fs.read_text(path, limit=4096).splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "DeviceFileMinor" and (v := value.strip()).isascii() and v.isdigit():
                return int(v)
    except AttrError:
        pass
    return None


def read_mig(fs: HostFS, resolver: NodeResolver, minor: int, problems: list[Problem]) -> Partitioning | None:
    """Created MIG compute instances of GPU ``minor`` with their cap nodes (None: no MIG)."""
    base = fs.path("proc/driver/nvidia/capabilities", f"gpu{minor}", "mig")
    if not fs.is_dir(base):
        return None
    try:
        minors = parse_mig_minors(fs.read_text(fs.path(MIG_MINORS), limit=1 << 20))
    except AttrError as err:
        problems.append(Problem(what="MIG", reason=f"{MIG_MINORS}: {err.reason}"))
        return Partitioning(kind="mig")
    parts: list[GpuPartition] = []
    for gi_name in _entries(fs, base):  # (MIG turned off, an instance destroyed, while it is read)
        if not (g := _GI.match(gi_name)) or not fs.exists(f"{base}/{gi_name}/access"):
            continue
        gi = int(g.group(1))
        for ci_name in _entries(fs, f"{base}/{gi_name}"):
            if not (c := _CI.match(ci_name)) or not fs.exists(f"{base}/{gi_name}/{ci_name}/access"):
                continue
            ci = int(c.group(1))
            nodes = []
            for key, access in ((f"gpu{minor}/gi{gi}/access", f"{base}/{gi_name}/access"),
                                (f"gpu{minor}/gi{gi}/ci{ci}/access", f"{base}/{gi_name}/{ci_name}/access")):
                cap = minors.get(key)
                if cap is None or _access_minor(fs, access) not in (None, cap):
                    problems.append(Problem(what=f"MIG gi{gi}/ci{ci}", reason=f"{key}: no minor, or it disagrees with its access file"))
                    break
                node = resolver.resolve(f"/dev/nvidia-caps/nvidia-cap{cap}", problems, proc_name="nvidia-caps", minor=cap)
                if node is None:
                    break
                nodes.append(node)
            else:
                parts.append(GpuPartition(index=len(parts), nodes=tuple(nodes), gi=gi, ci=ci))
    parts.sort(key=lambda p: (p.gi, p.ci))
    return Partitioning(kind="mig", partitions=tuple(p.replace(index=i) for i, p in enumerate(parts)))


def mig_layout(fs: HostFS, minor: int) -> frozenset[tuple[int, int]] | None:
    """(GPU instance, compute instance) of every instance procfs lists for GPU ``minor``, by name
    only (None: no MIG directory): what tells that the layout changed, cheaply, between scans."""
    base = fs.path("proc/driver/nvidia/capabilities", f"gpu{minor}", "mig")
    try:
        gis = [(int(g.group(1)), name) for name in fs.listdir(base) if (g := _GI.match(name))]
        return frozenset((gi, int(c.group(1))) for gi, name in gis for ci in _entries(fs, f"{base}/{name}")
                         if (c := _CI.match(ci)))
    except AttrError:
        return None


def _entries(fs: HostFS, path: str) -> list[str]:
    try:
        return fs.listdir(path)
    except AttrError:  # a GPU instance destroyed while it was listed
        return []


def with_profiles(pt: Partitioning | None, profiles: tuple[MigProfile, ...], instances: list | None,
                  problems: list[Problem]) -> Partitioning | None:
    """Static MIG with NVML: each compute instance procfs lists gets its GPU instance's profile and
    placement from NVML's list of the instances that exist (``instances``: discovery/mig.py
    ``GpuInstanceNow``). One NVML does not list (made between the two reads) keeps none."""
    if pt is None or not pt.partitions:
        return pt
    if instances is None:
        problems.append(Problem(what="MIG", reason="NVML did not list the GPU instances: MIG devices published without profiles"))
        return pt
    by_id = {p.id: p for p in profiles}
    gis = {g.gi: g for g in instances}
    parts = []
    for p in pt.partitions:
        g = gis.get(p.gi)
        if g is None or g.profile not in by_id:
            problems.append(Problem(what=f"MIG gi{p.gi}", reason="NVML does not list this GPU instance: published without its profile"))
            parts.append(p)
            continue
        parts.append(p.replace(profile=by_id[g.profile], start=g.start))
    return pt.replace(partitions=tuple(parts))
