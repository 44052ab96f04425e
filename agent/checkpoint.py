"""Crash-safe record of prepared claims: ``<kubelet-dir>/plugins/<driver>/checkpoint.json``.

The kubelet keeps claims prepared across its and our restarts and only ever asks us
to unprepare them by UID, so this file is the truth about what we created.

Format (version 1)::

    {"version": 1, "checksum": "sha256:<hex of the canonical claims JSON>",
     "claims": {"<uid>": {"state": "PrepareStarted" | "PrepareCompleted",
                          "namespace": ..., "name": ..., "bootID": ...,
                          "allocation": "<fingerprint of our allocation results>",
                          "devices": [{"requests": [...], "pool": ..., "device": ...,
                                       "cdiDeviceIDs": [...], "shareID": ...}],
                          "cdiSpec": {"path": ..., "spec": {...}} | null,
                          "metadata": {"podClaimName": ..., "requests": {...}} | null}}}

``metadata`` (KEP-5304, see agent/metadata/store.py) is optional: older files lack it.

A file that does not parse, fails its checksum or has a bad shape is moved aside to
``checkpoint.json.corrupt-<unix time>`` and reported (``Checkpoint.corrupt_path``);
it is never silently replaced. A newer version is refused (downgrade needs care).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time

from agent.fsutil import atomic_write

log = logging.getLogger(__name__)

VERSION = 1
STARTED = "PrepareStarted"
COMPLETED = "PrepareCompleted"


class CheckpointError(Exception):
    """The checkpoint cannot be used and must not be moved aside (e.g. newer version)."""


def _canonical(claims: dict) -> str:
    return json.dumps(claims, sort_keys=True, separators=(",", ":"))


def checksum(claims: dict) -> str:
    return "sha256:" + hashlib.sha256(_canonical(claims).encode()).hexdigest()


def read_boot_id(root: str = "/") -> str:
    """The kernel boot ID of the host (under ``root`` first, then this system's /proc)."""
    for base in (root, "/"):
        try:
            with open(os.path.join(base, "proc/sys/kernel/random/boot_id"), encoding="ascii") as f:
                return f.read().strip()
        except OSError:
            continue
    return ""


def _check_shape(data: object) -> dict:
    if not isinstance(data, dict):
        raise ValueError("top level is not an object")
    if data.get("version") != VERSION:
        raise ValueError(f"unknown version {data.get('version')!r}")
    claims = data.get("claims")
    if not isinstance(claims, dict):
        raise ValueError("claims is not an object")
    if data.get("checksum") != checksum(claims):
        raise ValueError("checksum mismatch")
    for uid, entry in claims.items():
        if not isinstance(entry, dict) or entry.get("state") not in (STARTED, COMPLETED):
            raise ValueError(f"claim {uid}: bad entry")
        if not isinstance(entry.get("devices"), list):
            raise ValueError(f"claim {uid}: devices is not a list")
    return claims


class Checkpoint:
    """In-memory claims plus ``save()``; single writer (callers hold the serialize lock)."""

    def __init__(self, path: str):
        self.path = path
        self.claims: dict[str, dict] = {}
        self.corrupt_path: str | None = None  # set when a corrupt file was moved aside
        self.stamp: tuple[int, int, int] | None = None  # identity of the file last loaded/saved

    def _disk_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def reload_if_changed(self) -> bool:
        """Pick up a save by another process holding the serialize lock (``sysdra metadata
        update``, the other instance of a rolling update). Atomic saves make a new inode,
        so the stamp always changes. A vanished or unreadable file keeps what we have."""
        stamp = self._disk_stamp()
        if stamp is None or stamp == self.stamp:
            return False
        try:
            fresh = Checkpoint.load(self.path, move_corrupt=False)
        except (CheckpointError, ValueError, RecursionError) as err:
            log.error("checkpoint %s changed on disk but cannot be read (%s); keeping the state in memory", self.path, err)
            return False
        self.claims, self.stamp = fresh.claims, fresh.stamp
        return True

    @classmethod
    def load(cls, path: str, move_corrupt: bool = True) -> "Checkpoint":
        """``move_corrupt=False`` (other processes than the agent): raise ValueError instead."""
        cp = cls(path)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                cp.stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
                raw = f.read()
        except FileNotFoundError:
            return cp
        try:
            data = json.loads(raw)
            if isinstance(data, dict) and isinstance(data.get("version"), int) and data["version"] > VERSION:
                raise CheckpointError(
                    f"{path} has version {data['version']}, written by a newer sysdra; "
                    f"this one understands version {VERSION}. Upgrade, or move the file away knowingly."
                )
            cp.claims = _check_shape(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as err:  # deeply nested JSON too
            if not move_corrupt:
                raise ValueError(f"{path}: {err}") from err
            aside = f"{path}.corrupt-{int(time.time())}"
            os.rename(path, aside)
            cp.corrupt_path = aside
            log.error(
                "CHECKPOINT CORRUPT: %s (%s); moved aside to %s. Prepared claims are recovered "
                "from the CDI spec files; inspect the saved file.", path, err, aside,
            )
        return cp

    def save(self, durable: bool = True) -> None:
        """Durable (fdatasync + directory fsync) by default: the checkpoint is the one file
        recovery cannot rebuild. ``durable=False`` is for the PrepareStarted phase: it only
        guards files that a power loss wipes anyway (tmpfs CDI dir) or that recovery deletes
        as orphans, so atomicity against a crash is all it needs. The claims are encoded once, canonically; the checksum covers
        exactly the bytes written (same value as ``checksum(self.claims)``)."""
        os.makedirs(os.path.dirname(self.path), mode=0o750, exist_ok=True)
        canonical = _canonical(self.claims)
        digest = "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
        text = f'{{"version": {VERSION}, "checksum": "{digest}", "claims": {canonical}}}\n'
        atomic_write(self.path, text, mode=0o600, durable=durable)
        self.stamp = self._disk_stamp()
