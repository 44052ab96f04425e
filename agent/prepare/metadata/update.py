"""Deferred metadata updates (``sysdra metadata update``), e.g. from an NRI plugin or OCI
hook once the pod sandbox's network exists: set a device's ``networkData`` and rewrite
the request's stream with ``generation + 1``.

Runs in its own process, so it takes the plugin's ``flock`` on ``serialize.lock`` (the
same one prepare/unprepare hold) and records the new generation in the checkpoint; the
agent reloads a checkpoint that changed on disk before its next prepare or unprepare.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import time
from dataclasses import dataclass, field

from agent.apilimits import MAX_HARDWARE_ADDRESS, MAX_INTERFACE_NAME, MAX_IPS
from agent.kubeletplugin import devicestatus
from agent.kubeletplugin.claimcheck import check_ref
from agent.kubeletplugin.types import ClaimRef, base_request
from agent.prepare.checkpoint import COMPLETED, Checkpoint, CheckpointError
from agent.prepare.metadata import layout, store
from agent.settings import Settings

LOCK_TIMEOUT = 60.0  # seconds; prepare must finish within the kubelet's 45 s


class UpdateError(Exception):
    """The update was refused; nothing was written."""


@dataclass
class NetworkData:
    interface_name: str | None = None
    ips: list[str] = field(default_factory=list)
    hardware_address: str | None = None
    all_ips: bool = False  # ``ips`` are all the device's addresses (none: no ``ips``), not only the given ones

    def check(self) -> None:
        if self.interface_name is not None and len(self.interface_name.encode()) > MAX_INTERFACE_NAME:
            raise UpdateError(f"interface name is longer than {MAX_INTERFACE_NAME} bytes")
        if self.hardware_address is not None and len(self.hardware_address.encode()) > MAX_HARDWARE_ADDRESS:
            raise UpdateError(f"hardware address is longer than {MAX_HARDWARE_ADDRESS} bytes")
        if len(self.ips) > MAX_IPS or len(set(self.ips)) != len(self.ips):
            raise UpdateError(f"at most {MAX_IPS} unique IPs")
        for ip in self.ips:
            if "/" not in ip:
                raise UpdateError(f"IP {ip!r} must be in CIDR form, e.g. 192.0.2.5/24")
            try:
                ipaddress.ip_interface(ip)
            except ValueError as err:
                raise UpdateError(f"IP {ip!r}: {err}") from err
            if devicestatus.canonical_interface_address(ip) is None:  # the server's check refuses every form of it
                raise UpdateError(f"IP {ip!r} is not an interface address in CIDR form the API accepts")

    def apply(self, device: dict) -> None:
        net = dict(device.get("networkData") or {})
        if self.interface_name is not None:
            net["interfaceName"] = self.interface_name
        if self.ips:
            net["ips"] = list(self.ips)
        elif self.all_ips:
            net.pop("ips", None)
        if self.hardware_address is not None:
            net["hardwareAddress"] = self.hardware_address
        if net:
            device["networkData"] = net


class Flock:
    """``flock`` on ``path`` waited for up to ``timeout`` seconds (UpdateError after)."""

    def __init__(self, path: str, timeout: float):
        self.path, self.timeout = path, timeout

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise UpdateError(f"timed out after {self.timeout:.0f}s waiting for {self.path}") from None
                time.sleep(0.05)

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def update_request(settings: Settings, ref: ClaimRef, request: str, net: NetworkData,
                   device: str | None = None, lock_timeout: float = LOCK_TIMEOUT) -> tuple[int, str]:
    """Rewrite one request's metadata with ``net`` on ``device`` (default: the request's
    first device). Returns (new generation, host file)."""
    problem = check_ref(ref)
    if problem:
        raise UpdateError(problem)
    net.check()
    base = base_request(request)
    if not os.path.isdir(settings.plugin_dir):
        raise UpdateError(f"request not found in prepared claim: {settings.plugin_dir} does not exist")
    with Flock(os.path.join(settings.plugin_dir, "serialize.lock"), lock_timeout):
        try:
            cp = Checkpoint.load(os.path.join(settings.plugin_dir, "checkpoint.json"), move_corrupt=False)
        except (CheckpointError, ValueError) as err:
            raise UpdateError(f"cannot read the checkpoint: {err}") from err
        if cp.rejected:  # a save would journal their removal: the agent keeps them aside and adopts their claims
            raise UpdateError(f"the checkpoint holds entries that are not valid (claims {', '.join(sorted(map(str, cp.rejected)))[:300]}): "
                              "the agent keeps them aside and adopts their claims at its next prepare, unprepare or start; "
                              "run this again after that")
        entry = cp.claims.get(ref.uid)
        rec = ((entry or {}).get("metadata") or {}).get("requests", {}).get(base)
        if (entry is None or entry["state"] != COMPLETED or rec is None
                or (entry["namespace"], entry["name"]) != (ref.namespace, ref.name)):
            raise UpdateError(f"request not found in prepared claim: {ref.namespace}/{ref.name} "
                              f"(uid {ref.uid}) request {request!r}")
        if ref.uid in cp.foreign:  # saving it would drop what this sysdra does not know of it
            raise UpdateError(f"{ref.namespace}/{ref.name} (uid {ref.uid}) was prepared by a newer sysdra (its checkpoint "
                              f"entry has fields this one does not know: {cp.foreign[ref.uid].fields}); update it with that one")
        try:
            generation = update_entry(settings, ref.uid, entry, base, net, device, request)
            cp.save()
        except OSError as err:
            raise UpdateError(str(err)) from err
    return generation, layout.host_file(settings.plugin_dir, ref.namespace, ref.name, base)


def update_entry(settings: Settings, uid: str, entry: dict, base: str, net: NetworkData, device: str | None = None,
                 request: str = "") -> int:
    """``net`` into a prepared claim's entry (its metadata record and ``deviceStatus``) and the
    request's metadata file rewritten -> the new generation; the caller holds the plugin's lock
    and saves the checkpoint. UpdateError (nothing changed) for an unknown device."""
    rec = (entry.get("metadata") or {}).get("requests", {}).get(base)
    devices = [d for r in rec["requests"] for d in r["devices"]] if rec else []
    target = next((d for d in devices if device is None or d["name"] == device), None)
    if target is None:
        raise UpdateError(f"device {device!r} is not in request {request or base!r} of {entry.get('namespace')}/{entry.get('name')}")
    net.apply(target)
    update_status(entry, target["name"], net)  # status.devices follows (write_status)
    return store.write_file(settings, uid, entry, base)


def update_status(entry: dict, device: str, net: NetworkData) -> bool:
    """``net`` into the claim's recorded ``deviceStatus`` entries of ``device`` (IPs in the
    server's canonical form) -> whether there was one."""
    found = False
    for status_entry in entry.get("deviceStatus") or []:
        if status_entry.get("device") == device:
            found = True
            net.apply(status_entry)
            ips = (status_entry.get("networkData") or {}).get("ips", [])
            canon = [devicestatus.canonical_interface_address(ip) or ip for ip in ips]
            if canon:
                status_entry["networkData"]["ips"] = list(dict.fromkeys(canon))
    return found


