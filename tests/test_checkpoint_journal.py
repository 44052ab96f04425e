"""The checkpoint's files: snapshot + append-only journal, torn appends, compaction, corruption,
the journal's preallocated blocks. Another process's saves and the readers' views are
tests/test_checkpoint_readers.py's."""

from __future__ import annotations

import errno
import json
import logging
import os

import pytest

from agent.fsutil import WriteError
from agent.prepare import checkpoint as cpmod
from agent.prepare.checkpoint import STARTED, Checkpoint, CheckpointError, checksum
from tests.checkpoint_files import _append_records, entry, journal_lines, path, uid  # noqa: F401 - path: the fixture


def test_saves_append_only_the_changed_entries_and_load_replays_them(path):
    cp = Checkpoint.load(path)
    cp.claims[uid(1)] = entry(1, STARTED)
    cp.save(durable=False, changed=[uid(1)])  # first save: snapshot + empty journal
    assert cp.generation == 1 and journal_lines(cp) == [journal_lines(cp)[0]]
    cp.claims[uid(1)] = entry(1)
    cp.claims[uid(2)] = entry(2)
    cp.save(changed=[uid(1), uid(2)])
    del cp.claims[uid(1)]
    cp.save(changed=[uid(1)])
    cp.save(changed=[uid(2)])  # unchanged: nothing appended
    lines = journal_lines(cp)
    assert len(lines) == 4 and cp.journal_records == 3
    records = [json.loads(line.split(b" ", 1)[1]) for line in lines[1:]]
    assert [r["uid"] for r in records] == [uid(1), uid(2), uid(1)] or [r["uid"] for r in records] == [uid(2), uid(1), uid(1)]
    assert records[-1] == {"uid": uid(1), "entry": None}
    with open(path) as f:  # the snapshot still holds the first state: the journal carries the rest
        assert json.load(f)["claims"] == {uid(1): entry(1, STARTED)}
    again = Checkpoint.load(path)
    assert again.claims == {uid(2): entry(2)} and again.corrupt_path is None and again.generation == 1


def test_a_full_save_diffs_every_entry(path):
    cp = Checkpoint.load(path)
    cp.claims = {uid(n): entry(n) for n in range(3)}
    cp.save()
    cp.claims[uid(1)]["bootID"] = "b2"  # changed in place, found by the full diff
    del cp.claims[uid(2)]
    cp.save()
    assert cp.journal_records == 2
    assert Checkpoint.load(path).claims == cp.claims


def test_the_guard_catches_an_entry_changed_but_not_named(path):
    cp = Checkpoint.load(path)
    cp.claims = {uid(1): entry(1), uid(2): entry(2)}
    cp.save()
    cp.claims[uid(2)]["bootID"] = "changed"
    cp.claims[uid(1)] = entry(1, STARTED)
    with pytest.raises(AssertionError, match=uid(2)):
        cp.save(changed=[uid(1)])


def test_durable_saves_fdatasync_the_journal_and_nothing_else(path, monkeypatch):
    cp = Checkpoint.load(path)
    cp.claims[uid(1)] = entry(1)
    cp.save()
    calls = []
    real_fdatasync, real_rename = os.fdatasync, os.rename
    monkeypatch.setattr(os, "fdatasync", lambda fd: calls.append("fdatasync") or real_fdatasync(fd))
    monkeypatch.setattr(os, "rename", lambda a, b: calls.append("rename") or real_rename(a, b))
    cp.claims[uid(2)] = entry(2, STARTED)
    cp.save(durable=False, changed=[uid(2)])
    assert calls == []
    cp.claims[uid(2)] = entry(2)
    cp.save(changed=[uid(2)])
    assert calls == ["fdatasync"]
    cp.save(changed=[uid(2)])  # nothing new and nothing unsynced: no disk work
    assert calls == ["fdatasync"]
    cp.claims[uid(3)] = entry(3, STARTED)
    cp.save(durable=False, changed=[uid(3)])
    cp.save(changed=[uid(3)])  # nothing new, but the last append is not on the disk yet
    assert calls == ["fdatasync", "fdatasync"]


