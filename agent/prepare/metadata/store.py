"""Metadata files and their CDI specs for prepared claims, driven by the checkpoint.

A claim's checkpoint entry carries what is needed to rewrite its metadata at any time::

    "metadata": {"podClaimName": "gpu" | null,
                 "requests": {"<base request>": {"generation": 3, "requests": [<request entries>]}}}

``generation`` is the last one written. Every write uses ``max(recorded, file) + 1``, so
it only grows: across rewrites, deferred updates, reboots and lost files.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Iterable

from agent.fsutil import atomic_write, clean_stale_temps, remove_file
from agent.kubeletplugin.types import PreparedDevice, base_request
from agent.names import InvalidName, check_label, is_label
from agent.prepare import cdifiles
from agent.prepare.metadata import layout
from agent.prepare.metadata.stream import POD_CLAIM_NAME_ANNOTATION, MetadataError, build_object, encode, read_file
from agent.settings import Settings
from cdi.spec import SpecError
from discovery.models import Device

log = logging.getLogger(__name__)


_attributes: dict[str, tuple[Device, dict]] = {}  # device name -> (device object, its attributes)


def _device_attributes(dev: Device) -> dict:
    """The device's attributes in API form, built once per device object (discovery keeps
    unchanged devices' objects). Shared: entries are encoded and replaced, never modified."""
    hit = _attributes.get(dev.name)
    if hit is None or hit[0] is not dev:
        hit = _attributes[dev.name] = (dev, dev.to_api().get("attributes") or {})
    return hit[1]


def device_entry(driver: str, pool: str, dev: Device) -> dict:
    """One ``requests[].devices[]`` entry: slice attributes (no capacities), NIC network data."""
    out: dict = {"driver": driver, "pool": pool, "name": dev.name}
    attrs = _device_attributes(dev)
    if attrs:
        out["attributes"] = attrs
    if dev.nic and dev.nic.interfaces:
        iface = dev.nic.interfaces[0]
        net = {"interfaceName": iface.name}
        if iface.mac:
            net["hardwareAddress"] = iface.mac
        out["networkData"] = net  # ips are not known before the pod sandbox exists
    return out


def plan(settings: Settings, claim: dict, prepared: list[PreparedDevice], by_name: dict[str, Device]) -> dict | None:
    """The checkpoint ``metadata`` record for a claim; appends each request's metadata CDI ID
    to the first device returned for that request (so it is injected once per request)."""
    if not prepared:
        return None
    uid = claim["metadata"]["uid"]
    driver = settings.driver_name
    annotations = claim["metadata"].get("annotations") or {}
    pod_claim_name = annotations.get(POD_CLAIM_NAME_ANNOTATION) or None
    if pod_claim_name is not None:
        check_label(f"{POD_CLAIM_NAME_ANNOTATION} annotation", pod_claim_name)  # a path component in containers
    requests: dict[str, dict] = {}
    for d in prepared:
        full = d.requests[0]
        base = base_request(full)
        rec = requests.get(base)
        if rec is None:
            rec = requests[base] = {"generation": 0, "requests": []}
            d.cdi_ids.append(layout.cdi_id(driver, uid, base))
        entries = rec["requests"]
        if not entries or entries[-1]["name"] != full:
            entries.append({"name": full, "devices": []})
        entries[-1]["devices"].append(device_entry(driver, d.pool, by_name[d.device]))
    return {"podClaimName": pod_claim_name, "requests": requests}


Paths = tuple[str, str, str]  # a request's host file, its path in containers, its CDI spec


def _paths(settings: Settings, uid: str, entry: dict, base: str) -> Paths:
    host = layout.host_file(settings.plugin_dir, entry["namespace"], entry["name"], base)
    ctr = layout.container_path(settings.driver_name, entry["name"], base, entry["metadata"]["podClaimName"])
    return host, ctr, layout.spec_path(settings.cdi_dir, settings.driver_name, uid, base)


def _file_generation(path: str, uid: str) -> int:
    try:
        obj = read_file(path)
    except MetadataError:
        return 0
    meta = obj["metadata"]
    return int(meta.get("generation") or 0) if meta.get("uid") == uid else 0


def write_file(settings: Settings, uid: str, entry: dict, base: str, paths: Paths | None = None) -> int:
    """Write one request's stream atomically with the next generation; returns it."""
    host = (paths or _paths(settings, uid, entry, base))[0]
    rec = entry["metadata"]["requests"][base]
    generation = max(int(rec.get("generation") or 0), _file_generation(host, uid)) + 1
    obj = build_object(entry["name"], entry["namespace"], uid, generation, rec["requests"],
                       entry["metadata"]["podClaimName"])
    # not fsynced: after a reboot recover() rewrites every metadata file from the checkpoint
    atomic_write(host, encode(obj), mode=0o644, durable=False, dir_mode=0o755)
    rec["generation"] = generation
    return generation


def write_spec(settings: Settings, uid: str, entry: dict, base: str, paths: Paths | None = None) -> None:
    host, ctr, spec = paths or _paths(settings, uid, entry, base)
    # build_spec validates (cdi.spec.finish): no second check on the way out
    cdifiles.write_spec(spec, layout.build_spec(settings.driver_name, uid, base, host, ctr), check=False)


