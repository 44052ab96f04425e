"""What a prepared claim reports in ``status.devices`` (KEP-4817): one entry per prepared
device (driver, pool, device, shareID) with a ``Ready`` condition, ``data`` (a small JSON
object of what was prepared: kind, PCI address, CDI IDs, device nodes) and, for NICs,
``networkData`` (interface name and hardware address from sysfs, IPs from ``netaddrs``).

The entries are built at prepare time, kept in the claim's checkpoint entry
(``deviceStatus``) so re-prepare, ``sysdra metadata update`` and unprepare all know them, and
written by ``agent/kubeletplugin/statuswriter.py``. Every entry is checked against the
server's limits (``devicestatus.problems``); what would not fit is shortened, never sent.
"""

from __future__ import annotations

import datetime
import logging
from typing import Callable

import orjson

from agent.kubeletplugin import devicestatus
from agent.kubeletplugin.types import ClaimRef, PreparedDevice
from agent.prepare import netaddrs
from agent.prepare.checkpoint import Checkpoint, CheckpointError
from agent.prepare.checkpoint_format import COMPLETED
from discovery.models import Device

log = logging.getLogger(__name__)

READY = "Ready"
REASON_PREPARED = "Prepared"


def now() -> str:
    """metav1.Time: RFC 3339, whole seconds, UTC."""
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def device_data(d: PreparedDevice, dev: Device | None) -> dict:
    data: dict = {"requests": list(d.requests), "cdiDeviceIDs": list(d.cdi_ids)}
    if dev is None:  # not an inventory device (a GPU partition): what was prepared is all we say
        return data
    data.update(kind=dev.kind, pciAddress=dev.pci.bdf, deviceNodes=[n.path for n in dev.device_nodes])
    if len(orjson.dumps(data)) > devicestatus.MAX_DATA_BYTES:  # hundreds of nodes: the list goes, the count stays
        data["deviceNodes"] = len(dev.device_nodes)
    return data


def network_data(dev: Device | None, addrs: dict[str, list[str]]) -> dict | None:
    if not (dev and dev.nic and dev.nic.interfaces):
        return None
    iface = dev.nic.interfaces[0]
    net: dict = {"interfaceName": iface.name}
    if iface.mac:
        net["hardwareAddress"] = iface.mac
    ips = []
    for ip in addrs.get(iface.name, []):
        canon = devicestatus.canonical_interface_address(ip)
        if canon and canon not in ips:
            ips.append(canon)
    if ips:
        net["ips"] = ips[:devicestatus.MAX_IPS]
    return net


def build(driver: str, root: str, prepared: list[PreparedDevice], by_name: dict[str, Device],
          when: str | None = None) -> list[dict]:
    """The ``status.devices`` entries of one prepared claim (one per device, or share of one)."""
    when = when or now()
    addrs = netaddrs.addresses(root) if any(getattr(by_name.get(d.device), "nic", None) for d in prepared) else {}
    out: dict[tuple, dict] = {}
    for d in prepared:
        dev = by_name.get(d.device)
        entry: dict = {"driver": driver, "pool": d.pool, "device": d.device}
        if d.share_id:
            entry["shareID"] = d.share_id
        k = devicestatus.key(entry)
        if k in out:  # one device serving two requests: one entry, both requests in its data
            out[k]["data"]["requests"] += d.requests
            continue
        entry["conditions"] = [{"type": READY, "status": "True", "reason": REASON_PREPARED,
                                "message": "CDI devices written for the container runtime",
                                "lastTransitionTime": when}]  # fmt: skip
        entry["data"] = device_data(d, dev)
        if net := network_data(dev, addrs):
            entry["networkData"] = net
        out[k] = entry
    entries = []
    for entry in out.values():
        if problems := devicestatus.problems(entry):  # our own values: a bug or a hostile sysfs string
            log.warning("status of device %s left out: %s", entry["device"], "; ".join(problems))
            continue
        entries.append(entry)
    return entries


def build_for(settings, prepared: list[PreparedDevice], by_name: dict[str, Device]) -> list[dict]:
    """``build`` for the driver: a bug here costs the status, never the prepared claim."""
    try:
        return build(settings.driver_name, settings.root, prepared, by_name)
    except Exception:
        log.exception("status.devices entries not built")
        return []


class RecordedStatus:
    """``DriverProtocol.recorded_status``: a prepared claim's entries as its checkpoint entry holds
    them now, asked by the status writer right before it writes (in a writer thread, without
    the serialize lock: entries are replaced, never changed in place). After another process saved
    (``sysdra metadata update``), the file is what counts until the driver reloads it itself."""

    def __init__(self, checkpoint: Callable[[], Checkpoint | None]):
        self._checkpoint = checkpoint
        self._saved_by_other: Checkpoint | None = None  # read-only view of the file, while it is newer

    def __call__(self, ref: ClaimRef) -> list[dict] | None:
        cp = self._checkpoint()
        if cp is not None and cp.saved_by_another():
            cp = self._from_disk(cp.path)
        entry = cp.claims.get(ref.uid) if cp is not None else None
        if not entry or entry.get("state") != COMPLETED or (entry.get("namespace"), entry.get("name")) != (ref.namespace, ref.name):
            return None
        return entry.get("deviceStatus")

    def _from_disk(self, path: str) -> Checkpoint | None:
        view = self._saved_by_other
        if view is not None and not view.changed_on_disk():
            return view
        try:
            view = self._saved_by_other = Checkpoint.load(path, move_corrupt=False)
        except (CheckpointError, ValueError, RecursionError, OSError) as err:
            log.warning("checkpoint %s changed on disk but cannot be read (%s): status written as prepared", path, err)
            return None
        return view