def test_every_cut_of_the_journal_loads_a_prefix_of_the_history(path, caplog):
    """A power cut can leave the journal at any length: each one loads, to the state
    after some prefix of the saves, and the next save continues from there."""
    cp = Checkpoint.load(path)
    cp.save()
    history = [{}]
    ops = [(1, entry(1, STARTED)), (1, entry(1)), (2, entry(2, STARTED)), (1, None), (2, entry(2))]
    for n, e in ops:
        if e is None:
            cp.claims.pop(uid(n))
        else:
            cp.claims[uid(n)] = e
        cp.save(changed=[uid(n)])
        history.append(json.loads(json.dumps(cp.claims)))
    with open(cp.journal_path, "rb") as f:
        full = f.read().rstrip(b"\0")  # the records, without the preallocated zeros
    header = len(journal_lines(cp)[0]) + 1
    caplog.set_level(logging.WARNING)
    for cut in range(header, len(full) + 1):
        with open(cp.journal_path, "wb") as f:
            f.write(full[:cut])
        got = Checkpoint.load(path)
        assert got.corrupt_path is None, cut
        assert got.claims in history, cut
        got.claims[uid(9)] = entry(9)  # the next append overwrites the torn tail
        got.save(changed=[uid(9)])
        assert Checkpoint.load(path).claims == got.claims, cut
    assert "torn last record" in caplog.text


def test_garbage_tail_after_a_power_cut_is_dropped(path):
    """ext4 may show zeros or stale bytes past the last synced append; all of it goes."""
    cp = Checkpoint.load(path)
    cp.claims[uid(1)] = entry(1)
    cp.save()
    cp.claims[uid(2)] = entry(2)
    cp.save(changed=[uid(2)])
    with open(cp.journal_path, "r+b") as f:
        f.seek(cp._journal_size)
        f.write(b"\0" * 300 + b"\nzz\n" + b"\0" * 10 + b"{garbage")
    assert Checkpoint.load(path).claims == cp.claims


def test_a_bad_record_before_a_good_one_is_corruption(path):
    cp = Checkpoint.load(path)
    cp.save()
    for n in (1, 2):
        cp.claims[uid(n)] = entry(n)
        cp.save(changed=[uid(n)])
    lines = journal_lines(cp)
    lines[1] = lines[1].replace(b"gpu-1", b"gpu-X")  # a flipped byte: the CRC no longer matches
    with open(cp.journal_path, "r+b") as f:
        f.write(b"\n".join(lines) + b"\n")
    with pytest.raises(ValueError, match="line 2: record checksum mismatch"):
        Checkpoint.load(path, move_corrupt=False)
    moved = Checkpoint.load(path)
    assert moved.corrupt_path == path + ".corrupt-" + moved.corrupt_path.rsplit("-", 1)[1]
    # the record after the damaged one is claim 2's whole entry: kept (tests/test_checkpoint_salvage.py)
    assert moved.claims == {uid(2): entry(2)} and moved.salvage.stale == {}
    assert not os.path.exists(path) and not os.path.exists(cp.journal_path)
    assert os.path.exists(cp.journal_path + ".corrupt-" + moved.corrupt_path.rsplit("-", 1)[1])


@pytest.mark.parametrize("record", [b'{"uid":"u"}', b"[1]", b'{"uid":5,"entry":{"state":"Nope"}}'])
def test_well_checksummed_records_of_a_bad_shape_are_refused(path, record):
    cp = Checkpoint.load(path)
    cp.save()
    _append_records(cp, record)
    with pytest.raises(ValueError):
        Checkpoint.load(path, move_corrupt=False)


BAD_CONSUMED = (b'{"state":"PrepareCompleted","namespace":"default","name":"x","devices":[{"requests":["r"],"pool":"p",'
                b'"device":"d","cdiDeviceIDs":[],"shareID":"s","consumedCapacity":{"memory":"1e9999999"}}]}')


@pytest.mark.parametrize("entry_json", [b'{"state":"Nope","devices":[]}', b'{"state":"PrepareCompleted","devices":[{}]}',
                                        BAD_CONSUMED])
