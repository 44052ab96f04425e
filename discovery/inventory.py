"""``scan(root)``: the whole node, sysfs -> frozen :class:`Inventory`. Never writes.

One broken function never costs the inventory: anything unexpected while reading
a device turns into a ``skipped`` entry or a per-device problem.
"""

from __future__ import annotations

import logging
import os

from discovery.accel import read_accel
from discovery.attributes import device_attributes, quantity
from discovery.classify import ALVEO_IDS, ALVEO_MGMT_TO_USER, classify
from discovery.devnodes import NodeResolver
from discovery.fpga import read_alveo, read_dfl
from discovery.gpu import read_gpu
from discovery.models import Device, Inventory, PciFunction, Problem, Skipped
from discovery.nic import read_nic
from discovery.numa import read_numa_nodes
from discovery.pci import BDF_RE, PciError, host_dir, list_bdfs, read_function
from discovery.sysfs import DEFAULT_ROOT, AttrError, HostFS
from discovery.vfio import vfio_nodes

log = logging.getLogger(__name__)


def device_name(kind: str, bdf: str) -> str:
    """Stable DNS-label name from kind and PCI address: ``gpu-0000-1b-00-0``."""
    return f"{kind}-" + bdf.replace(":", "-").replace(".", "-")


def _views(fs: HostFS, d: str) -> frozenset[str]:
    try:
        return frozenset(fs.listdir(d))
    except AttrError:
        return frozenset()


def _is_alveo(fn: PciFunction, views: frozenset[str]) -> bool:
    return (fn.vendor_id == "10ee" and fn.device_id in ALVEO_IDS) or "xrt_mgmt" in views


def _alveo_role(fn: PciFunction, views: frozenset[str]) -> str:
    if "mgmt_pf" in views or "xrt_mgmt" in views or fn.driver == "xclmgmt" or fn.device_id in ALVEO_MGMT_TO_USER:
        return "mgmt"
    return "user"


class _Scanner:
    def __init__(self, root: str, list_attributes: bool):
        self.fs = HostFS(root)
        self.resolver = NodeResolver(self.fs)
        self.list_attributes = list_attributes
        self.problems: list[Problem] = []
        self.numa = read_numa_nodes(self.fs, self.problems)

    def run(self) -> Inventory:
        fs = self.fs
        skipped: list[Skipped] = []
        try:
            bdfs = list_bdfs(fs)
        except AttrError as err:
            self.problems.append(Problem(what="/sys/bus/pci/devices", reason=err.reason))
            bdfs = []
        offered: list[tuple[PciFunction, str, str, list[Problem]]] = []
        alveo: dict[tuple, dict[str, tuple[PciFunction, str, list[Problem]]]] = {}
        for bdf in bdfs:
            try:
                fn, problems = read_function(fs, bdf)
            except PciError as err:
                skipped.append(Skipped(bdf=bdf, reason=f"cannot identify: {err}"))
                continue
            d = host_dir(fs, fn)
            views = _views(fs, d)
            kind, why = classify(fn, views)
            ids = dict(class_code=fn.class_code, vendor_id=fn.vendor_id, device_id=fn.device_id)
            if kind is None:
                skipped.append(Skipped(bdf=bdf, reason=f"not offered: {why}", **ids))
            elif fn.driver is None:
                skipped.append(Skipped(bdf=bdf, reason=f"no driver bound ({why})", **ids))
            elif kind == "fpga" and _is_alveo(fn, views):
                card = BDF_RE.match(bdf).groups()[:3]
                alveo.setdefault(card, {})[_alveo_role(fn, views)] = (fn, d, problems)
            else:
                offered.append((fn, d, kind, problems))

        devices = []
        for fn, d, kind, problems in offered:
            dev = self._device(fn, d, kind, problems)
            if dev.fpga is not None and dev.fpga.family == "dfl" and not (dev.fpga.fme or dev.fpga.port):
                # extra PFs of DFL cards (N6001 .1/.2/.4) carry only an empty region
                skipped.append(Skipped(bdf=fn.bdf, reason="DFL function without FME or port: nothing a container can open",
                                       class_code=fn.class_code, vendor_id=fn.vendor_id, device_id=fn.device_id))
                continue
            devices.append(dev)
        for card in alveo.values():
            devices.append(self._alveo_device(card))
        devices.sort(key=lambda dev: dev.name)
        self.problems.extend(self.resolver.problems)
        skipped.sort(key=lambda s: s.bdf)
        return Inventory(
            root=fs.root, devices=tuple(devices), skipped=tuple(skipped),
            numa_nodes=self.numa, problems=tuple(self.problems),
        )  # fmt: skip

    def _finish(self, name: str, kind: str, fn: PciFunction, nodes, capacity: dict, problems, **info) -> Device:
        draft = Device(
            name=name, kind=kind, pci=fn, device_nodes=tuple(nodes),
            capacity={k: quantity(v) for k, v in capacity.items()}, **info,
        )  # fmt: skip
        attrs, attr_problems = device_attributes(draft, self.numa, self.list_attributes)
        return draft.model_copy(update={"attributes": attrs, "problems": tuple(problems + attr_problems)})

    def _device(self, fn: PciFunction, d: str, kind: str, problems: list[Problem]) -> Device:
        fs, res = self.fs, self.resolver
        name = device_name(kind, fn.bdf)
        nodes: list = []
        capacity: dict = {}
        info: dict = {}
        try:
            if fn.driver == "vfio-pci":
                nodes = vfio_nodes(fs, res, fn, d, problems)
            elif kind == "gpu":
                info["gpu"], nodes, capacity = read_gpu(fs, res, fn, d, problems)
            elif kind == "nic":
                info["nic"], nodes = read_nic(fs, res, fn, d, problems)
            elif kind == "fpga":
                info["fpga"], nodes = read_dfl(fs, res, fn, d, problems)
            elif kind == "accelerator":
                info["accel"], nodes = read_accel(fs, res, fn, d, problems)
        except Exception as err:  # noqa: BLE001 - one device must never cost the inventory
            log.warning("device %s: unexpected error while reading details: %r", fn.bdf, err)
            problems.append(Problem(what="details", reason=f"unexpected error: {err!r}"[:200]))
            nodes, capacity, info = [], {}, {}
        return self._finish(name, kind, fn, nodes, capacity, problems, **info)

    def _alveo_device(self, card: dict) -> Device:
        mgmt, user = card.get("mgmt"), card.get("user")
        primary = mgmt or user
        fn, _, problems = primary
        problems = list(problems) + (list(user[2]) if mgmt and user else [])
        try:
            info, nodes = read_alveo(
                self.fs, self.resolver,
                (mgmt[0], mgmt[1]) if mgmt else None, (user[0], user[1]) if user else None, problems,
            )  # fmt: skip
        except Exception as err:  # noqa: BLE001
            problems.append(Problem(what="details", reason=f"unexpected error: {err!r}"[:200]))
            info, nodes = None, []
        return self._finish(device_name("fpga", fn.bdf), "fpga", fn, nodes, {}, problems, fpga=info)


def scan(root: str = DEFAULT_ROOT, list_attributes: bool = False) -> Inventory:
    """Discover the node under ``root``. Read-only; never raises for bad sysfs content."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"scan root {root!r} is not a directory")
    return _Scanner(os.path.abspath(root), list_attributes).run()
