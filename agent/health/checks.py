"""Health rules per device, from what sysfs and /dev show (docs/health.md lists them).

``check`` never raises and never guesses: UNHEALTHY needs evidence of a fault, HEALTHY
needs at least one positive check (link up, ``operational``, ``ready 1``, device nodes
present with the driver bound). Everything else is UNKNOWN with the reason.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from agent.health.gpumemory import RowRemaps
from agent.health.gpumemory import fault as gpu_memory_fault
from discovery.models import Device
from discovery.nic import VIRTIO_VENDOR
from discovery.nvidia_driver import DriverFiles
from discovery.sysfs import AttrError, HostFS

HEALTHY, UNHEALTHY, UNKNOWN = "HEALTHY", "UNHEALTHY", "UNKNOWN"
MAX_MESSAGE = 1024  # kubelet limit in bytes (Go len); longer messages are cut to 1021 + "..."
AER_HOLD = 300.0  # seconds a device stays UNHEALTHY after its fatal AER counter grew
_LINK_DOWN = {"down", "lowerlayerdown", "notpresent"}
_AER_TOTAL = re.compile(r"^TOTAL_ERR_FATAL\s+(\d+)\s*$", re.M)


def truncate(message: str) -> str:
    """At most MAX_MESSAGE UTF-8 bytes, as the kubelet and the API server count (Go ``len``),
    cut on a character boundary (the kubelet would cut inside one)."""
    raw = message.encode("utf-8", "replace")
    if len(raw) <= MAX_MESSAGE:
        return message
    return raw[:MAX_MESSAGE - 3].decode("utf-8", "ignore") + "..."


@lru_cache(maxsize=256)
def _slug(text: str) -> str:
    """A label value (taint value): [A-Za-z0-9._-], alphanumeric at both ends, <= 63."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")[:63].rstrip("-._") or "unhealthy"


@dataclass(frozen=True, slots=True)  # one per device per round: slots keep them small
class Verdict:
    health: str
    message: str
    reason: str = ""  # short code of the first fault (taint value); "" unless UNHEALTHY


@dataclass(slots=True)
class Memory:
    """What a device's checks remember between rounds."""

    driver: str | None = None  # last driver seen bound: unbinding is a fault, never bound is not
    aer: bool = True  # False once aer_dev_fatal was missing (no AER capability: not looked for again)
    aer_fatal: int | None = None  # last TOTAL_ERR_FATAL
    aer_until: float = 0.0
    aer_message: str = ""
    event_fault: tuple[str, str] | None = None  # (code, message) of an NVML XID/ECC event: held
    event_uuid: str | None = None  # the UUID of the GPU that raised ``event_fault`` (another may take the slot)
    daemon_fault: tuple[str, str] | None = None  # (code, message): its MPS control daemon is down, until back


class _Findings:
    """What one check found (one per device per round: kept plain and small)."""

    __slots__ = ("faults", "good", "unknown")

    def __init__(self):
        self.faults: list[tuple[str, str]] = []  # (code, message)
        self.good: list[str] = []
        self.unknown: list[str] = []

    def verdict(self) -> Verdict:
        if self.faults:
            message = self.faults[0][1] if len(self.faults) == 1 else "; ".join(m for _, m in self.faults)
            return Verdict(UNHEALTHY, truncate(message), _slug(self.faults[0][0]))
        if self.good:
            return Verdict(HEALTHY, truncate("; ".join(self.good)))
        return Verdict(UNKNOWN, truncate("; ".join(self.unknown) or "nothing to check"))


def _net_interfaces(fs: HostFS, pci_dir: str, virtio: bool) -> list[str]:
    """Interface dirs below the function (virtio one level deeper), as discovery finds them.
    Only virtio functions are listed whole: a PCI function directory is large and this runs
    for every NIC every round."""
    dirs = [f"{pci_dir}/net"]
    if virtio:
        try:
            dirs += [f"{pci_dir}/{n}/net" for n in fs.listdir(pci_dir) if n.startswith("virtio")]
        except AttrError:
            pass
    out = []
    for d in dirs:
        try:
            out += [f"{d}/{n}" for n in fs.listdir(d)]
        except AttrError:
            continue
    return out


