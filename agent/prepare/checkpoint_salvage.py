"""What a damaged checkpoint still tells for certain (docs/kubelet-plugin.md, "Checkpoint and
recovery"): the files are moved aside whole, and the claims' entries they still establish are
kept, so a record of a host change (a netdev in a pod) is not lost with a damaged line elsewhere.

Only checked data counts. A snapshot that fails its checksum tells nothing (nor does its journal:
which snapshot it belongs to cannot be told). With a good snapshot, the journal of its generation
is replayed line by line: each record is a claim's whole entry (or its removal), so a claim whose
last record comes after the last damaged line is known exactly (``certain``). A damaged line may
have been any claim's record, so every other claim's entry is only its state before the damage
(``stale``): used to say which pods a lost netdev record was for, never to move anything. Bad last
lines with no good one after are a torn append, as when loading. An entry a newer sysdra wrote
(checkpoint_entries.py) is established as any other, and kept whole.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Callable

from agent.fsutil import read_bounded
from agent.prepare.checkpoint_format import JOURNAL_SUFFIX, MAX_FILE_BYTES, VERSION, check_snapshot, parse_journal_line


@dataclass
class Salvage:
    state: dict[str, dict] = field(default_factory=dict)  # uid -> its last entry the files still show (checked)
    certain: set[str] = field(default_factory=set)  # uids whose entry (or absence) in ``state`` is the files' last word

    @property
    def exact(self) -> dict[str, dict]:
        return {uid: e for uid, e in self.state.items() if uid in self.certain}

    @property
    def stale(self) -> dict[str, dict]:
        return {uid: e for uid, e in self.state.items() if uid not in self.certain}


def salvage(path: str, raw: bytes | None) -> Salvage:
    """The entries of the damaged files at ``path`` (``raw``: the snapshot's bytes, None: none)
    that can be established; read before they are moved aside."""
    from agent.prepare.checkpoint_entries import sort_entry  # pydantic: the rare path only

    def usable(uid: str, entry: object) -> bool:  # ours, or a newer sysdra's (kept whole: checkpoint_entries.py)
        return sort_entry(path, uid, entry)[0] is not None

    try:
        generation, claims = check_snapshot(json.loads(raw))
    except (TypeError, ValueError, UnicodeDecodeError, RecursionError):
        return Salvage()
    out = Salvage({uid: e for uid, e in claims.items() if usable(uid, e)})
    try:
        data = read_bounded(path + JOURNAL_SUFFIX, MAX_FILE_BYTES)
    except FileNotFoundError:  # a snapshot alone is the whole state (version 1, a crash before the first journal)
        out.certain = set(out.state)
        return out
    except OSError:
        return out  # nothing certain: the journal may have changed any entry
    lines = data.rstrip(b"\0").split(b"\n")[:-1]  # what follows the last newline: a torn append
    header = _header(lines)
    if header is None or header.get("journal") != VERSION or header.get("generation") != generation:
        if header is not None and type(header.get("generation")) is int and header["generation"] < generation:
            out.certain = set(out.state)  # an older journal is contained in the snapshot
        return out
    _replay(lines[1:], out, usable)
    return out


def _header(lines: list[bytes]) -> dict | None:
    """The journal's first line, None when it is missing or not a header."""
    try:
        header = parse_journal_line(lines[0])
    except (ValueError, IndexError, RecursionError):
        return None
    return header if isinstance(header, dict) else None


def _replay(records: list[bytes], out: Salvage, usable: Callable[[str, object], bool]) -> None:
    """The journal's ``records`` (of the snapshot's generation) applied to ``out``: after a damaged
    line that good records follow, only the claims recorded after it are certain; damaged last
    lines are a torn append."""
    out.certain, damaged = set(out.state), False
    for line in records:
        try:
            rec = parse_journal_line(line)
            uid, entry = rec["uid"], rec["entry"]
            if set(rec) != {"uid", "entry"} or not isinstance(uid, str):
                raise ValueError
        except (ValueError, TypeError, KeyError, RecursionError):  # RecursionError: JSON nested too deep
            damaged = True  # whose record it was cannot be told
            continue
        if damaged:  # a good record after a damaged one: the damage was no torn tail
            out.certain, damaged = set(), False
        if entry is not None and usable(uid, entry):
            out.state[uid] = entry
            out.certain.add(uid)
        elif entry is None:
            out.state.pop(uid, None)
            out.certain.add(uid)
        else:  # a whole record of an entry that is not valid: the claim's last word is unusable
            out.certain.discard(uid)


def move_aside(*paths: str) -> list[str]:
    """The damaged files (those of ``paths`` that exist) renamed to ``<path>.corrupt-<unix time>``,
    never over what an earlier repair kept -> their new names."""
    stamp = int(time.time())
    while any(os.path.exists(f"{p}.corrupt-{stamp}") for p in paths):
        stamp += 1
    moved = []
    for p in paths:
        if os.path.exists(p):
            os.rename(p, f"{p}.corrupt-{stamp}")
            moved.append(f"{p}.corrupt-{stamp}")
    return moved
