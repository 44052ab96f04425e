"""A reader's view of the driver's checkpoint, kept current at the cost of what changed.

The NRI plugin asks which prepared claims a pod sandbox has, for every pod of the node, often
right after a prepare saved; loading the checkpoint each time replays the whole journal (up to
``Checkpoint.compact_bytes`` of records, each checked as a typed record). Between compactions
the journal only grows, so the view reads the records appended since its last look, and the
files whole only when a compaction replaced them. It never writes.
"""

from __future__ import annotations

import os

from agent.prepare.checkpoint import Checkpoint
from agent.prepare.checkpoint_format import parse_journal_line


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


class CheckpointView:
    def __init__(self, path: str):
        self.path = path
        self._cp: Checkpoint | None = None

    def claims(self) -> dict[str, dict]:
        """The checkpoint's entries now. Raises ValueError (or OSError) when the files cannot
        be read."""
        claims = self.appended()
        if claims is None:
            claims = (cp := Checkpoint.load(self.path, move_corrupt=False)).claims
            self._cp = cp
        return claims

    def appended(self) -> dict[str, dict] | None:
        """The entries now if only records were appended since the last look (two stats and a
        read of those records: cheap enough for an event loop), else None: :meth:`claims` reads
        the files whole."""
        cp = self._cp
        if cp is None or not self._appended_only(cp) or not self._read_appended(cp):
            return None
        return cp.claims

    def rejected(self) -> dict[str, tuple[object, str]]:
        """The entries of the last :meth:`claims` that failed their checks (never in it)."""
        return self._cp.rejected if self._cp is not None else {}

    @staticmethod
    def _appended_only(cp: Checkpoint) -> bool:
        """The snapshot and the journal are the files last read: a compaction replaces both."""
        now = cp._disk_stamp()
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
            except ValueError:
                return False
            cp.apply_record(rec, cp._journal_records + 2)
            cp._journal_size += len(line) + 1
            cp._journal_records += 1
        return True