def _operstates(fs: HostFS, pci_dir: str, virtio: bool, known: tuple) -> list[tuple[str, str, str, AttrError | None]]:
    """(name, interface dir, operstate, error) of the function's interfaces. ``known``: the
    NetInterfaces discovery saw; while all of them are still there, the net directory is not
    listed (this runs for every NIC every round); one gone (renamed, moved into a pod): list."""
    if known and not virtio:
        out = []
        for iface in known:
            path = f"{pci_dir}/net/{iface.name}"
            try:
                out.append((iface.name, path, fs.read_attr(f"{path}/operstate"), None))
            except AttrError as err:
                if err.reason == "missing":
                    break
                out.append((iface.name, path, "", err))
        else:
            return out
    out = []
    for path in _net_interfaces(fs, pci_dir, virtio):
        name = os.path.basename(path)
        try:
            out.append((name, path, fs.read_attr(f"{path}/operstate"), None))
        except AttrError as err:
            out.append((name, path, "", err))
    return out


def _check_nic(fs: HostFS, pci_dir: str, f: _Findings, virtio: bool = False, known: tuple = ()) -> None:
    found = _operstates(fs, pci_dir, virtio, known)
    if not found:
        f.unknown.append("no network interface visible (moved into a pod's network namespace, or none)")
    for name, path, state, err in found:
        if err is not None:
            f.unknown.append(f"interface {name} operstate {err.reason}")
            continue
        if state in _LINK_DOWN:  # decided without the carrier
            f.faults.append(("link-down", f"interface {name} operstate {state}"))
            continue
        try:
            carrier: int | None = fs.read_int(f"{path}/carrier")
        except AttrError:
            carrier = None  # EINVAL while administratively down
        if carrier == 0:
            f.faults.append(("no-carrier", f"interface {name} carrier 0"))
        elif state == "up" or (state == "unknown" and carrier == 1):
            f.good.append(f"interface {name} link up")
        else:
            f.unknown.append(f"interface {name} operstate {state}")


def _check_habanalabs(fs: HostFS, pci_dir: str, f: _Findings) -> None:
    try:
        status = fs.read_attr(f"{pci_dir}/status")
    except AttrError as err:
        f.unknown.append(f"habanalabs status {err.reason}")
        return
    if status == "operational":
        f.good.append("habanalabs status operational")
    else:
        f.faults.append((f"status-{status}", f"habanalabs status is {status!r}, not 'operational'"))


def _check_alveo(fs: HostFS, dev: Device, f: _Findings) -> None:
    for bdf in dict.fromkeys(b for b in (dev.fpga.mgmt_bdf, dev.fpga.user_bdf) if b):
        try:
            ready = fs.read_int(fs.path("sys/bus/pci/devices", bdf, "ready"))
        except AttrError as err:
            f.unknown.append(f"Alveo {bdf} ready {err.reason}")
            continue
        if ready == 0:
            f.faults.append(("not-ready", f"Alveo {bdf} ready 0"))
        else:
            f.good.append(f"Alveo {bdf} ready")


def _check_aer(fs: HostFS, pci_dir: str, mem: Memory, now: float, f: _Findings) -> None:
    if not mem.aer:
        return
    try:
        m = _AER_TOTAL.search(fs.read_text(f"{pci_dir}/aer_dev_fatal"))
    except AttrError as err:
        mem.aer = err.reason != "missing"  # no AER capability: nothing to learn, now or later
        return
    if not m:
        return
    count = int(m.group(1))
    if mem.aer_fatal is not None and count > mem.aer_fatal:
        mem.aer_until = now + AER_HOLD
        mem.aer_message = f"PCIe AER fatal errors increased from {mem.aer_fatal} to {count}"
    mem.aer_fatal = count
    if now < mem.aer_until:
        f.faults.append(("aer-fatal", mem.aer_message))


