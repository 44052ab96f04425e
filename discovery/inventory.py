"""``scan(root)``: the whole node, sysfs -> frozen :class:`Inventory`. Never writes.

One broken function never costs the inventory: anything unexpected while reading
a device turns into a ``skipped`` entry or a per-device problem.
"""

from __future__ import annotations

import logging
import os

from discovery.accel import read_accel
from discovery.attributes import DeviceParts, device_attributes, quantity
from discovery.away import Away, kept
from discovery.classify import ALVEO_IDS, ALVEO_MGMT_TO_USER, classify
from discovery.devnodes import NodeResolver
from discovery.exclude import Exclusions
from discovery.extra_attributes import ExtraAttributes
from discovery.fpga import read_alveo, read_dfl
from discovery.gpu import read_gpu
from discovery.models import Device, Inventory, PciFunction, Problem, Skipped
from discovery.nic import read_nic
from discovery.numa import read_numa_nodes
from discovery.nvidia import NvidiaNode
from discovery.pci import BDF_RE, PciError, list_bdfs, read_function
from discovery.routes import uplink
from discovery.sysfs import DEFAULT_ROOT, AttrError, Dir, HostFS
from discovery.vfio import is_vfio_driver, vfio_nodes


log = logging.getLogger(__name__)


def device_name(kind: str, bdf: str) -> str:
    """Stable DNS-label name from kind and PCI address: ``gpu-0000-1b-00-0``."""
    return f"{kind}-" + bdf.replace(":", "-").replace(".", "-")


def _is_alveo(fn: PciFunction, views: frozenset[str]) -> bool:
    return (fn.vendor_id == "10ee" and fn.device_id in ALVEO_IDS) or "xrt_mgmt" in views


def _alveo_role(fn: PciFunction, views: frozenset[str]) -> str:
    if "mgmt_pf" in views or "xrt_mgmt" in views or fn.driver == "xclmgmt" or fn.device_id in ALVEO_MGMT_TO_USER:
        return "mgmt"
    return "user"


def _unchanged(before: object, record: object) -> object:
    """``before`` (the function's record from the scan before) when ``record`` reads the same.
    A function read again that has not changed keeps its objects: the publisher's per-device
    cache hits, and the pool, the health monitor and the status keep one copy of an unchanged
    node (with new objects, each periodic resync left the agent holding two: the pool it had
    published and the cache's new, equal entries). Compared as read, a new record is garbage
    at once, not after the whole scan (~3 MB less heap left fragmented); ~5 ms on the
    2,136-function node."""
    return before if before is not None and before == record else record


def _slot(bdf: str) -> tuple | None:
    m = BDF_RE.match(bdf)
    return m.groups()[:3] if m else None


