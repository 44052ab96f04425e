"""VFIO passthrough's mechanics: which functions a claim asks for (``VfioConfig``), the
refusal checks, moving functions to vfio-pci and giving them back (docs/vfio.md). The step
that runs them as a transaction (records, undo, recovery) is prepare/steps/vfio.py.

Refused, with the reason, before anything is written: vfio-pci is not loaded; the IOMMU is
off; the function's IOMMU group holds another function that is in use and not allocated to
this claim (bridges and idle functions are fine); the function is the host's own (it carries a
default route, or it is the boot VGA device); a NIC whose netdev the host uses (an address, a
bond or bridge port: prepare/hostuse.py) unless the node and the claim allow it; a PF with
SR-IOV VFs enabled (unbinding it destroys them); a function whose ``driver_override`` names a
driver other than its own (someone else is moving it); a function whose device files a process
holds open (its driver would not let go of it: the unbind would wait for them; on vfio-pci already,
its group node: the VM could not open the group). A function on a variant driver of vfio-pci
(``mlx5_vfio_pci``, ...) is a VFIO function already, left there (``target``). The re-bind of a
prepared claim after a reboot runs the same checks (``ensure_bound``): the host may have changed.

An unbind that still does not return in time (opened after the check) fails the claim and
marks the function's record ``pending``: the claim keeps its entry, and the function is given
back only once no write for it is in flight (``restore``). A function the kernel removed (hot
unplug, its PF's VFs reconfigured) has nothing to give back: it is noted, not retried."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable

from agent import rebinds
from agent.prepare import claimconfig, devusers, hostuse
from agent.prepare.allocation import ClaimFailed
from agent.prepare.records import VfioFunction
from agent.prepare.vfio_kernel import VFIO_DRIVER, KernelError, KernelHung, PciKernel
from discovery.devnodes import NodeResolver
from discovery.models import Device, Problem
from discovery.nic import netdev_names
from discovery.pci import PciError, read_function
from discovery.routes import default_route_functions
from discovery.sysfs import AttrError, HostFS
from discovery.vfio import is_vfio_driver, vfio_nodes

log = logging.getLogger(__name__)

_BRIDGE = 0x0604  # PCI-to-PCI bridges may share a function's IOMMU group: they are no VM's


class VfioError(Exception):
    """The claim's VFIO request cannot be done; the message is that claim's error. ``records``:
    the claim's records as they are now (a function whose write did not return is ``pending``)."""

    def __init__(self, msg: str, records: list[VfioFunction] | None = None):
        super().__init__(msg)
        self.records = records


@dataclass
class GivenBack:
    """What ``restore_all`` did: ``records``, the functions' records as they are now (one whose
    write did not return marked ``pending``); ``problems``, what is not back (empty: all are);
    ``notes``, what was given back or had left the node."""

    records: list[VfioFunction]
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def functions(claim: dict, driver_name: str, results, by_name: dict[str, Device],
              planned: dict[str, Device] | None = None) -> dict[str, claimconfig.VfioConfig]:
    """PCI address -> config of the results whose config (class, then claim: the last that
    applies, agent/prepare/claimconfig.py) is a ``VfioConfig``; ClaimFailed for a bad config.
    ``planned``: the devices other steps plan (GPU partitions, MIG instances): one a
    ``VfioConfig`` applies to is the claim's error, not left out (a partition cannot go to a VM:
    its GPU is one PCI function)."""
    configs = claimconfig.opaque_configs(claim, driver_name)
    out: dict[str, claimconfig.VfioConfig] = {}
    for r in results:
        dev = by_name.get(r.device)
        if dev is None:  # not a whole device: a partition the partition or MIG step planned, or none
            part = (planned or {}).get(r.device)
            if part is not None and isinstance(claimconfig.config_for(configs, r.request, part.kind, part.name),
                                               claimconfig.VfioConfig):
                raise ClaimFailed(f"VfioConfig applies to request {r.request!r}, which got {r.device!r}, a partition of "
                                  f"GPU {part.pci.bdf}: only a whole PCI function can be bound to vfio-pci")
            continue
        cfg = claimconfig.config_for(configs, r.request, dev.kind, dev.name)
        if isinstance(cfg, claimconfig.VfioConfig) and (dev.pci.bdf not in out or not cfg.allowHostInUse):
            out[dev.pci.bdf] = cfg  # two results of one function: allowed only if both allow
    return out


def host_used(root: str, netns: Callable[[], str], bdf: str, node_allows: bool, claim_allows: bool) -> str | None:
    """Why unbinding ``bdf`` would take a netdev the host uses (prepare/hostuse.py), or None."""
    fs = HostFS(root)
    try:
        fn, _, d = read_function(fs, bdf)
    except PciError as err:
        return f"its netdevs cannot be read: {err}"
    names = netdev_names(fs, fn, d)
    return hostuse.refusal(netns, dict.fromkeys(names, bdf), node_allows, claim_allows, "bound to vfio-pci", "VfioConfig")