def polled(dev: Device, mem: Memory, links_reported: bool) -> bool:
    """Whether ``check`` reads anything for ``dev`` that no event reports, so a timer round
    must look: device nodes, the AER counter, habanalabs status, Alveo ``ready``, and NIC links
    unless link changes arrive as events. A function's presence and driver are not on the list:
    the watcher reports them (its rescan hands the monitor a new inventory)."""
    return bool(dev.device_nodes) or mem.aer or dev.kind in ("accelerator", "fpga") or (
        dev.kind == "nic" and not links_reported)


def _check_nvidia_driver(files: DriverFiles, f: _Findings) -> None:
    """The user-space driver a container of this GPU gets (docs/nvidia.md): without it, or at
    another version than the kernel module, no CUDA program can run there."""
    if files.errors:
        f.faults.append(("nvidia-userspace-driver", "NVIDIA user-space driver: " + "; ".join(files.errors)))
    else:
        f.good.append(f"NVIDIA user-space driver {files.version} matches the kernel module")


def _check_nvidia_memory(remaps: RowRemaps | None, f: _Findings) -> None:
    if remaps is None:  # NVML off, or no row remapping on this GPU: no signal either way
        return
    if (found := gpu_memory_fault(remaps)) is not None:
        f.faults.append(found)
    else:
        f.good.append("no GPU memory row remap pending or failed")


def check(fs: HostFS, dev: Device, mem: Memory, now: float | None = None,
          nvidia_files: Callable[[], DriverFiles] | None = None,
          nvidia_memory: Callable[[str], RowRemaps | None] | None = None) -> Verdict:
    now = time.time() if now is None else now
    f = _Findings()
    pci_dir = fs.path(dev.pci.sysfs_path)
    try:  # the driver link first: when it is there, so is the function (one system call, not two)
        driver: str | None = fs.link_name(f"{pci_dir}/driver")
    except AttrError:
        driver = None
    if driver is None and not fs.is_dir(pci_dir):
        return Verdict(UNHEALTHY, truncate(f"PCI function {dev.pci.bdf} is gone from sysfs"), "gone")
    if driver is None:
        if mem.driver:
            f.faults.append(("driver-unbound", f"driver {mem.driver} is no longer bound to {dev.pci.bdf}"))
        else:
            f.unknown.append(f"no driver bound to {dev.pci.bdf}")
    else:
        if mem.driver and driver != mem.driver:
            f.faults.append(("driver-changed", f"{dev.pci.bdf} is bound to {driver}, not {mem.driver}"))
        missing = [n.path for n in dev.device_nodes if not os.path.lexists(fs.path(n.path))]
        if missing:
            f.faults.append(("devnode-missing", f"{', '.join(missing)} missing while driver {driver} is bound"))
        elif dev.device_nodes:
            f.good.append("device nodes present")
    _check_aer(fs, pci_dir, mem, now, f)
    if mem.event_fault is not None:
        f.faults.append(mem.event_fault)
    if mem.daemon_fault is not None:
        f.faults.append(mem.daemon_fault)
    if dev.kind == "nic":
        _check_nic(fs, pci_dir, f, virtio=(driver or mem.driver or "").startswith("virtio") or dev.pci.vendor_id == VIRTIO_VENDOR,
                   known=dev.nic.interfaces if dev.nic else ())
    elif dev.kind == "accelerator" and (driver or mem.driver) == "habanalabs":
        _check_habanalabs(fs, pci_dir, f)
    elif dev.kind == "fpga" and dev.fpga and dev.fpga.family == "alveo":
        _check_alveo(fs, dev, f)
    elif driver == "nvidia" and dev.kind == "gpu":
        if nvidia_files is not None:
            _check_nvidia_driver(nvidia_files(), f)
        if nvidia_memory is not None:
            _check_nvidia_memory(nvidia_memory(dev.pci.bdf), f)
    if driver and not f.good and not f.faults:
        f.unknown.append(f"driver {driver} bound; no health signal for this device")
    return f.verdict()