class _Scanner:
    """One scan, or (``IncrementalScanner``) a series of them reusing unchanged functions.

    Per PCI function the scan produces one *result*: a :class:`Skipped`, a :class:`Device`,
    or the function's half of an Alveo card (both halves become one device). ``_results``
    keeps them by BDF for the next incremental scan; ``_cards`` keeps Alveo devices."""

    def __init__(self, root: str, list_attributes: bool, nvml=None, publish_uplink: bool = False,
                 exclude: Exclusions = Exclusions(), away: Away | None = None, static_mig: bool = False,
                 extra_attributes: ExtraAttributes = ExtraAttributes()):
        self.fs = HostFS(root)
        self.static_mig = static_mig
        self.extra_attributes = extra_attributes
        self.list_attributes = list_attributes
        self.publish_uplink = publish_uplink
        self.uplink: dict[str, str] = {}  # bdf -> why it is the host's uplink (read by full scans)
        self.exclude = exclude
        self.away = away  # asked once per scan: the functions whose netdevs are in pods (discovery/away.py)
        self._away: dict = {}
        self._before: dict[str, object] = {}  # the scan's previous results, for the facts of netdevs away
        self.nvml = nvml
        self._nvidia: NvidiaNode | None = None  # read when the scan meets its first NVIDIA GPU
        self.numa_problems: list[Problem] = []
        self.numa = read_numa_nodes(self.fs, self.numa_problems)
        self.resolver = NodeResolver(self.fs)
        self.problems: list[Problem] = []
        self._results: dict[str, object] = {}
        self._cards: dict[tuple, Device] = {}
        self._node_problems: list[Problem] = []  # from the resolver, kept across incremental scans

    def _read(self, bdf: str, alveo: dict) -> object:
        """A function's result: Skipped, Device, or ("alveo", card) (the half is recorded in
        ``alveo``). Its listing is dropped with it, before the next function is read: a
        node's listings all alive at once would be most of a scan's peak memory."""
        fs = self.fs
        try:
            fn, problems, d = read_function(fs, bdf)
        except PciError as err:
            return Skipped(bdf=bdf, reason=f"cannot identify: {err}")
        views = d.names or frozenset()
        kind, why = classify(fn, views)
        if (held := self.uplink.get(bdf) or self.uplink.get(fn.physfn or "")) is not None:
            return _skipped(fn, f"the host's uplink: {held}")
        if (rule := self.exclude.function(bdf, kind)) is not None:
            return _excluded(fn, rule)
        if kind is None or fn.driver is None:
            reason = f"not offered: {why}" if kind is None else f"no driver bound ({why})"
            return _skipped(fn, reason)
        if kind == "fpga" and _is_alveo(fn, views):
            card = BDF_RE.match(bdf).groups()[:3]
            alveo.setdefault(card, {})[_alveo_role(fn, views)] = (fn, d, problems)
            return ("alveo", card)
        try:
            dev = self._device(fn, d, kind, problems)
        except Exception as err:  # noqa: BLE001 - even its PCI attributes failed: this one device
            log.warning("device %s: unexpected error: %r", bdf, err)
            return _skipped(fn, f"unexpected error: {err!r}"[:200])
        if dev.fpga is not None and dev.fpga.family == "dfl" and not (dev.fpga.fme or dev.fpga.port):
            # extra PFs of DFL cards (N6001 .1/.2/.4) carry only an empty region
            return _skipped(fn, "DFL function without FME or port: nothing a container can open")
        if dev.nic is not None and (rule := self.exclude.interfaces(i.name for i in dev.nic.interfaces)) is not None:
            return _excluded(fn, rule)
        return dev

    def run(self, changed: set[str] | None = None, previous: _Scanner | None = None) -> Inventory:
        """``changed=None``: read every function. Else re-read only the functions in
        ``changed`` (plus their slot siblings, their PFs, and functions that appeared)
        and reuse the previous results for the others. A record read again that reads the same
        is the previous object (:func:`_unchanged`); ``previous``: a full scan's scanner before it."""
        self.problems = []
        # what the node's drivers say is read afresh by every run, an incremental one too: the
        # events of a module loaded or upgraded since (nvidia-uvm on first use, a new nvidia) name
        # only the functions bound again, which must carry its version and its majors
        self.resolver, self._nvidia = NodeResolver(self.fs), None
        present = self._present()
        todo = self._to_read(changed, present)
        results, cards = self._results, self._cards
        gone = set(results) - present
        for bdf in gone:
            del results[bdf]
        alveo: dict[tuple, dict] = {}
        # what each function read before: a full scan's previous scanner, else these very tables
        before, cards_before = (previous._results, previous._cards) if previous is not None else (results, dict(cards))
        self._before, self._away = before, self._ask_away()
        for bdf in sorted(todo):
            results[bdf] = _unchanged(before.get(bdf), self._read(bdf, alveo))
        if changed is not None:  # a full scan has read every function
            self._read_pfs_named(todo, present, before, alveo)
        self._build_cards(todo | gone, alveo, cards_before)
        return self._inventory()

    def _present(self) -> set[str]:
        """The functions on the bus now; none, and the scan's problem, when it cannot be listed."""
        try:
            bdfs = list_bdfs(self.fs)
        except AttrError as err:
            self.problems.append(Problem(what="/sys/bus/pci/devices", reason=err.reason))
            bdfs = []
        return set(bdfs)

    def _to_read(self, changed: set[str] | None, present: set[str]) -> set[str]:
        """Every function for a full scan (the tables and the uplink started afresh), else the
        changed ones and those that appeared or went, expanded (``_expand``)."""
        if changed is None:
            self._results, self._cards, self._node_problems = {}, {}, []
            self.uplink = {} if self.publish_uplink else uplink(self.fs.root).functions
            return present
        return self._expand(set(changed) | (present ^ set(self._results)), present)

    def _read_pfs_named(self, todo: set[str], present: set[str], before: dict, alveo: dict) -> None:
        """A function that appeared or changed may name a PF we have not re-read (VF created):
        that PF's slot is read too (and added to ``todo``)."""
        results = self._results
        for bdf in sorted(todo):
            pf = _pf_of(results[bdf])
            if pf and pf in present and pf not in todo:
                for sibling in sorted(b for b in present - todo if _slot(b) == _slot(pf)):
                    todo.add(sibling)
                    results[sibling] = _unchanged(before.get(sibling), self._read(sibling, alveo))

    def _build_cards(self, todo: set[str], alveo: dict[tuple, dict], cards_before: dict) -> None:
        """Alveo cards: re-read together; a card with a half in ``todo`` (read again, or gone) is rebuilt
        from the halves there are now, a card with none left is gone."""
        results, cards = self._results, self._cards
        if cards:  # an incremental scan's cards (a full scan starts without any)
            touched = {r[1] for bdf, r in results.items() if bdf in todo and isinstance(r, tuple)}
            touched |= {_slot(b) for b in todo}
            for card in list(cards):
                if card in touched:
                    del cards[card]
        for card, halves in alveo.items():
            try:
                cards[card] = _unchanged(cards_before.get(card), self._alveo_device(halves, self._card_address(card, halves)))
            except Exception as err:  # noqa: BLE001 - the card's problem, not the scan's
                fn = (halves.get("mgmt") or halves["user"])[0]
                results[fn.bdf] = _skipped(fn, f"unexpected error: {err!r}"[:200])

    def _card_address(self, card: tuple, halves: dict) -> str:
        """The address an Alveo card is named after: its management PF's while that function is on the
        bus, bound or not (xclmgmt unloaded for an XRT upgrade or a flash: the card still serves through
        its user PF, and a claim holds it by this name), else its user PF's (a VM given that alone)."""
        if "mgmt" in halves:
            return halves["mgmt"][0].bdf
        user = halves["user"][0]
        for bdf, r in self._results.items():  # (one the operator excludes names nothing)
            if isinstance(r, Skipped) and _slot(bdf) == card and r.vendor_id == "10ee" \
                    and ALVEO_MGMT_TO_USER.get(r.device_id or "") == user.device_id and self.exclude.function(bdf, "fpga") is None:
                return bdf
        return user.bdf

    def _inventory(self) -> Inventory:
        """The results as an :class:`Inventory`; the device-node problems of every scan so far kept."""
        results = self._results
        devices = [r for r in results.values() if isinstance(r, Device)] + list(self._cards.values())
        devices.sort(key=lambda dev: dev.name)
        skipped = sorted((r for r in results.values() if isinstance(r, Skipped)), key=lambda s: s.bdf)
        for p in self.resolver.problems:
            if p not in self._node_problems:
                self._node_problems.append(p)
        self.resolver.problems = []
        return Inventory(
            root=self.fs.root, devices=tuple(devices), skipped=tuple(skipped), numa_nodes=self.numa,
            problems=tuple(self.numa_problems + self.problems + self._node_problems),
        )  # fmt: skip

    def _expand(self, changed: set[str], present: set[str]) -> set[str]:
        """Changed functions plus the other functions of their slot (Alveo mgmt/user pairs,
        DFL multi-PF cards) and the PFs of changed or removed VFs; only present ones."""
        slots = {_slot(b) for b in changed}
        out = {b for b in present if b in changed or _slot(b) in slots}
        for bdf in changed:
            prev = self._results.get(bdf)
            pf = _pf_of(prev)
            if pf:
                out.add(pf)
        return out & present

    def _finish(self, name: str, kind: str, fn: PciFunction, nodes, capacity: dict, problems, **info) -> Device:
        # bytes become their shortest quantity; counts come as strings already
        quantities = {k: quantity(v) if isinstance(v, int) else v for k, v in capacity.items()} if capacity else {}
        parts = DeviceParts(kind, fn, quantities, **info)
        attrs, attr_problems = device_attributes(parts, self.numa, self.list_attributes)
        if self.extra_attributes:
            names = [i.name for i in info["nic"].interfaces] if info.get("nic") is not None else []
            attrs = self.extra_attributes.apply(attrs, fn.bdf, kind, names, len(quantities), attr_problems)
        return Device(name=name, kind=kind, pci=fn, device_nodes=tuple(nodes), capacity=quantities,
                      attributes=attrs, problems=tuple(problems + attr_problems), **info)  # fmt: skip

    def _device(self, fn: PciFunction, d: Dir, kind: str, problems: list[Problem]) -> Device:
        fs, res = self.fs, self.resolver
        name = device_name(kind, fn.bdf)
        nodes: list = []
        capacity: dict = {}
        info: dict = {}
        try:
            if is_vfio_driver(fn.driver):
                nodes = vfio_nodes(fs, res, fn, d, problems)
            elif kind == "gpu":
                info["gpu"], nodes, capacity = read_gpu(fs, res, fn, d, problems, self._nvidia_node)
            elif kind == "nic":
                info["nic"], nodes = read_nic(fs, res, fn, d, problems)
                if (away := self._away.get(fn.bdf)) is not None:  # sysfs no longer shows them: as last seen
                    info["nic"] = kept(info["nic"], self._last_interfaces(fn.bdf), away)
            elif kind == "fpga":
                info["fpga"], nodes = read_dfl(fs, res, fn, d, problems)
            elif kind == "accelerator":
                info["accel"], nodes = read_accel(fs, res, fn, d, problems)
            return self._finish(name, kind, fn, nodes, capacity, problems, **info)
        except Exception as err:  # noqa: BLE001 - one device must never cost the inventory
            log.warning("device %s: unexpected error while reading details: %r", fn.bdf, err)
            problems.append(Problem(what="details", reason=f"unexpected error: {err!r}"[:200]))
        return self._finish(name, kind, fn, [], {}, problems)  # its PCI attributes only

    def _ask_away(self) -> dict:
        if self.away is None:
            return {}
        try:
            return dict(self.away())
        except Exception as err:  # noqa: BLE001 - the scan goes on: the netdevs read as sysfs shows them
            log.warning("which netdevs are in pods is not known: %r", err)
            return {}

    def _last_interfaces(self, bdf: str) -> tuple:
        last = self._before.get(bdf)
        return last.nic.interfaces if isinstance(last, Device) and last.nic is not None else ()

    def _nvidia_node(self) -> NvidiaNode:
        if self._nvidia is None:
            self._nvidia = NvidiaNode(self.fs, self.nvml, self.static_mig)
        return self._nvidia

    def _alveo_device(self, card: dict, address: str) -> Device:
        """The card of ``card``'s halves, named after ``address`` (``_card_address``)."""
        mgmt, user = card.get("mgmt"), card.get("user")
        primary = mgmt or user
        fn, _, problems = primary
        problems = list(problems) + (list(user[2]) if mgmt and user else [])
        try:
            info, nodes = read_alveo(
                self.fs, self.resolver,
                (mgmt[0], mgmt[1]) if mgmt else None, (user[0], user[1]) if user else None, problems,
            )  # fmt: skip
            return self._finish(device_name("fpga", address), "fpga", fn, nodes, {}, problems, fpga=info)
        except Exception as err:  # noqa: BLE001
            problems.append(Problem(what="details", reason=f"unexpected error: {err!r}"[:200]))
        return self._finish(device_name("fpga", address), "fpga", fn, [], {}, problems, fpga=None)