def write_status(settings: Settings, ref: ClaimRef, client=None) -> int | None:
    """Write the claim's ``status.devices`` entries as recorded (after ``update_request``):
    by server-side apply, or into the ``dir:`` claim file. -> entries written; None when the
    claim records none (prepared with ``claim_status`` off). Raises UpdateError."""
    # under the plugin's lock: an unprepare in between must not find its removal undone by us
    with Flock(os.path.join(settings.plugin_dir, "serialize.lock"), LOCK_TIMEOUT):
        try:
            cp = Checkpoint.load(os.path.join(settings.plugin_dir, "checkpoint.json"), move_corrupt=False)
        except (CheckpointError, ValueError, OSError) as err:
            raise UpdateError(f"cannot read the checkpoint: {err}") from err
        entry = cp.claims.get(ref.uid) or {}
        if entry.get("state") != COMPLETED or (entry.get("namespace"), entry.get("name")) != (ref.namespace, ref.name):
            raise UpdateError(f"{ref.namespace}/{ref.name} (uid {ref.uid}) is no longer prepared")
        entries = entry.get("deviceStatus")
        if entries is None:
            return None
        return _write_status(settings, ref, entries, client)


def _write_status(settings: Settings, ref: ClaimRef, entries: list[dict], client) -> int:
    from agent.kubeletplugin.statusbackends import DirStatus, KubeStatus

    if bad := [p for e in entries for p in devicestatus.problems(e)]:
        raise UpdateError("status.devices not written: " + "; ".join(bad))
    # both read the claim and write only if it did not change meanwhile (the agent's writer may be writing it)
    backend = (DirStatus(settings.cluster_dir, settings.driver_name, lock_timeout=5.0) if settings.cluster_dir is not None
               else KubeStatus(settings.driver_name, client))

    try:
        backend.write(ref, entries)
    except Exception as err:
        raise UpdateError(f"status.devices not written: {type(err).__name__}: {err}") from err
    finally:
        if client is None and hasattr(backend, "close"):
            backend.close()
    return len(entries)