def host_own(root: str, kernel: PciKernel, bdf: str) -> str | None:
    """Why the function is the host's own, or None."""
    routes = default_route_functions(root)
    if bdf in routes:
        return f"it is the host's uplink ({routes[bdf]})"
    try:
        if kernel.fs.read_attr(os.path.join(kernel.dev(bdf), "boot_vga")) == "1":
            return "it is the boot VGA device (the host's console)"
    except AttrError:  # no boot_vga attribute: not a display device
        pass
    return None


def check(root: str, kernel: PciKernel, bdf: str, mine: set[str], in_use_elsewhere: set[str],
          host_uses: Callable[[str], str | None], ours: tuple[str | None, ...] = ()) -> int:
    """Every refusal of one function (``mine``: the claim's functions, ``in_use_elsewhere``: what
    other claims hold, ``ours``: overrides the claim itself wrote or found) -> its IOMMU group;
    VfioError for a refusal. Reads only."""
    group = kernel.group(bdf)
    if group is None:
        raise VfioError(f"{bdf}: the IOMMU is off or the function has no IOMMU group "
                        "(boot with intel_iommu=on or amd_iommu=on)")
    if bdf in in_use_elsewhere:
        raise VfioError(f"{bdf} is in use by another prepared claim (whole, a share of it, or a function of its IOMMU "
                        "group given with /dev/vfio/<group>): a VM cannot have it")
    if (why := host_own(root, kernel, bdf)) is not None:
        raise VfioError(f"{bdf} is the host's own: {why}")
    if (why := host_uses(bdf)) is not None:
        raise VfioError(f"{bdf}: {why}")
    if kernel.num_vfs(bdf) > 0:
        raise VfioError(f"{bdf} has {kernel.num_vfs(bdf)} SR-IOV VFs enabled: unbinding the PF would destroy them")
    drv, override = kernel.driver(bdf), kernel.override(bdf)
    # refused rather than taken over: someone else (driverctl, an operator) is moving it to that
    # driver, and their next write would race ours; nor could the give-back put it back as found
    # (with the override set, the kernel lets only that driver bind it). Nothing written is safest.
    if drv is not None and override not in (None, drv, *ours):
        raise VfioError(f"{bdf}: its driver_override names {override} while it is bound to {drv} (a move to "
                        f"{override} under way?); clear it (echo > driver_override) or finish that move")
    # on vfio-pci (or a variant) already: its group node open by a host process (a VM outside Kubernetes)
    # would make the pod's VM fail to open it
    if drv is not None and (why := kernel.in_use(bdf, to_open=is_vfio_driver(drv))) is not None:
        raise VfioError(why)
    for other in kernel.group_members(group):
        if other in mine or kernel.class_code(other) >> 8 == _BRIDGE:
            continue
        drv = kernel.driver(other)
        if other in in_use_elsewhere or (drv is not None and not is_vfio_driver(drv)):
            raise VfioError(f"{bdf}: IOMMU group {group} also holds {other} (driver {drv or 'none'}), "
                            "which this claim is not allocated; a VM would get both")
    return group


def target(driver: str | None) -> str:
    """The driver a VM has a function on, the function found on ``driver``: a VFIO driver (vfio-pci or a
    variant of it: ``nvgrace-gpu-vfio-pci``, ``mlx5_vfio_pci``, ...) stays, anything else goes to vfio-pci.
    Moving a function off its variant driver would take from the VM what only the variant gives (Grace
    Hopper's GPU memory, mlx5's live migration)."""
    return driver if driver is not None and is_vfio_driver(driver) else VFIO_DRIVER


def _vfio_loaded(kernel: PciKernel, drivers: list[str | None]) -> None:
    """Checked before anything is written: without vfio-pci the function would be unbound from
    its driver (a NIC's link down, a GPU's users cut off) for a bind that cannot be done. A function
    on a variant driver of it stays there: vfio-pci itself is not needed for it."""
    if any(target(d) == VFIO_DRIVER for d in drivers) and not kernel.driver_loaded(VFIO_DRIVER):
        raise VfioError(f"{VFIO_DRIVER} is not loaded (modprobe {VFIO_DRIVER}); nothing written")


