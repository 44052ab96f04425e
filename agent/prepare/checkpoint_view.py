"""A reader's view of the driver's checkpoint, kept current at the cost of what changed.

The NRI plugin asks which prepared claims a pod sandbox has, for every pod of the node, often
right after a prepare saved; loading the checkpoint each time replays the whole journal (up to
``Checkpoint.compact_bytes`` of records, each checked as a typed record). The driver runs in the
same process: when the files are still as its last save left them, the view takes that save's
entries (:class:`Saved`, two stats and a one-byte read). Otherwise it reads the records appended
since its last look (between compactions the journal only grows), and the files whole only when
a compaction replaced them. It never writes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from agent.prepare.checkpoint import Checkpoint
from agent.prepare.checkpoint_format import appended_after, disk_stamp, parse_journal_line


READ = 16 << 10  # bytes read at a time: the journal is preallocated with zeros up to 1 MiB


def _until_zeros(fd: int, offset: int) -> bytes:
    """The journal's bytes from ``offset`` up to the preallocated zeros after the last record
    (or the end of the file): what was appended since, not the rest of the preallocation."""
    parts = []
    while True:
        chunk = os.pread(fd, READ, offset)
        end = chunk.find(b"\0")
        if end >= 0:
            parts.append(chunk[:end])
            break
        parts.append(chunk)
        if len(chunk) < READ:
            break
        offset += len(chunk)
    return b"".join(parts)


@dataclass(frozen=True)
class Saved:
    """A checkpoint's entries as its last save left the files, made by the saver's thread right
    after the save (copies: the saver goes on changing its own) for readers in other threads."""
    stamp: tuple
    journal_path: str
    journal_size: int | None
    claims: dict[str, dict]
    rejected: dict[str, tuple[object, str]]

    @classmethod
    def of(cls, cp: Checkpoint) -> Saved:
        # rejected entries stay in the files until a save journals their removal (``_encoded``
        # is what the files hold); the saver keeps them in ``rejected`` for its report
        rejected = {uid: r for uid, r in cp.rejected.items() if uid in cp._encoded}
        return cls(cp.stamp, cp.journal_path, cp._journal_size, dict(cp.claims), rejected)

    def on_disk(self, path: str) -> bool:
        """Whether ``path``'s files still hold exactly this: the same snapshot and journal
        (inode, mtime, size) and a zero after the last record (an append into the preallocated
        journal may change neither size nor, within a clock tick, mtime)."""
        return self.journal_size is not None and disk_stamp(path) == self.stamp \
            and not appended_after(self.journal_path, self.journal_size)


class CheckpointView:
    """``saved``: the in-process saver's last :class:`Saved` (None: none yet), used while the
    files are still as it left them."""

    def __init__(self, path: str, saved: Callable[[], Saved | None] | None = None):
        self.path = path
        self.saved = saved
        self._cp: Checkpoint | None = None
        self._rejected: dict[str, tuple[object, str]] = {}

    def claims(self) -> dict[str, dict]:
        """The checkpoint's entries now. Raises ValueError when the files are damaged, OSError
        or CheckpointError when they cannot be read (a newer sysdra's, a directory where one is)."""
        claims = self.appended()
        if claims is None:
            cp = self._cp = Checkpoint.load(self.path, move_corrupt=False)
            claims, self._rejected = cp.claims, cp.rejected
        return claims

    def appended(self) -> dict[str, dict] | None:
        """The entries now if the in-process saver's last save is what the files hold, or only
        records were appended since the last look (stats and a read of those records: cheap
        enough for an event loop), else None: :meth:`claims` reads the files whole."""
        saved = self.saved() if self.saved is not None else None
        try:
            if saved is not None and saved.on_disk(self.path):
                self._rejected = saved.rejected
                return saved.claims
        except OSError:  # gone meanwhile: the files are read
            pass
        cp = self._cp
        if cp is None or not self._appended_only(cp) or not self._read_appended(cp):
            return None
        self._rejected = cp.rejected
        return cp.claims

    def rejected(self) -> dict[str, tuple[object, str]]:
        """The entries of the last look that failed their checks (never among its claims)."""
        return self._rejected

    @staticmethod
    def _appended_only(cp: Checkpoint) -> bool:
        """The snapshot and the journal are the files last read: a compaction replaces both."""
        now = disk_stamp(cp.path)
        return cp._journal_size is not None and now[0] == cp.stamp[0] and now[1] is not None \
            and cp.stamp[1] is not None and now[1][0] == cp.stamp[1][0]

    @staticmethod
    def _read_appended(cp: Checkpoint) -> bool:
        """False when a record does not parse (torn, or still being written): load it all."""
        with open(cp.journal_path, "rb") as f:
            raw = _until_zeros(f.fileno(), cp._journal_size)
        lines = raw.split(b"\n")
        lines.pop()  # b"", or an append not finished yet
        for line in lines:
            try:
                rec = parse_journal_line(line)
            except (ValueError, RecursionError):  # RecursionError: JSON nested too deep (damage)
                return False
            cp.apply_record(rec, cp._journal_records + 2)
            cp._journal_size += len(line) + 1
            cp._journal_records += 1
        return True
