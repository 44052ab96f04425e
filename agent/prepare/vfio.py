"""VFIO passthrough's mechanics: which functions a claim asks for (``VfioConfig``), the
refusal checks, moving functions to vfio-pci and giving them back (docs/vfio.md). The step
that runs them as a transaction (records, undo, recovery) is prepare/steps/vfio.py.

Refused, with the reason, before anything is written: the IOMMU is off; the function's
IOMMU group holds another function that is in use and not allocated to this claim (bridges
and idle functions are fine); the function is the host's own (it carries a default route,
or it is the boot VGA device); a NIC whose netdev the host uses (an address, a bond or bridge
port: prepare/hostuse.py) unless the node and the claim allow it; a PF with SR-IOV VFs enabled
(unbinding it destroys them); a function whose device files a process holds open (its driver
would not let go of it: the unbind would wait for them).

An unbind that still does not return in time (opened after the check) fails the claim and
marks the function's record ``pending``: the claim keeps its entry, and the function is given
back only once no write for it is in flight (``restore``)."""

from __future__ import annotations

import logging
import os
from typing import Callable

from agent.prepare import claimconfig, devusers, hostuse
from agent.prepare.records import VfioFunction
from agent.prepare.vfio_kernel import VFIO_DRIVER, KernelError, KernelHung, PciKernel
from discovery.devnodes import NodeResolver
from discovery.models import Device, Problem
from discovery.nic import netdev_names
from discovery.pci import PciError, read_function
from discovery.routes import default_route_functions
from discovery.sysfs import AttrError, HostFS
from discovery.vfio import vfio_nodes

log = logging.getLogger(__name__)


class VfioError(Exception):
    """The claim's VFIO request cannot be done; the message is that claim's error. ``records``:
    the claim's records as they are now (a function whose write did not return is ``pending``)."""

    def __init__(self, msg: str, records: list[VfioFunction] | None = None):
        super().__init__(msg)
        self.records = records


def functions(claim: dict, driver_name: str, results, by_name: dict[str, Device]) -> dict[str, claimconfig.VfioConfig]:
    """PCI address -> config of the results whose config (class, then claim: the last that
    applies, agent/prepare/claimconfig.py) is a ``VfioConfig``; ClaimFailed for a bad config."""
    configs = claimconfig.opaque_configs(claim, driver_name)
    out: dict[str, claimconfig.VfioConfig] = {}
    for r in results:
        dev = by_name.get(r.device)
        cfg = claimconfig.config_for(configs, r.request, dev.kind, dev.name) if dev is not None else None
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


def plan(root: str, kernel: PciKernel, functions: list[str], in_use_elsewhere: set[str],
         host_uses: Callable[[str], str | None] = lambda bdf: None) -> list[VfioFunction]:
    """The records for ``functions`` (this claim's), after every refusal check (``host_uses``:
    why the host uses a function's netdev, ``host_used`` with the node's and claim's say)."""
    mine = set(functions)
    records = []
    for bdf in functions:
        group = kernel.group(bdf)
        if group is None:
            raise VfioError(f"{bdf}: the IOMMU is off or the function has no IOMMU group "
                            "(boot with intel_iommu=on or amd_iommu=on)")
        if bdf in in_use_elsewhere:
            raise VfioError(f"{bdf} is in use by another prepared claim (a shared device cannot go to a VM)")
        if (why := host_own(root, kernel, bdf)) is not None:
            raise VfioError(f"{bdf} is the host's own: {why}")
        if (why := host_uses(bdf)) is not None:
            raise VfioError(f"{bdf}: {why}")
        if kernel.num_vfs(bdf) > 0:
            raise VfioError(f"{bdf} has {kernel.num_vfs(bdf)} SR-IOV VFs enabled: unbinding the PF would destroy them")
        if kernel.driver(bdf) not in (None, VFIO_DRIVER) and (why := kernel.in_use(bdf)) is not None:
            raise VfioError(why)
        for other in kernel.group_members(group):
            if other in mine or kernel.class_code(other) >> 8 == 0x0604:  # PCI bridges may share a group
                continue
            drv = kernel.driver(other)
            if other in in_use_elsewhere or (drv is not None and drv != VFIO_DRIVER):
                raise VfioError(f"{bdf}: IOMMU group {group} also holds {other} (driver {drv or 'none'}), "
                                "which this claim is not allocated; a VM would get both")
        records.append(VfioFunction(bdf=bdf, group=group, driver=kernel.driver(bdf), override=kernel.override(bdf)))
    return records


