"""Unprepare marks shared by the instances of a rolling update (both serve one plugin dir).

The kubelet may send a claim's unprepare to the new instance while the old one is still in a
prepare of it that began before (its cancel not seen there yet; the serialize lock is not FIFO).
That prepare must prepare nothing: run after the unprepare, it would leave the claim prepared,
its devices held, with no unprepare to come. Within one process ``service.Prepare`` keeps such
marks in memory; the other instance's are here, in ``<plugin dir>/unprepared.json``:
``{"bootID": ..., "marks": {uid: t}}``, ``t`` the unprepare's CLOCK_MONOTONIC, which every
process of one boot shares (the boot ID tells another boot's marks, whose clock began anew).
Read and written under the serialize lock; a mark older than ``KEEP`` is dropped: a prepare that
began that long ago is past the kubelet's deadline and prepares nothing anyway. A file that
cannot be read counts as no marks (said once per file) and is replaced at the next unprepare.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable

from agent.fsutil import atomic_write_json, read_bounded

log = logging.getLogger(__name__)

FILE = "unprepared.json"
KEEP = 120.0  # seconds: the kubelet gives up on a prepare after 45 s (then it prepares nothing), with room
BOOT_ID = "/proc/sys/kernel/random/boot_id"
MAX_BYTES = 4 << 20  # a mark is ~60 bytes: far more than KEEP's worth of unprepares


def this_boot() -> str:
    """The running kernel's boot ID (whose CLOCK_MONOTONIC the marks are in); "" if unreadable."""
    try:
        with open(BOOT_ID, "rb") as f:
            return f.read(64).decode("ascii", "replace").strip()
    except OSError:
        return ""


class SharedMarks:
    """The marks file of one plugin dir; every method is called holding the serialize lock."""

    def __init__(self, plugin_dir: str, boot_id: str | None = None):
        self.path = os.path.join(plugin_dir, FILE)
        self.boot_id = this_boot() if boot_id is None else boot_id
        self._seen: tuple[tuple[int, int, int], dict[str, float]] | None = None  # (file identity, marks read)
        self._warned: tuple[int, int, int] | None = None

    def record(self, uids: Iterable[str]) -> None:
        """Marks ``uids`` unprepared now. A failed write is logged: the unprepare stands."""
        now = time.monotonic()
        marks = {u: t for u, t in self._read().items() if t >= now - KEEP}
        marks.update(dict.fromkeys(uids, now))
        try:
            atomic_write_json(self.path, {"bootID": self.boot_id, "marks": marks}, mode=0o600, durable=False)
        except OSError as err:  # only the other instance's overtaken prepares go unnoticed
            log.warning("unprepare marks not written (%s): a rolling update's other instance may prepare "
                        "claims %s after their unprepare", err, ", ".join(sorted(marks)))

    def after(self, uids: Iterable[str], began: float) -> set[str]:
        """Those of ``uids`` unprepared (by any instance) after ``began`` (time.monotonic())."""
        uids = set(uids)
        if not uids:
            return set()
        marks = self._read()
        return {u for u in uids if marks.get(u, began) > began}

    def _read(self) -> dict[str, float]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return {}
        except OSError as err:
            log.warning("unprepare marks not read: %s", err)
            return {}
        key = (st.st_ino, st.st_mtime_ns, st.st_size)  # replaced by rename: a new inode each time
        if self._seen is not None and self._seen[0] == key:
            return self._seen[1]
        marks = self._parse(key)
        self._seen = (key, marks)
        return marks

    def _parse(self, key: tuple[int, int, int]) -> dict[str, float]:
        try:
            if key[2] > MAX_BYTES:
                raise ValueError(f"{key[2]} bytes, at most {MAX_BYTES}")
            raw = json.loads(read_bounded(self.path, MAX_BYTES))
            if not isinstance(raw, dict) or not isinstance(raw.get("marks"), dict):
                raise ValueError("not an object with marks")
        except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            if self._warned != key:
                log.warning("unprepare marks %s cannot be read (%s): taken as none; replaced at the next unprepare",
                            self.path, err)
                self._warned = key
            return {}
        if raw.get("bootID") != self.boot_id:  # another boot's clock
            return {}
        now = time.monotonic()
        return {u: float(t) for u, t in raw["marks"].items()
                if isinstance(u, str) and isinstance(t, (int, float)) and not isinstance(t, bool) and t <= now}