def scan(root: str = DEFAULT_ROOT, list_attributes: bool = False, nvml=None, publish_uplink: bool = False,
         exclude: Exclusions = Exclusions(), away: Away | None = None, static_mig: bool = False,
         extra_attributes: ExtraAttributes = ExtraAttributes()) -> Inventory:
    """Discover the node under ``root``. Read-only; never raises for bad sysfs content.
    ``nvml``: a :class:`discovery.nvml.NvmlSource` for NVIDIA GPU facts (None: table only).
    The host's uplink (discovery/routes.py) is skipped unless ``publish_uplink``, and so are the
    operator's ``exclude`` rules' devices (discovery/exclude.py); ``away``: the NIC functions whose
    netdevs are in pods, which keep their netdev facts (discovery/away.py). ``static_mig``: a GPU's MIG
    instances are the operator's, published as they are with their NVML profiles, never NVML's
    profiles and placements (dynamic MIG; docs/partitions.md). ``extra_attributes``: the operator's
    (discovery/extra_attributes.py)."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"scan root {root!r} is not a directory")
    return _Scanner(os.path.abspath(root), list_attributes, nvml, publish_uplink, exclude, away, static_mig,
                    extra_attributes).run()


class IncrementalScanner:
    """Repeated scans of one root that re-read only what changed (the daemon's rescans).

    ``full()`` reads everything, NUMA nodes included, like :func:`scan`. ``update(changed)``
    lists /sys/bus/pci/devices again (adds and removes are always seen), re-reads the
    functions in ``changed`` (PCI addresses, e.g. from a uevent's DEVPATH) with their slot
    siblings and PFs, and reuses the previous records of all others. NUMA nodes are re-read
    only by ``full()``; /proc/devices and the NVIDIA module's version by every run that needs
    them (a function bound again carries the driver loaded now). Read-only, like :func:`scan`; the result
    equals a full scan whenever ``changed`` names every function whose sysfs files changed.
    """

    def __init__(self, root: str = DEFAULT_ROOT, list_attributes: bool = False, nvml=None, publish_uplink: bool = False,
                 exclude: Exclusions = Exclusions(), away: Away | None = None, static_mig: bool = False,
                 extra_attributes: ExtraAttributes = ExtraAttributes()):
        if not os.path.isdir(root):
            raise FileNotFoundError(f"scan root {root!r} is not a directory")
        self.root = os.path.abspath(root)
        self.static_mig, self.extra_attributes = static_mig, extra_attributes
        self.list_attributes = list_attributes
        self.nvml = nvml
        self.publish_uplink = publish_uplink
        self.exclude, self.away = exclude, away
        self._scanner: _Scanner | None = None
        self.inventory: Inventory | None = None

    def full(self) -> Inventory:
        """Everything read again; what reads as before keeps its objects (``_unchanged``)."""
        previous, self._scanner = self._scanner, _Scanner(self.root, self.list_attributes, self.nvml, self.publish_uplink,
                                                          self.exclude, self.away, self.static_mig, self.extra_attributes)
        self.inventory = self._scanner.run(previous=previous)
        return self.inventory

    def update(self, changed: set[str] | None) -> Inventory:
        """``changed=None`` (an event that names no function, a dropped event): full scan."""
        if changed is None or self._scanner is None:
            return self.full()
        self.inventory = self._scanner.run(set(changed))
        return self.inventory


def _excluded(fn: PciFunction, rule: str) -> Skipped:
    return _skipped(fn, f"excluded by the node's exclude_devices ({rule})")


def _skipped(fn: PciFunction, reason: str) -> Skipped:
    """An identified function not offered, with its ids and, for a VF, its PF (``_pf_of``)."""
    return Skipped(bdf=fn.bdf, reason=reason, class_code=fn.class_code, vendor_id=fn.vendor_id,
                   device_id=fn.device_id, physfn=fn.physfn)


def _pf_of(result: object) -> str | None:
    """The PF of a VF's result, offered or skipped: a VF no driver took (autoprobe off) is
    skipped, and when it goes the kernel tells nothing of its PF, whose VF count changed."""
    return result.pci.physfn if isinstance(result, Device) else getattr(result, "physfn", None)


def bdf_of_path(path: str) -> str | None:
    """The PCI function a sysfs path (or uevent DEVPATH) belongs to: its deepest PCI
    address component (``/devices/pci0000:00/0000:00:01.0/0000:01:00.0/net/eth0`` ->
    ``0000:01:00.0``); None when it names none (NUMA nodes, /sys/class, ...)."""
    found = None
    for part in path.split("/"):
        if BDF_RE.match(part):
            found = part
    return found
