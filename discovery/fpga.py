"""FPGAs: Intel DFL (FME and port platform devices below ``fpga_region/regionN``) and
Xilinx Alveo (management PF + user PF of one card, offered as one device)."""

from __future__ import annotations

import re

from discovery.devnodes import NodeResolver
from discovery.drm import drm_minors, drm_nodes
from discovery.models import DeviceNode, FpgaInfo, PciFunction, Problem
from discovery.sysfs import AttrError, Dir, HostFS

_REGION = re.compile(r"^region(\d+)$")
_FME = re.compile(r"^dfl-fme\.(\d+)$")
_PORT = re.compile(r"^dfl-port\.(\d+)$")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_XCLMGMT = re.compile(r"^xclmgmt(\d+)$")
MINORS = 1 << 20  # a device number's minor is 20 bits (MINORBITS)


def _first(names: list[str], pattern: re.Pattern) -> str | None:
    found = sorted((int(m.group(1)), n) for n in names if (m := pattern.match(n)))
    return found[0][1] if found else None


def _hex_id(fs: HostFS, path: str) -> str | None:
    try:
        v = fs.read_attr(path).lower().removeprefix("0x")
    except AttrError:
        return None
    return v if _HEX32.match(v) else None


def read_dfl(fs: HostFS, resolver: NodeResolver, fn: PciFunction, d: Dir, problems: list[Problem]):
    """-> (FpgaInfo, nodes): the port node (what a workload opens), then the FME (PF only)."""
    region, fme, port = _dfl_region(fs, d)
    base = f"{d.path}/fpga_region/{region}" if region else None
    nodes: list[DeviceNode] = []
    afu_id = interface_id = bitstream_id = None
    if port:
        node = resolver.resolve(f"/dev/{port}", problems, sysfs_dev=f"{base}/{port}/dev")
        if node is not None:
            nodes.append(node)
        afu_id = _hex_id(fs, f"{base}/{port}/afu_id")
    if fme:
        node = resolver.resolve(f"/dev/{fme}", problems, sysfs_dev=f"{base}/{fme}/dev")
        if node is not None:
            nodes.append(node)
        bitstream_id = _bitstream_id(fs, f"{base}/{fme}")
        interface_id = _interface_id(fs, f"{base}/{fme}")
    info = FpgaInfo(
        family="dfl", region=region, fme=fme, port=port,
        afu_id=afu_id, interface_id=interface_id, bitstream_id=bitstream_id,
    )  # fmt: skip
    return info, nodes


def _dfl_region(fs: HostFS, d: Dir) -> tuple[str | None, str | None, str | None]:
    """(region, FME, port): the lowest-numbered region holding an FME or a port, else the
    highest-numbered one that could be listed (with neither)."""
    pci_dir = d.path
    try:
        regions = [n for n in fs.listdir(f"{pci_dir}/fpga_region") if _REGION.match(n)] if d.has("fpga_region") else []
    except AttrError:
        regions = []
    region = fme = port = None
    for r in sorted(regions, key=lambda n: int(n[6:])):
        try:
            names = fs.listdir(f"{pci_dir}/fpga_region/{r}")
        except AttrError:
            continue
        fme, port = _first(names, _FME), _first(names, _PORT)
        region = r
        if fme or port:
            break
    return region, fme, port


def _bitstream_id(fs: HostFS, fme_dir: str) -> str | None:
    """The FME's ``bitstream_id`` (``0x`` and at most 16 hex digits), else None."""
    try:
        bitstream_id = fs.read_attr(f"{fme_dir}/bitstream_id").lower()
    except AttrError:
        return None
    return bitstream_id if re.fullmatch(r"0x[0-9a-f]{1,16}", bitstream_id) else None


def _interface_id(fs: HostFS, fme_dir: str) -> str | None:
    """The first ``compat_id`` of the regions below the FME's ``dfl-fme-region.*`` (sorted)."""
    try:
        sub = [n for n in fs.listdir(fme_dir) if n.startswith("dfl-fme-region.")]
    except AttrError:
        sub = []
    interface_id = None
    for s in sorted(sub):
        try:
            inner = [n for n in fs.listdir(f"{fme_dir}/{s}/fpga_region") if _REGION.match(n)]
        except AttrError:
            continue
        for r in sorted(inner):
            interface_id = interface_id or _hex_id(fs, f"{fme_dir}/{s}/fpga_region/{r}/compat_id")
    return interface_id


def _ready(fs: HostFS, d: Dir) -> bool | None:
    if not d.has("ready"):
        return None
    try:
        return fs.read_int(f"{d.path}/ready") == 1
    except AttrError:
        return None


def read_alveo(
    fs: HostFS,
    resolver: NodeResolver,
    mgmt: tuple[PciFunction, Dir] | None,
    user: tuple[PciFunction, Dir] | None,
    problems: list[Problem],
):
    """One Alveo card: ``/dev/xclmgmt<instance>`` of the mgmt PF, then the user PF's DRM nodes."""
    nodes: list[DeviceNode] = []
    instance = None
    ready = None
    if mgmt is not None:
        fn, d = mgmt
        instance, node = _xclmgmt(fs, resolver, d, problems)
        if node is not None:
            nodes.append(node)
        ready = _ready(fs, d)
    if user is not None:
        fn, d = user
        card, render = drm_minors(fs, d)
        nodes += drm_nodes(fs, resolver, d.path, card, render, problems)
        user_ready = _ready(fs, d)
        ready = user_ready if ready is None else (ready and user_ready is not False)
    info = FpgaInfo(
        family="alveo",
        mgmt_bdf=mgmt[0].bdf if mgmt else None,
        user_bdf=user[0].bdf if user else None,
        mgmt_instance=instance,
        ready=ready,
    )
    return info, nodes


def _xclmgmt(fs: HostFS, resolver: NodeResolver, d: Dir, problems: list[Problem]) -> tuple[int | None, DeviceNode | None]:
    """The mgmt PF's instance (its ``instance`` file, else its ``xrt_mgmt/xclmgmtN`` child's
    number) and the node ``/dev/xclmgmt<instance>`` (None where neither tells it or it is absent)."""
    try:
        mgmt_names = fs.listdir(f"{d.path}/xrt_mgmt") if d.has("xrt_mgmt") else []
    except AttrError:
        mgmt_names = []
    name = _first(mgmt_names, _XCLMGMT)
    instance = None
    if d.has("instance"):
        try:
            instance = fs.read_int(f"{d.path}/instance")
        except AttrError:
            pass
        if instance is not None and not 0 <= instance < MINORS:  # no minor: not /dev/xclmgmt-1
            problems.append(Problem(what="instance", reason=f"out of range: {instance}"))
            instance = None
    if instance is None:
        instance = int(name[7:]) if name else None
    if name is None and instance is not None:
        name = f"xclmgmt{instance}"
    if name is None:
        return instance, None
    node = resolver.resolve(
        f"/dev/{name}", problems, sysfs_dev=f"{d.path}/xrt_mgmt/{name}/dev" if name in mgmt_names else None,
        proc_name="xclmgmt", minor=instance,
    )  # fmt: skip
    return instance, node