@pytest.mark.parametrize("key", [b'"u"', b'"%s"' % uid(1).encode()])
def test_well_checksummed_entries_of_a_bad_shape_are_moved_aside(path, key, entry_json):
    """An entry that is not a claim's entry as we write them (a bad key, a bad shape) is never
    used and kept aside for the operator; the other entries stay."""
    cp = Checkpoint.load(path)
    cp.claims = {uid(1): entry(1), uid(2): entry(2)}
    cp.save()
    _append_records(cp, b'{"uid":%s,"entry":%s}' % (key, entry_json))
    from agent.prepare.checkpoint import REJECTED_ENTRIES

    counted = REJECTED_ENTRIES.values.get((), 0)
    got = Checkpoint.load(path)
    assert REJECTED_ENTRIES.values[()] == counted + 1  # sysdra_checkpoint_entries_rejected_total
    assert not got.corrupt_path and got.claims == {u: e for u, e in cp.claims.items() if u.encode() not in key}
    assert list(got.rejected) == [key.strip(b'"').decode()]
    assert json.load(open(got.rejected_path))[key.strip(b'"').decode()]["entry"] == json.loads(entry_json)
    got.save()  # the rejected entry leaves the files for good
    assert Checkpoint.load(path, move_corrupt=False).rejected == {}


def test_compaction_starts_a_new_generation_and_loads_the_same(path):
    cp = Checkpoint.load(path)
    cp.compact_bytes = 2000
    for n in range(40):
        cp.claims[uid(n % 7)] = entry(n)
        if n % 5 == 4:
            cp.claims.pop(uid((n + 3) % 7), None)
        cp.save(changed=[uid(n % 7), uid((n + 3) % 7)])
        assert os.path.getsize(cp.journal_path) <= max(2000, os.path.getsize(path)) + 1000
        assert Checkpoint.load(path).claims == cp.claims
    assert cp.generation > 3
    with open(path) as f:
        snap = json.load(f)
    assert snap["version"] == 2 and snap["generation"] == cp.generation
    assert snap["checksum"] == checksum(snap["claims"], cp.generation)


def test_crash_between_snapshot_and_new_journal(path, monkeypatch, caplog):
    """The old journal is contained in the new snapshot: ignored, then replaced."""
    cp = Checkpoint.load(path)
    cp.claims[uid(1)] = entry(1)
    cp.save()
    cp.claims[uid(2)] = entry(2)
    cp.save(changed=[uid(2)])
    real = cpmod.atomic_write

    def fail_journal(p, data, **kw):
        if p.endswith(".journal"):
            raise WriteError(errno.ENOSPC, "cannot write journal: disk full")
        real(p, data, **kw)

    monkeypatch.setattr(cpmod, "atomic_write", fail_journal)
    caplog.set_level(logging.INFO)
    cp.compact()  # snapshot written, journal not: still saved
    assert "snapshot only" in caplog.text
    loaded = Checkpoint.load(path)
    assert loaded.claims == {uid(1): entry(1), uid(2): entry(2)} and "older than its snapshot" in caplog.text
    cp.claims[uid(1)] = entry(11)
    cp.save(changed=[uid(1)])  # no journal to append to: a snapshot again
    assert caplog.text.count("snapshot only") == 2
    loaded = Checkpoint.load(path)
    assert loaded.claims == {uid(1): entry(11), uid(2): entry(2)}
    monkeypatch.setattr(cpmod, "atomic_write", real)
    loaded.claims[uid(3)] = entry(3)
    loaded.save(changed=[uid(3)])
    assert Checkpoint.load(path).claims == loaded.claims


