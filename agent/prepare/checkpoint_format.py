"""The checkpoint's on-disk format (docs in ``checkpoint.py``): states, checksums, the shape
checks every loaded snapshot and journal record must pass, and the journal's CRC'd lines.

What is read back from disk is untrusted: everything here either returns a checked value
or raises ``ValueError`` naming what is wrong."""

from __future__ import annotations

import hashlib
import json
import re
import zlib

from agent.fsutil import json_bytes
from agent.names import is_label, is_subdomain, is_uid

_BDF = re.compile(r"[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_DRIVER = re.compile(r"[A-Za-z0-9_.-]{1,64}")

VERSION = 2
STARTED = "PrepareStarted"
COMPLETED = "PrepareCompleted"
JOURNAL_SUFFIX = ".journal"


class CheckpointError(Exception):
    """The checkpoint cannot be used and must not be moved aside (e.g. newer version)."""


def canonical(obj: object) -> bytes:
    """Sorted keys, no spaces, UTF-8 (orjson; json.dumps(sort_keys=True, separators=(",", ":"))
    gives the same bytes for ASCII text, ~10x slower)."""
    return json_bytes(obj, sort_keys=True)


def checksum(claims: dict, generation: int = 0, version: int = VERSION) -> str:
    """The snapshot's checksum; version 1 covered the claims only (encoded by json)."""
    if version == 1:
        text = json.dumps(claims, sort_keys=True, separators=(",", ":")).encode()
    else:
        text = b"%d:%s" % (generation, canonical(claims))
    return "sha256:" + hashlib.sha256(text).hexdigest()


def check_entry(uid: object, entry: object) -> None:
    """An entry as we write them. Names become paths (metadata dirs, spec names), so they
    must have their Kubernetes formats; empty namespace/name is an adopted claim's."""
    if not is_uid(uid):
        raise ValueError(f"claim key {str(uid)[:80]!r} is not a UID")
    if not isinstance(entry, dict) or entry.get("state") not in (STARTED, COMPLETED):
        raise ValueError(f"claim {uid}: bad entry")
    if not isinstance(entry.get("devices"), list) or not all(isinstance(d, dict) for d in entry["devices"]):
        raise ValueError(f"claim {uid}: devices is not a list of objects")
    ns, name = entry.get("namespace"), entry.get("name")
    if (ns or name) and not (is_label(ns) and is_subdomain(name)):
        raise ValueError(f"claim {uid}: namespace/name {str(ns)[:80]!r}/{str(name)[:80]!r} are not Kubernetes names")
    spec = entry.get("cdiSpec")
    if spec is not None and not (isinstance(spec, dict) and isinstance(spec.get("path"), str) and isinstance(spec.get("spec"), dict)):
        raise ValueError(f"claim {uid}: bad cdiSpec")
    for rec in entry.get("vfio") or ():  # functions we moved to vfio-pci: written back to sysfs
        if not (isinstance(rec, dict) and isinstance(rec.get("bdf"), str) and _BDF.fullmatch(rec["bdf"])
                and type(rec.get("group")) is int
                and all(rec.get(k) is None or (isinstance(rec[k], str) and _DRIVER.fullmatch(rec[k])) for k in ("driver", "override"))):
            raise ValueError(f"claim {uid}: bad vfio record")
    status = entry.get("deviceStatus")
    if status is not None and not (isinstance(status, list) and all(isinstance(e, dict) for e in status)):
        raise ValueError(f"claim {uid}: deviceStatus is not a list of objects")
    meta = entry.get("metadata")
    if meta is not None and not (isinstance(meta, dict) and isinstance(meta.get("requests"), dict)
                                 and all(is_label(r) for r in meta["requests"])
                                 and (meta.get("podClaimName") is None or is_label(meta.get("podClaimName")))):
        raise ValueError(f"claim {uid}: bad metadata record")


def check_snapshot(data: object) -> tuple[int, dict]:
    """-> (generation, claims) of a parsed snapshot, or ValueError."""
    if not isinstance(data, dict):
        raise ValueError("top level is not an object")
    version = data.get("version")
    if version not in (1, VERSION):
        raise ValueError(f"unknown version {version!r}")
    generation = data.get("generation", 0) if version == VERSION else 0
    if type(generation) is not int or generation < 0:
        raise ValueError(f"bad generation {generation!r}")
    claims = data.get("claims")
    if not isinstance(claims, dict):
        raise ValueError("claims is not an object")
    if data.get("checksum") != checksum(claims, generation, version):
        raise ValueError("checksum mismatch")
    for uid, entry in claims.items():
        check_entry(uid, entry)
    return generation, claims


def journal_line(body: bytes) -> bytes:
    return b"%08x %s\n" % (zlib.crc32(body), body)


def parse_journal_line(line: bytes) -> object:
    """One journal line (without its newline) -> its JSON value, or ValueError."""
    crc, sep, body = line.partition(b" ")
    try:
        ok = sep and len(crc) == 8 and int(crc, 16) == zlib.crc32(body)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError("record checksum mismatch")
    return json.loads(body)