def write_claim(settings: Settings, uid: str, entry: dict) -> None:
    """All files of a newly prepared claim: each metadata file before the spec that mounts it."""
    for base in (entry.get("metadata") or {}).get("requests", {}):
        paths = _paths(settings, uid, entry, base)  # names checked once for both files
        write_file(settings, uid, entry, base, paths)
        write_spec(settings, uid, entry, base, paths)


def refresh_devices(settings: Settings, entry: dict, by_name: dict[str, Device]) -> None:
    """Re-read device entries from the current inventory (after a reboot: names, MACs and
    attributes may differ; runtime-provided IPs belong to sandboxes that are gone)."""
    for rec in entry["metadata"]["requests"].values():
        for req in rec["requests"]:
            req["devices"] = [device_entry(settings.driver_name, d["pool"], by_name[d["name"]]) if d["name"] in by_name
                              else d for d in req["devices"]]


def ensure_claim(settings: Settings, uid: str, entry: dict, rebuild: bool = False) -> bool:
    """Rewrite missing or unreadable files (all of them with ``rebuild``); True if any was written."""
    meta = entry.get("metadata")
    if not meta:
        return False
    wrote = False
    for base in meta["requests"]:
        paths = _paths(settings, uid, entry, base)
        if rebuild or _file_generation(paths[0], uid) == 0:
            write_file(settings, uid, entry, base, paths)
            wrote = True
        if rebuild or not _spec_current(settings, uid, base, paths):
            write_spec(settings, uid, entry, base, paths)
            wrote = True
    return wrote


def _spec_current(settings: Settings, uid: str, base: str, paths: Paths) -> bool:
    """The request's metadata spec is there, valid, and mounts the file the agent keeps: one kept from
    before ``kubelet_dir`` changed (an adopted claim's) mounted the file under the plugin dir of before."""
    try:
        spec = cdifiles.read_spec(paths[2])
    except SpecError:
        return False
    return spec == layout.build_spec(settings.driver_name, uid, base, paths[0], paths[1])


def remove_claim(settings: Settings, uid: str, namespace: str, name: str, keep_dir: bool = False,
                 requests: Iterable[str] = ()) -> None:
    """Delete the claim's metadata specs and, unless another prepared claim owns the same
    namespace/name (a recreated claim), its host directory. ``requests``: the base requests its
    entry records, whose files go by name before the directory is walked."""
    for path in layout.list_specs(settings.cdi_dir, settings.driver_name).get(uid, []):
        cdifiles.remove_spec(path)
    if not namespace or not name or keep_dir:
        return
    try:
        path = layout.claim_dir(settings.plugin_dir, namespace, name)
    except InvalidName as err:  # from a checkpoint we did not write: touch nothing
        log.warning("claim %s: not removing a metadata directory: %s", uid, err)
        return
    if requests and _remove_written(path, requests):
        return
    if os.path.islink(path):
        os.unlink(path)
        return
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass


def _remove_written(path: str, requests: Iterable[str]) -> bool:
    """Remove a claim's directory as prepare wrote it, a metadata file in a directory per request,
    by name: 7 calls where ``shutil.rmtree``'s walk makes 30 (every unprepare). Links are never
    followed. False when it is not a directory, or holds anything else (a crash's temp file): the
    caller walks what is left."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        for base in requests:
            if not is_label(base):  # a path component: from a checked record, checked again
                return False
            sub = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            try:
                os.unlink(layout.FILE_NAME, dir_fd=sub)
            finally:
                os.close(sub)
            os.rmdir(base, dir_fd=fd)
        os.rmdir(path)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def _dir_uids(path: str) -> set[str]:
    uids = set()
    for req in os.listdir(path) if os.path.isdir(path) else ():
        try:
            uids.add(read_file(os.path.join(path, req, layout.FILE_NAME))["metadata"].get("uid", ""))
        except MetadataError:
            pass
    return uids


def remove_orphans(settings: Settings, claims: dict[str, dict]) -> list[str]:
    """Specs of claims not in ``claims``, specs of requests a claim does not have, and host
    directories whose files name no known claim. Returns what was removed."""
    removed = []
    clean_stale_temps(settings.cdi_dir, prefix="." + layout.spec_prefix(settings.driver_name))  # SIGKILL mid-write
    for uid, paths in layout.list_specs(settings.cdi_dir, settings.driver_name).items():
        entry = claims.get(uid)
        wanted = set()
        if entry and entry.get("metadata"):
            wanted = {_paths(settings, uid, entry, b)[2] for b in entry["metadata"]["requests"]}
        elif entry:  # adopted after a corrupt checkpoint: keep what is there
            continue
        for path in paths:
            if path not in wanted and cdifiles.remove_spec(path):
                removed.append(path)
    root = layout.host_root(settings.plugin_dir)
    owned = {layout.claim_dir_name(e.get("namespace") or "", e.get("name") or "") for e in claims.values() if e.get("metadata")}
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else ():
        path = os.path.join(root, name)
        if name in owned or _dir_uids(path) & set(claims):
            for req in os.listdir(path) if os.path.isdir(path) else ():
                clean_stale_temps(os.path.join(path, req), prefix="." + layout.FILE_NAME + ".")
            continue
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else remove_file(path)
        removed.append(path)
    return removed