def bind_all(kernel: PciKernel, records: list[VfioFunction], fault: Callable[[str], None]) -> None:
    """Move every function to vfio-pci; on any failure give all of them back and raise."""
    try:
        for rec in records:
            bdf = rec.bdf
            kernel.set_override(bdf, VFIO_DRIVER)
            fault("vfio:override-set")
            if kernel.driver(bdf) != VFIO_DRIVER:
                kernel.unbind(bdf)
                fault("vfio:unbound")
                kernel.bind(bdf, VFIO_DRIVER)
                fault("vfio:bound")
            kernel.wait_group_node(bdf, rec.group)
    except KernelHung as err:  # the function stays the claim's; the others go back
        records = [r.model_copy(update={"pending": True}) if r.bdf == err.bdf else r for r in records]
        problems = restore_all(kernel, [r for r in records if not r.pending], fault)
        raise VfioError(f"{err}; the claim's record keeps the function, its retry (or the agent's next start) gives it "
                        "back once the kernel is done" + (f"; not given back: {'; '.join(problems)}" if problems else ""),
                        records) from None
    except KernelError as err:
        problems = restore_all(kernel, records, fault)
        msg = f"binding to vfio-pci failed: {err}; original drivers restored"
        raise VfioError(msg if not problems else f"{msg} except: {'; '.join(problems)}", records) from None


def restore(kernel: PciKernel, rec: VfioFunction, fault: Callable[[str], None] = lambda p: None) -> None:
    """Give one function back to its original driver (idempotent)."""
    bdf, original = rec.bdf, rec.driver
    kernel.settled(bdf)  # a write of ours still in the kernel: nothing until it returns
    if rec.pending and (writers := kernel.writers(bdf, [original, VFIO_DRIVER])):  # another instance's
        raise KernelError(f"{bdf}: a write for it is still in the kernel: {devusers.describe(writers)}")
    if original == VFIO_DRIVER:  # it came to us on vfio-pci and stays: only the override bind_all set goes
        if kernel.override(bdf) != rec.override:
            kernel.set_override(bdf, rec.override)
            fault("vfio:override-restored")
        return
    if kernel.driver(bdf) == original and kernel.override(bdf) == rec.override:
        return  # it is back already
    kernel.set_override(bdf, rec.override)
    fault("vfio:override-restored")
    if kernel.driver(bdf) not in (None, original):
        kernel.unbind(bdf)
        fault("vfio:restore-unbound")
    if original is not None and kernel.driver(bdf) is None:
        kernel.bind(bdf, original)
        fault("vfio:restored")


def restore_all(kernel: PciKernel, records: list[VfioFunction], fault: Callable[[str], None] = lambda p: None) -> list[str]:
    """Give every function back; -> problems (empty when all are back)."""
    problems = []
    for rec in records:
        try:
            restore(kernel, rec, fault)
        except KernelError as err:
            log.error("VFIO: %s could not be given back to %s: %s", rec.bdf, rec.driver, err)
            problems.append(str(err))
    return problems


def ensure_bound(kernel: PciKernel, records: list[VfioFunction], fault: Callable[[str], None] = lambda p: None) -> bool:
    """A prepared claim's functions on vfio-pci again (after a reboot); True if any was moved."""
    moved = [r for r in records if kernel.driver(r.bdf) != VFIO_DRIVER]
    if moved:
        try:
            bind_all(kernel, moved, fault)
        except VfioError as err:  # the claim's records as they are now, not only the moved ones'
            now = {r.bdf: r for r in err.records or ()}
            raise VfioError(str(err), [now.get(r.bdf, r) for r in records]) from None
    return bool(moved)


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