def plan(root: str, kernel: PciKernel, functions: list[str], in_use_elsewhere: set[str],
         host_uses: Callable[[str], str | None] = lambda bdf: None) -> list[VfioFunction]:
    """The records for ``functions`` (this claim's), after every refusal check (``host_uses``:
    why the host uses a function's netdev, ``host_used`` with the node's and claim's say)."""
    _vfio_loaded(kernel, [kernel.driver(bdf) for bdf in functions])
    mine = set(functions)
    records = []
    for bdf in functions:
        group = check(root, kernel, bdf, mine, in_use_elsewhere, host_uses)
        records.append(VfioFunction(bdf=bdf, group=group, driver=kernel.driver(bdf), override=kernel.override(bdf)))
    return records


def group_members(kernel: PciKernel, rec: VfioFunction) -> tuple[int | None, list[str]]:
    """The IOMMU group of a function bound for a VM as the kernel shows it now, and its other
    functions, bridges left out. The VM has the group: a member the host left on vfio-pci (or
    with no driver) given to another claim would hand that claim's container the VM's group node
    (docs/vfio.md), so the claim holds them too."""
    group = kernel.group(rec.bdf) if kernel.present(rec.bdf) else None
    members = kernel.group_members(group) if group is not None else []
    return group, [m for m in members if m != rec.bdf and kernel.class_code(m) >> 8 != _BRIDGE]


def bind_all(kernel: PciKernel, records: list[VfioFunction], fault: Callable[[str], None]) -> None:
    """Move every function to vfio-pci; on any failure give all of them back and raise."""
    try:
        for rec in records:
            bdf, to = rec.bdf, target(rec.driver)
            if to == VFIO_DRIVER or kernel.driver(bdf) != to:  # one on its variant driver is left as the host set it
                kernel.set_override(bdf, to)
                fault("vfio:override-set")
            if kernel.driver(bdf) != to:
                with rebinds.moving(kernel.dev(bdf)):  # the health monitor: our own rebind, no fault
                    kernel.unbind(bdf)
                    fault("vfio:unbound")
                    kernel.bind(bdf, to)
                    fault("vfio:bound")
            kernel.wait_group_node(bdf, rec.group)
    except KernelHung as err:  # the function stays the claim's; the others go back
        records = [r.model_copy(update={"pending": True}) if r.bdf == err.bdf else r for r in records]
        back = restore_all(kernel, [r for r in records if not r.pending], fault)
        records = _merged(records, back.records)
        raise VfioError(f"{err}; the claim's record keeps the function, its retry (or the agent's next start) gives it "
                        "back once the kernel is done" + (f"; not given back: {'; '.join(back.problems)}" if back.problems else ""),
                        records) from None
    except KernelError as err:
        back = restore_all(kernel, records, fault)
        msg = f"binding to vfio-pci failed: {err}; original drivers restored"
        raise VfioError(msg if not back.problems else f"{msg} except: {'; '.join(back.problems)}", back.records) from None


def _merged(records: list[VfioFunction], now: list[VfioFunction]) -> list[VfioFunction]:
    """``records`` with those of ``now`` in place of their function's."""
    by_bdf = {r.bdf: r for r in now}
    return [by_bdf.get(r.bdf, r) for r in records]


def restore(kernel: PciKernel, rec: VfioFunction, fault: Callable[[str], None] = lambda p: None) -> str:
    """Give one function back to its original driver (idempotent) -> what was done, for a note."""
    with rebinds.moving(kernel.dev(rec.bdf)):  # the health monitor: our own rebind, no fault
        return _restore(kernel, rec, fault)


def _restore(kernel: PciKernel, rec: VfioFunction, fault: Callable[[str], None]) -> str:
    bdf, original = rec.bdf, rec.driver
    kernel.settled(bdf)  # a write of ours still in the kernel: nothing until it returns
    if not kernel.present(bdf):  # hot-removed (or its PF's VFs reconfigured): no driver to give it back to,
        # and writing on would fail for as long as it is away, keeping the claim's entry and its unprepare failing
        log.warning("VFIO: %s has left the node (its sysfs directory is gone): nothing to give back to %s",
                    bdf, original or "no driver")
        return f"{bdf} has left the node (removed): nothing to give back"
    if rec.pending and (writers := kernel.writers(bdf, [original, target(original)])):  # another instance's
        raise KernelError(f"{bdf}: a write for it is still in the kernel: {devusers.describe(writers)}")
    if rec.probe:
        return _probed(kernel, rec, fault)
    done = f"{bdf} given back to {original or 'no driver'}"
    if is_vfio_driver(original):  # it came to us on vfio-pci (or a variant) and stays: only the override bind_all set goes
        if kernel.override(bdf) != rec.override:
            kernel.set_override(bdf, rec.override)
            fault("vfio:override-restored")
        return done
    if kernel.driver(bdf) == original and kernel.override(bdf) == rec.override:
        return done  # it is back already
    # the override stays vfio-pci until the unbind returned: one that does not return leaves the
    # function as the bind left it (only vfio-pci may probe it), its record ``pending`` and nothing else written
    if kernel.driver(bdf) not in (None, original):
        kernel.unbind(bdf)
        fault("vfio:restore-unbound")
    if kernel.override(bdf) != rec.override:  # None or the original driver (plan refuses another): it may bind
        kernel.set_override(bdf, rec.override)
        fault("vfio:override-restored")
    if original is not None and kernel.driver(bdf) is None:
        kernel.bind(bdf, original)
        fault("vfio:restored")
    return done


