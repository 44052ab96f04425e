"""NICs: netdevs below the function (virtio one level deeper), RDMA devices and their
``/dev/infiniband/uverbsN`` nodes."""

from __future__ import annotations

import re

from discovery.devnodes import NodeResolver
from discovery.models import DeviceNode, NetInterface, NicInfo, PciFunction, Problem, RdmaDevice
from discovery.sysfs import AttrError, HostFS

_UVERBS = re.compile(r"^uverbs(\d+)$")
_MAC = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5,19}$")
_IFNAME = re.compile(r"^[^/\s]{1,15}$")


def _net_dirs(fs: HostFS, pci_dir: str) -> list[str]:
    """Directories that hold netdevs: ``<fn>/net`` and virtio's ``<fn>/virtioN/net``."""
    dirs = [f"{pci_dir}/net"]
    try:
        names = fs.listdir(pci_dir)
    except AttrError:
        return dirs
    dirs += [f"{pci_dir}/{n}/net" for n in names if n.startswith("virtio") and fs.is_dir(f"{pci_dir}/{n}")]
    return dirs


def read_interface(fs: HostFS, path: str, name: str, problems: list[Problem]) -> NetInterface:
    def opt(attr: str, parse=str):
        try:
            return parse(fs.read_attr(f"{path}/{attr}"))
        except AttrError as err:
            # speed/carrier read EINVAL while the link is admin-down: expected, not a problem
            # phys_* read EOPNOTSUPP when the driver has no switchdev ops: also expected
            expected = attr in ("speed", "carrier", "duplex") or (
                attr.startswith("phys_") and err.reason.startswith("not supported")
            )
            if err.reason != "missing" and not expected:
                problems.append(Problem(what=f"{name}/{attr}", reason=err.reason))
        except ValueError:
            problems.append(Problem(what=f"{name}/{attr}", reason="unparsable"))
        return None

    mac = opt("address")
    speed = opt("speed", int)
    carrier = opt("carrier", int)
    return NetInterface(
        name=name,
        mac=mac.lower() if mac and _MAC.match(mac.lower()) else None,
        mtu=opt("mtu", int),
        operstate=opt("operstate"),
        carrier=None if carrier is None else carrier == 1,
        speed_mbps=speed if speed is not None and speed > 0 else None,  # -1: up without link / unknown
        phys_port_name=opt("phys_port_name"),
        phys_switch_id=opt("phys_switch_id"),
    )


def read_nic(fs: HostFS, resolver: NodeResolver, fn: PciFunction, pci_dir: str, problems: list[Problem]):
    """-> (NicInfo, device nodes)."""
    interfaces = []
    for net_dir in _net_dirs(fs, pci_dir):
        try:
            names = fs.listdir(net_dir)
        except AttrError:
            continue
        for name in names:
            if _IFNAME.match(name) and fs.is_dir(f"{net_dir}/{name}"):
                interfaces.append(read_interface(fs, f"{net_dir}/{name}", name, problems))

    rdma: list[RdmaDevice] = []
    nodes: list[DeviceNode] = []
    verbs_by_ibdev: dict[str, str] = {}
    try:
        verbs = sorted(
            (int(m.group(1)), n) for n in fs.listdir(f"{pci_dir}/infiniband_verbs") if (m := _UVERBS.match(n))
        )
    except AttrError:
        verbs = []
    for _, uverbs in verbs:
        base = f"{pci_dir}/infiniband_verbs/{uverbs}"
        try:
            verbs_by_ibdev[fs.read_attr(f"{base}/ibdev")] = uverbs
        except AttrError:
            pass
        node = resolver.resolve(f"/dev/infiniband/{uverbs}", problems, sysfs_dev=f"{base}/dev")
        if node is not None:
            nodes.append(node)
    try:
        ibdevs = fs.listdir(f"{pci_dir}/infiniband")
    except AttrError:
        ibdevs = []
    for ib in ibdevs:
        guid = None
        try:
            guid = fs.read_attr(f"{pci_dir}/infiniband/{ib}/node_guid")
        except AttrError:
            pass
        rdma.append(RdmaDevice(name=ib, node_guid=guid, uverbs=verbs_by_ibdev.get(ib)))
    return NicInfo(interfaces=tuple(interfaces), rdma=tuple(rdma)), nodes
