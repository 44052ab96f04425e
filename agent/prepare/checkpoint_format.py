"""The checkpoint's on-disk format (docs in ``checkpoint.py``): states, checksums, the shape
checks every loaded snapshot and journal record must pass, and the journal's CRC'd lines.

What is read back from disk is untrusted: everything here either returns a checked value
or raises ``ValueError`` naming what is wrong."""

from __future__ import annotations

import hashlib
import json
import os
import zlib

from agent.fsutil import describe_error, json_bytes, read_bounded

VERSION = 2
STARTED = "PrepareStarted"
COMPLETED = "PrepareCompleted"
JOURNAL_SUFFIX = ".journal"


class CheckpointError(Exception):
    """The checkpoint cannot be used and must not be moved aside (e.g. newer version)."""


# a snapshot or journal past this is none the agent wrote (a node's claims take a few MiB at most)
MAX_FILE_BYTES = 256 << 20


def read_file(path: str) -> bytes | None:
    """A checkpoint file's bytes; None: there is none. CheckpointError for one that is there but
    cannot be read (a directory where the file should be, no permission, an I/O error): that is
    not damage to move aside, since nothing of it was read, and no claim can be told prepared."""
    try:
        return read_bounded(path, MAX_FILE_BYTES)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read ({describe_error(err)}): which claims are prepared cannot be "
                              "told; make it the agent's file again, or move it away knowingly (its claims are then "
                              "adopted from their CDI specs)") from None


def canonical(obj: object) -> bytes:
    """Sorted keys, no spaces, UTF-8 (orjson; json.dumps(sort_keys=True, separators=(",", ":"))
    gives the same bytes for ASCII text, ~10x slower)."""
    return json_bytes(obj, sort_keys=True)


def claims_text(encoded: dict[str, bytes]) -> bytes:
    """The claims' canonical JSON from each entry's (the bytes ``canonical(claims)`` gives: keys
    sorted, and UIDs are ASCII): a newer sysdra's entry is its own bytes, never encoded again."""
    return b"{%s}" % b",".join(json_bytes(uid) + b":" + encoded[uid] for uid in sorted(encoded))


def checksum(claims: dict, generation: int = 0, version: int = VERSION) -> str:
    """The snapshot's checksum; version 1 covered the claims only (encoded by json)."""
    if version == 1:
        text = json.dumps(claims, sort_keys=True, separators=(",", ":")).encode()
    else:
        text = b"%d:%s" % (generation, canonical(claims))
    return "sha256:" + hashlib.sha256(text).hexdigest()


def check_snapshot(data: object) -> tuple[int, dict]:
    """-> (generation, claims) of a parsed snapshot, or ValueError. Its entries are checked
    one by one by the caller (records.entry_problem): a bad one is moved aside, not the file."""
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
    return generation, claims


# path -> (the claims as this process's last save left the files, the newer sysdra's entries among
# them (uid -> their bytes), the files' inodes, the journal's end)
_LAST_SAVED: dict[str, tuple[dict[str, dict], dict[str, bytes], tuple, int | None]] = {}


def remember_saved(path: str, claims: dict[str, dict], journal_end: int | None, stamp: tuple,
                   foreign: dict | None = None) -> None:
    """Called by every save (under the serialize lock, so in the order the files were written),
    once the files hold ``claims``, the journal's records ending at ``journal_end``; ``stamp``:
    their ``disk_stamp`` taken since; ``foreign``: uid -> checkpoint_entries.Foreign, the entries
    written as a newer sysdra wrote them."""
    inodes = tuple(s and s[0] for s in stamp)
    raw = {uid: f.raw for uid, f in (foreign or {}).items()}
    _LAST_SAVED[os.path.abspath(path)] = (dict(claims), raw, inodes, journal_end)  # entries are replaced, never changed in place


def last_saved(path: str) -> dict[str, dict] | None:
    """The claims' entries as this process's newest save left the files at ``path``: what a repair of
    damaged files takes for the entries they no longer establish (prepare/recovery.py). None: no
    save yet, or another process (the other instance of a rolling update, ``sysdra metadata
    update``) saved since, as the damaged files still show: a compaction replaced a file, or the
    journal holds bytes after our last record. Its save may have removed a claim (an unprepare)
    that this memory would bring back; the damage itself, in what we wrote, is no such sign."""
    saved = _LAST_SAVED.get(os.path.abspath(path))
    if saved is None:
        return None
    claims, raw, inodes, end = saved
    if tuple(s and s[0] for s in disk_stamp(path)) != inodes:
        return None
    if end is not None and appended_after(path + JOURNAL_SUFFIX, end):
        return None
    return {**claims, **{uid: json.loads(raw[uid]) for uid in claims.keys() & raw.keys()}}  # whole, as the files held them


def disk_stamp(path: str) -> tuple:
    """(inode, mtime, size) of the snapshot at ``path`` and of its journal (None: missing)."""
    out = []
    for p in (path, path + JOURNAL_SUFFIX):
        try:
            st = os.stat(p)
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
        except FileNotFoundError:
            out.append(None)
    return tuple(out)


def appended_after(journal_path: str, size: int) -> bool:
    """Whether the journal has a non-zero byte at ``size`` (the end of the records someone
    last read or wrote): an append since. An unreadable journal says no."""
    try:
        fd = os.open(journal_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # (a FIFO swapped in)
    except OSError:
        return False
    try:
        return os.pread(fd, 1, size) not in (b"", b"\0")
    finally:
        os.close(fd)


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