def _probed(kernel: PciKernel, rec: VfioFunction, fault: Callable[[str], None]) -> str:
    """An adopted claim's function (the driver before unknown) off vfio-pci, its override cleared and
    given to the driver the kernel matches for it -> what was done."""
    if kernel.driver(rec.bdf) == VFIO_DRIVER:
        kernel.unbind(rec.bdf)
        fault("vfio:restore-unbound")
    if kernel.override(rec.bdf) is not None:
        kernel.set_override(rec.bdf, None)
        fault("vfio:override-restored")
    found = kernel.driver(rec.bdf) or kernel.probe(rec.bdf)
    if found is None:  # said: notes of an unprepare are not logged, and its netdev (a NIC's) stays away
        log.warning("VFIO: %s given back off vfio-pci, but no driver matched it (its driver before was not recorded: "
                    "the claim was adopted; its module not loaded?): it is left with no driver. Load its driver "
                    "(modprobe), then: echo %s > /sys/bus/pci/drivers_probe", rec.bdf, rec.bdf)
    return f"{rec.bdf} given back to {found or 'no driver (none matched it)'}, the kernel's match (its driver before was not recorded)"


def restore_all(kernel: PciKernel, records: list[VfioFunction], fault: Callable[[str], None] = lambda p: None) -> GivenBack:
    """Give every function back. A write that does not return marks its function's record
    ``pending`` (the kernel may still finish it: no one may give it back under it)."""
    back = GivenBack(records=list(records))
    for i, rec in enumerate(records):
        try:
            back.notes.append(restore(kernel, rec, fault))
        except KernelError as err:
            log.error("VFIO: %s could not be given back to %s: %s", rec.bdf, rec.driver, err)
            back.problems.append(str(err))
            if isinstance(err, KernelHung) and not rec.pending:
                back.records[i] = rec.model_copy(update={"pending": True})
    return back


def ensure_bound(root: str, kernel: PciKernel, records: list[VfioFunction], fault: Callable[[str], None] = lambda p: None,
                 host_uses: Callable[[str], str | None] = lambda bdf: None) -> bool:
    """A prepared claim's functions on vfio-pci again (after a reboot); True if any was moved.
    Those to move are checked as ``plan`` checks them, before anything is written: the host may
    have changed meanwhile (a PF whose VFs were enabled at boot: unbinding it destroys them)."""
    moved = [r for r in records if kernel.driver(r.bdf) != target(r.driver)]
    if not moved:
        return False
    _vfio_loaded(kernel, [r.driver for r in moved])
    mine = {r.bdf for r in records}
    for rec in moved:
        if (why := kernel.in_flight(rec.bdf)) is not None:  # our own earlier write: said as it is, nothing written
            raise VfioError(why)
        if not kernel.present(rec.bdf):
            raise VfioError(f"{rec.bdf} is not on this node any more (removed, or its PF's VFs reconfigured): "
                            "it cannot be bound to vfio-pci again; unprepare the claim")
        # other claims' holds were checked at prepare; an override of vfio-pci is our own bind's
        check(root, kernel, rec.bdf, mine, set(), host_uses, ours=(target(rec.driver), rec.override))
    try:
        bind_all(kernel, moved, fault)
    except VfioError as err:  # the claim's records as they are now, not only the moved ones'
        raise VfioError(str(err), _merged(records, err.records or [])) from None
    return True


def with_vfio_nodes(root: str, device: Device) -> Device:
    """``device`` with the nodes a VFIO user opens (group node, /dev/vfio/vfio, iommufd cdev),
    read from the kernel as it is now, instead of its driver's nodes."""
    fs = HostFS(root)
    fn, problems, d = read_function(fs, device.pci.bdf)
    found: list[Problem] = []
    nodes = vfio_nodes(fs, NodeResolver(fs), fn, d, found)
    if not any(n.path.startswith("/dev/vfio/") and n.path != "/dev/vfio/vfio" for n in nodes):
        raise VfioError(f"{device.pci.bdf}: no VFIO group node after binding ({'; '.join(p.reason for p in found)})")
    # bound to vfio-pci now: the spec gets no driver files of the device's own driver
    return device.replace(device_nodes=tuple(nodes), pci=device.pci.replace(driver=fn.driver))