def test_a_full_disk_mid_append_loses_nothing(path, monkeypatch):
    cp = Checkpoint.load(path)
    cp.claims[uid(1)] = entry(1)
    cp.save()
    size = os.path.getsize(cp.journal_path)
    real = os.pwrite

    def half_then_enospc(fd, data, offset):
        if len(data) > 20:
            return real(fd, bytes(data[: len(data) // 2]), offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", half_then_enospc)
    cp.claims[uid(2)] = entry(2)
    with pytest.raises(WriteError, match="disk full"):
        cp.save(changed=[uid(2)])
    assert os.path.getsize(cp.journal_path) == size  # the half record was cut off
    monkeypatch.setattr(os, "pwrite", real)
    cp.claims.pop(uid(2))  # what the driver does: memory back to what the files say
    assert Checkpoint.load(path).claims == {uid(1): entry(1)}
    cp.claims[uid(3)] = entry(3)
    cp.save(changed=[uid(3)])
    assert Checkpoint.load(path).claims == {uid(1): entry(1), uid(3): entry(3)}


def test_version_1_files_are_read_and_rewritten_as_version_2(path):
    os.makedirs(os.path.dirname(path))
    claims = {uid(1): entry(1)}
    with open(path, "w") as f:
        json.dump({"version": 1, "checksum": checksum(claims, version=1), "claims": claims}, f)
    cp = Checkpoint.load(path)
    assert cp.claims == claims and cp.corrupt_path is None
    cp.claims[uid(2)] = entry(2)
    cp.save(changed=[uid(2)])
    with open(path) as f:
        assert json.load(f)["version"] == 2
    assert Checkpoint.load(path).claims == cp.claims


@pytest.mark.parametrize("case", ["journal-without-snapshot", "journal-newer-than-snapshot", "journal-no-header",
                                  "snapshot-generation-tampered"])
def test_inconsistent_files_are_corrupt(path, case):
    cp = Checkpoint.load(path)
    cp.claims[uid(1)] = entry(1)
    cp.save()
    if case == "journal-without-snapshot":
        os.unlink(path)
    elif case == "journal-newer-than-snapshot":
        cp.compact()
        with open(cp.journal_path, "rb") as f:
            newer = f.read()
        cp.generation -= 2
        cp.compact()  # snapshot of an older generation next to the newer journal
        with open(cp.journal_path, "wb") as f:
            f.write(newer)
    elif case == "journal-no-header":
        with open(cp.journal_path, "wb") as f:
            f.write(b"")
    else:
        with open(path) as f:
            snap = json.load(f)
        snap["generation"] += 1
        with open(path, "w") as f:
            json.dump(snap, f)
    with pytest.raises(ValueError):
        Checkpoint.load(path, move_corrupt=False)
    assert Checkpoint.load(path).corrupt_path


def test_newer_versions_are_refused_not_moved(path):
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        json.dump({"version": 3, "claims": {}}, f)
    with pytest.raises(CheckpointError, match="newer sysdra"):
        Checkpoint.load(path)
    assert os.path.exists(path)


def test_appends_land_in_the_preallocated_zeros(path):
    cp = Checkpoint.load(path)
    cp.save()
    size = os.path.getsize(cp.journal_path)
    assert size == Checkpoint.compact_bytes
    for n in range(20):
        cp.claims[uid(n)] = entry(n)
        cp.save(changed=[uid(n)])
    assert os.path.getsize(cp.journal_path) == size  # same blocks: fdatasync flushes data only
    with open(cp.journal_path, "rb") as f:
        raw = f.read()
    assert raw[cp._journal_size:] == bytes(size - cp._journal_size)


def test_the_next_append_zeroes_a_torn_tail(path):
    cp = Checkpoint.load(path)
    cp.save()
    end = cp._journal_size
    with open(cp.journal_path, "r+b") as f:
        f.seek(end)
        f.write(b"0badc0de " + b"x" * 5000)  # long torn record: longer than the next one
    again = Checkpoint.load(path)
    assert again._garbage_end == end + 5009
    assert again.reload_if_changed()  # the non-zero byte after our end reads as a foreign write
    again.claims[uid(1)] = entry(1)
    again.save(changed=[uid(1)])
    with open(cp.journal_path, "rb") as f:
        raw = f.read()
    assert raw[again._journal_size:end + 5009] == bytes(end + 5009 - again._journal_size)
    assert not again.reload_if_changed()
    assert Checkpoint.load(path).claims == {uid(1): entry(1)}


def test_no_room_to_preallocate_still_saves(path, monkeypatch, caplog):
    cp = Checkpoint.load(path)
    real = cpmod.atomic_write

    def small_disk(p, data, **kw):
        if len(data) > 4096:
            raise WriteError(errno.ENOSPC, f"cannot write {p}: disk full")
        real(p, data, **kw)

    monkeypatch.setattr(cpmod, "atomic_write", small_disk)
    cp.claims[uid(1)] = entry(1)
    cp.save()
    assert "no room to preallocate" in caplog.text
    assert os.path.getsize(cp.journal_path) == cp._journal_size  # header only: appends grow it
    cp.claims[uid(2)] = entry(2)
    cp.save(changed=[uid(2)])
    assert Checkpoint.load(path).claims == cp.claims
