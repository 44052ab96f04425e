"""Crash-safe record of prepared claims in ``<kubelet-dir>/plugins/<driver>/``.

The kubelet keeps claims prepared across its and our restarts and only ever asks us
to unprepare them by UID, so these files are the truth about what we created.

Two files, a snapshot and a journal (why: a prepare's durable save is then one append
and one ``fdatasync`` on an existing file, not a temp file, a rename and two fsyncs):

``checkpoint.json`` (version 2), replaced atomically and durably at each compaction::

    {"version": 2, "generation": G, "checksum": "sha256:<hex of 'G:' + canonical claims JSON>",
     "claims": {"<uid>": {"state": "PrepareStarted" | "PrepareCompleted",
                          "namespace": ..., "name": ..., "bootID": ...,
                          "allocation": "<fingerprint of our allocation results>",
                          "devices": [{"requests": [...], "pool": ..., "device": ...,
                                       "cdiDeviceIDs": [...], "shareID": ...}],
                          "cdiSpec": {"path": ..., "spec": {...}} | null,
                          "metadata": {"podClaimName": ..., "requests": {...}} | null}}}

``checkpoint.journal``, appended to by every save between compactions, one line per record::

    <crc32 of the JSON, 8 hex digits> {"journal": 2, "generation": G}      (first line)
    <crc32> {"uid": "<uid>", "entry": {...}}                                (claim set)
    <crc32> {"uid": "<uid>", "entry": null}                                 (claim removed)
    NUL bytes up to the preallocated size

The journal is created full of zeros (``compact_bytes``), so an append overwrites blocks
the file already has: its ``fdatasync`` flushes data only, with no file-system journal
commit for a new size or new blocks (about half the time on ext4).

The state is the snapshot with the journal's records applied in order, if the journal's
generation equals the snapshot's. A journal of an older generation is already contained
in the snapshot (a crash between writing the snapshot and starting the new journal) and
is ignored. A bad last record is a torn append (crash or power loss mid-write): it is
dropped and overwritten by the next append. A bad record *followed by a good one* is
corruption. Version 1 files (a snapshot only) are read and become version 2 at the next save.

Each entry is sorted as it is read (checkpoint_entries.py): ours; *foreign* (a newer sysdra's: its
known part used, the entry written back as read); damaged (moved aside, ``rejected``).

``metadata`` (KEP-5304, see agent/prepare/metadata/store.py) is optional: older entries lack it.

A snapshot or journal that does not parse, fails its checksum or has a bad shape is
moved aside to ``<name>.corrupt-<unix time>`` (both files: the journal means nothing
without its snapshot) and reported (``Checkpoint.corrupt_path``); it is never silently
replaced. The entries the files still establish are kept (checkpoint_salvage.py). A newer
version is refused (downgrade needs care).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import threading
import time
from typing import Iterable

from agent.fsutil import WriteError, atomic_write, describe_error, json_bytes, make_dirs
from agent.counts import Count
from agent.prepare import checkpoint_entries as entries
from agent.prepare.checkpoint_entries import REJECTED_ENTRIES, Foreign
from agent.prepare.checkpoint_format import (COMPLETED, JOURNAL_SUFFIX, STARTED, VERSION, CheckpointError, canonical,
                                             appended_after, check_snapshot, checksum, claims_text, disk_stamp,
                                             journal_line, parse_journal_line, read_file, remember_saved)

log = logging.getLogger(__name__)

__all__ = ["COMPLETED", "REJECTED_ENTRIES", "STARTED", "VERSION", "Checkpoint", "CheckpointError", "checksum"]

CORRUPT = Count("sysdra_checkpoint_corrupt_total",
                "Times the checkpoint's files were found damaged and moved aside (their claims recovered)")


class Checkpoint:
    """In-memory claims plus ``save()``; single writer at a time (callers hold the serialize
    lock, which also covers other processes such as ``sysdra metadata update``)."""

    # Compact (new snapshot, empty journal) once the journal would grow past this many
    # bytes and past the snapshot's size: replay at start stays short, saves stay appends.
    compact_bytes = 1 << 20

    def __init__(self, path: str):
        self.path = path
        self.journal_path = path + JOURNAL_SUFFIX
        self.claims: dict[str, dict] = {}
        self.corrupt_path: str | None = None  # set when a corrupt file was moved aside
        self.salvage = None  # after corruption: what the damaged files still established (checkpoint_salvage.Salvage)
        self.rejected: dict[str, tuple[object, str]] = {}  # uid -> (entry, why): entries not used
        self.foreign: dict[str, Foreign] = {}  # uid -> a newer sysdra's entry, its known part in ``claims``
        self.rejected_path: str | None = None  # where they were moved aside
        self.stamp: tuple | None = None  # identity of the files last loaded/saved
        self._saving = threading.RLock()  # held while save() or compact() writes: see saved_by_another()
        self.generation = 0
        self._snapshot_size = 0
        self._journal_size: int | None = None  # good bytes in our generation's journal; None: start a new one
        self._journal_records = 0
        self._unsynced = False  # records appended without fdatasync
        self._garbage_end = 0  # a torn append may have left non-zero bytes up to here
        self._encoded: dict[str, bytes] = {}  # uid -> canonical JSON of the entry as the files hold it

    # --- reading ----------------------------------------------------------------------
    disk_stamp = staticmethod(disk_stamp)

    def changed_on_disk(self) -> bool:
        """Another process holding the serialize lock saved (``sysdra metadata update``, the
        other instance of a rolling update): a compaction changes the snapshot's inode, an
        append makes the byte after our last record non-zero (in the preallocated journal
        neither size nor mtime need change)."""
        stamp = self.disk_stamp(self.path)
        return stamp[0] is not None and (stamp != self.stamp or self._foreign_append())

    def saved_by_another(self) -> bool:
        """``changed_on_disk`` asked from another thread than the saver's (a status writer
        thread): False while a save of ours is under way. Its half-written state would look like
        another process's append, and memory is then the newest state anyway: the saver holds
        the serialize lock, so no other process saves meanwhile."""
        if not self._saving.acquire(blocking=False):
            return False
        try:
            return self.changed_on_disk()
        finally:
            self._saving.release()

    def reload_if_changed(self) -> bool:
        """Pick up another process's save (``changed_on_disk``). Vanished files, or a newer
        version's, keep what we have; damaged ones raise ValueError: the caller, holding the
        serialize lock, repairs them (prepare/recovery.py ``repair``)."""
        if not self.changed_on_disk():
            return False
        try:
            fresh = Checkpoint.load(self.path, move_corrupt=False)
        except CheckpointError as err:
            log.error("checkpoint %s changed on disk but cannot be read (%s); keeping the state in memory", self.path, err)
            return False
        if fresh.rejected:  # kept aside and their claims adopted only by a repair, as at start
            raise ValueError(f"{self.path}: entries that are not valid: " + ", ".join(sorted(map(str, fresh.rejected)))[:500])
        corrupt_path, saving = self.corrupt_path, self._saving
        self.__dict__.update(fresh.__dict__)
        self.corrupt_path, self._saving = corrupt_path, saving
        return True

    @classmethod
    def load(cls, path: str, move_corrupt: bool = True) -> "Checkpoint":
        """``move_corrupt=False`` (other processes than the agent): raise ValueError instead."""
        cp = cls(path)
        cp.stamp = cp.disk_stamp(path)
        raw = read_file(path)
        try:
            if raw is None:
                if cp.stamp[1] is not None:
                    raise ValueError(f"{cp.journal_path} exists but its snapshot {path} does not")
                return cp
            data = json.loads(raw)
            if isinstance(data, dict) and isinstance(data.get("version"), int) and data["version"] > VERSION:
                raise CheckpointError(
                    f"{path} has version {data['version']}, written by a newer sysdra; "
                    f"this one understands version {VERSION}. Upgrade, or move the file away knowingly."
                )
            cp.generation, snapshot = check_snapshot(data)
            for uid, entry in snapshot.items():
                cp.take(uid, entry)
            cp._snapshot_size = len(raw)
            cp._replay_journal()
        except (ValueError, UnicodeDecodeError, RecursionError) as err:  # deeply nested JSON too
            if not move_corrupt:
                raise ValueError(f"{path}: {err}") from err
            from agent.prepare.checkpoint_salvage import salvage

            found = cp.salvage = salvage(path, raw)  # before the files move: the entries they still establish
            cp._move_aside(err)
            for uid, entry in found.exact.items():
                cp.take(uid, entry)
            return cp
        cp._encoded = {uid: cp.foreign[uid].raw if uid in cp.foreign else canonical(e) for uid, e in cp.claims.items()}
        # the files still hold the rejected entries: the next save journals their removal
        cp._encoded.update({uid: canonical(e) for uid, (e, _) in cp.rejected.items() if isinstance(uid, str)})
        if cp.rejected and move_corrupt:
            cp.rejected_path = entries.keep_rejected_aside(path, cp.rejected, int(time.time()))
        return cp

    def take(self, uid: str, entry: object) -> None:
        """``uid``'s entry (None: removed) as the files say it now, sorted (checkpoint_entries.py)."""
        self.rejected.pop(uid, None)
        self.foreign.pop(uid, None)
        self.claims.pop(uid, None)
        if entry is None:
            return
        known, foreign, why = entries.sort_entry(self.path, uid, entry)
        if known is None:
            self.rejected[uid] = (entry, why or "")
            return
        self.claims[uid] = known
        if foreign is not None:
            self.foreign[uid] = foreign

    def _replay_journal(self) -> None:
        raw = read_file(self.journal_path)
        if raw is None:
            return  # version 1, or a crash before the first journal: the next save starts one
        used = raw.rstrip(b"\0")  # the preallocated zeros are not records
        lines = used.split(b"\n")
        tail = lines.pop()  # b"" when the records end with a newline; else a torn append
        if not lines:
            raise ValueError(f"{self.journal_path}: no header line")
        header = parse_journal_line(lines[0])
        if not isinstance(header, dict) or header.get("journal") != VERSION or type(header.get("generation")) is not int:
            raise ValueError(f"{self.journal_path}: bad header {header!r}")
        if header["generation"] < self.generation:
            log.info("checkpoint journal %s is older than its snapshot (contained in it); ignored", self.journal_path)
            return
        if header["generation"] > self.generation:
            raise ValueError(f"{self.journal_path} is generation {header['generation']}, "
                             f"newer than its snapshot ({self.generation}): the snapshot was replaced")
        good, offset, records, bad_at = len(lines[0]) + 1, len(lines[0]) + 1, 0, None
        for n, line in enumerate(lines[1:], start=2):
            offset += len(line) + 1
            try:
                rec = parse_journal_line(line)
            except ValueError as err:  # torn, if only torn lines follow
                bad_at = bad_at or (n, err)
                continue
            if bad_at:  # a good record after a bad one: not a torn tail
                raise ValueError(f"{self.journal_path} line {bad_at[0]}: {bad_at[1]}")
            self.apply_record(rec, n)
            good, records = offset, records + 1
        if bad_at or tail:
            log.warning("checkpoint journal %s: dropped a torn last record at byte %d (a crash mid-append); "
                        "it will be overwritten", self.journal_path, good)
        self._journal_size, self._journal_records, self._garbage_end = good, records, len(used)

    def apply_record(self, rec: object, n: int) -> None:
        """One journal record (line ``n``) applied to the claims. A record with a good CRC was
        written whole: a bad shape is corruption, never a tear."""
        if not isinstance(rec, dict) or set(rec) != {"uid", "entry"}:
            raise ValueError(f"{self.journal_path} line {n}: bad record shape")
        uid, entry = rec["uid"], rec["entry"]
        if not isinstance(uid, str):
            raise ValueError(f"{self.journal_path} line {n}: bad uid")
        self.take(uid, entry)  # the record replaced the entry: a rejected one is not used either

    def _move_aside(self, err: Exception) -> None:
        from agent.prepare.checkpoint_salvage import move_aside

        moved = move_aside(self.path, self.journal_path)
        self.corrupt_path = moved[0] if moved else None
        CORRUPT.inc()
        self.claims, self.foreign, self.generation, self._journal_size = {}, {}, 0, None
        self.stamp = self.disk_stamp(self.path)
        log.error(
            "CHECKPOINT CORRUPT: %s (%s); moved aside to %s. The entries they still establish are kept, "
            "other prepared claims recovered (docs/kubelet-plugin.md); inspect the saved files.", self.path, err,
            " and ".join(moved),
        )

    # --- writing ----------------------------------------------------------------------
    @property
    def journal_records(self) -> int:
        return self._journal_records

    def save(self, durable: bool = True, changed: Iterable[str] | None = None) -> None:
        """Persist the claims: journal records for the entries that differ from the files
        (only ``changed`` UIDs are compared when given: the caller knows what it touched),
        or a compaction when the journal is due for one.

        Durable (``fdatasync``) by default: the checkpoint is the one file recovery cannot
        rebuild. ``durable=False`` is for the PrepareStarted phase: it only guards files
        that a power loss wipes anyway (tmpfs CDI dir) or that recovery deletes as orphans,
        so surviving a crash of the process is all it needs (the page cache does that).
        On error (WriteError) the files are unchanged and so is what this object believes
        they hold; the caller restores ``claims``."""
        with self._saving:
            updates = self._updates(changed)
            if self._journal_size is None or self._due_for_compaction(updates):
                self.compact()
                return
            if updates:
                data = b"".join(journal_line(b'{"uid":%s,"entry":%s}' % (json_bytes(uid), b"null" if enc is None else enc))
                                for uid, enc in updates.items())
                self._append(data, durable)
                self._journal_records += len(updates)
                for uid, enc in updates.items():
                    if enc is None:
                        self._encoded.pop(uid, None)
                        self._forget_foreign(uid)
                    else:
                        self._encoded[uid] = enc
            elif durable and self._unsynced:
                self._append(b"", durable=True)
            self.stamp = self.disk_stamp(self.path)
            remember_saved(self.path, self.claims, self._journal_size, self.stamp, self.foreign)

    def _encoding(self, uid: str) -> bytes | None:
        """What the files are to hold for ``uid`` (None: no entry). A foreign entry is written as it
        was read while its claim has one, whatever this agent did to its known part in memory."""
        entry = self.claims.get(uid)
        if entry is None:
            return None
        return self.foreign[uid].raw if uid in self.foreign else canonical(entry)

    def _updates(self, changed: Iterable[str] | None) -> dict[str, bytes | None]:
        """uid -> new canonical encoding (None: removed) for entries that differ from the files."""
        uids = self.claims.keys() | self._encoded.keys() if changed is None else set(changed)
        updates: dict[str, bytes | None] = {}
        for uid in uids:
            if (enc := self._encoding(uid)) != self._encoded.get(uid):
                updates[uid] = enc
        return updates

    def _forget_foreign(self, uid: str) -> None:
        """``uid``'s entry left the files: if a newer sysdra wrote it, said loudly."""
        if (foreign := self.foreign.pop(uid, None)) is not None:
            entries.removed(self.path, uid, foreign)

    def _due_for_compaction(self, updates: dict[str, bytes | None]) -> bool:
        assert self._journal_size is not None
        grown = self._journal_size + sum(len(e or b"") + 64 for e in updates.values())
        return grown > self.compact_bytes and grown > self._snapshot_size

    def _foreign_append(self) -> bool:
        """Another process holding the lock appended after our last record (in the preallocated
        space, which changes neither size nor inode), or a torn append is still there (reloading
        then is harmless)."""
        return self._journal_size is not None and appended_after(self.journal_path, self._journal_size)

    def _append(self, data: bytes, durable: bool) -> None:
        """Write ``data`` at the journal's good end, zeroing what a torn append left after
        it; on error mark the range as possibly dirty, so the next append zeroes it."""
        assert self._journal_size is not None
        end, records = self._journal_size, len(data)
        if self._garbage_end > end + records:
            data += bytes(self._garbage_end - end - records)
        try:
            fd = os.open(self.journal_path, os.O_WRONLY | os.O_CLOEXEC)
        except OSError as err:
            raise WriteError(err.errno, f"cannot write {self.journal_path}: {describe_error(err)}") from err
        try:
            size = os.fstat(fd).st_size
            view, at = memoryview(data), end
            while view:
                n = os.pwrite(fd, view, at)
                view, at = view[n:], at + n
            if durable:
                os.fdatasync(fd)
        except OSError as err:
            self._garbage_end = max(self._garbage_end, min(end + len(data), size))
            try:
                if os.fstat(fd).st_size > size:  # give back what the failed write allocated
                    os.ftruncate(fd, size)
            except OSError:
                pass
            raise WriteError(err.errno, f"cannot write {self.journal_path}: {describe_error(err)}") from err
        finally:
            os.close(fd)
        self._journal_size, self._garbage_end = end + records, 0
        self._unsynced = not durable and (self._unsynced or bool(records))

    def compact(self) -> None:
        """New snapshot of all claims (next generation), then a new empty journal; both
        atomic and durable. A crash in between leaves an older journal, which loading
        ignores; the next save then compacts again."""
        with self._saving:
            make_dirs(os.path.dirname(self.path) or ".", 0o750)
            generation = self.generation + 1
            encoded: dict[str, bytes] = {uid: self._encoding(uid) for uid in self.claims}  # type: ignore[misc]
            claims_json = claims_text(encoded)
            digest = "sha256:" + hashlib.sha256(b"%d:%s" % (generation, claims_json)).hexdigest()
            text = b'{"version": %d, "generation": %d, "checksum": "%s", "claims": %s}\n' % (
                VERSION, generation, digest.encode(), claims_json)
            atomic_write(self.path, text, mode=0o600, durable=True)
            for uid in [u for u in self.foreign if u not in encoded]:
                self._forget_foreign(uid)
            header = journal_line(b'{"journal":%d,"generation":%d}' % (VERSION, generation))
            zeros = max(0, self.compact_bytes - len(header))
            self.generation, self._snapshot_size, self._encoded = generation, len(text), encoded
            self._journal_size, self._journal_records, self._unsynced = None, 0, False
            try:
                try:
                    atomic_write(self.journal_path, header + bytes(zeros), mode=0o600, durable=True)
                except WriteError as err:
                    if err.errno not in (errno.ENOSPC, errno.EDQUOT) or not zeros:
                        raise
                    log.warning("no room to preallocate the checkpoint journal (%s); it grows as it is appended to", err)
                    atomic_write(self.journal_path, header, mode=0o600, durable=True)
                self._journal_size, self._garbage_end = len(header), 0
            except WriteError as err:  # the snapshot holds everything: saved; the next save compacts again
                log.warning("checkpoint saved as a snapshot only; %s", err)
            self.stamp = self.disk_stamp(self.path)
            remember_saved(self.path, self.claims, self._journal_size, self.stamp, self.foreign)
