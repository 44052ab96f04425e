"""The checkpoint's files as other processes see them: saves by another process (``sysdra
metadata update``, under the same lock) picked up by ``reload_if_changed``, our own save under way
not taken for another's, and the readers' views (CheckpointView, the NRI plugin's) that read only
what was appended."""

from __future__ import annotations

import os

from agent.prepare.checkpoint import STARTED, Checkpoint
from tests.checkpoint_files import _append_records, entry, path, uid  # noqa: F401 - path: the fixture


def test_reload_picks_up_appends_and_compactions_of_another_process(path):
    ours = Checkpoint.load(path)
    ours.claims[uid(1)] = entry(1)
    ours.save()
    assert not ours.reload_if_changed()
    other = Checkpoint.load(path)  # e.g. `sysdra metadata update`, under the same lock
    other.claims[uid(1)]["bootID"] = "other"
    other.save()
    assert ours.reload_if_changed() and ours.claims[uid(1)]["bootID"] == "other"
    ours.claims[uid(2)] = entry(2)
    ours.save(changed=[uid(2)])  # continues the journal the other process appended to
    other = Checkpoint.load(path)
    assert other.claims == ours.claims
    other.compact()
    assert ours.reload_if_changed() and ours.generation == other.generation
    ours.claims.pop(uid(1))
    ours.save(changed=[uid(1)])
    assert Checkpoint.load(path).claims == {uid(2): entry(2)}


def test_an_append_by_another_process_is_seen_even_with_the_same_size_and_mtime(path):
    ours = Checkpoint.load(path)
    ours.claims[uid(1)] = entry(1)
    ours.save()
    st = os.stat(ours.journal_path)
    other = Checkpoint.load(path)
    other.claims[uid(2)] = entry(2)
    other.save(changed=[uid(2)])
    os.utime(ours.journal_path, ns=(st.st_atime_ns, st.st_mtime_ns))  # a coarse clock: same tick
    assert ours.disk_stamp(ours.path) == ours.stamp
    assert ours.reload_if_changed() and ours.claims == other.claims
    ours.claims[uid(3)] = entry(3)
    ours.save(changed=[uid(3)])  # after the other record, not over it
    assert Checkpoint.load(path).claims == {uid(1): entry(1), uid(2): entry(2), uid(3): entry(3)}


def test_our_own_save_under_way_is_not_taken_for_another_process(path):
    """The status writer asks from the event loop while a prepare saves on a worker thread:
    between the append and the new stamp, the file looks appended to by someone else."""
    import threading

    cp = Checkpoint.load(path)
    cp.claims[uid(1)] = entry(1)
    cp.save()
    appended, go_on = threading.Event(), threading.Event()
    append = cp._append

    def slow_append(data, durable):  # as a slow fdatasync would hold it
        append(data, durable)
        appended.set()
        go_on.wait(10)

    cp._append = slow_append
    cp.claims[uid(2)] = entry(2)
    saver = threading.Thread(target=cp.save, kwargs={"changed": [uid(2)]})
    saver.start()
    try:
        assert appended.wait(10)
        assert cp.changed_on_disk()  # what a reader without the save lock would conclude
        assert not cp.saved_by_another()
    finally:
        go_on.set()
        saver.join(10)
    assert not cp.saved_by_another()
    other = Checkpoint.load(path)
    other.claims[uid(3)] = entry(3)
    other.save()
    assert cp.saved_by_another()


def test_a_readers_view_reads_only_what_was_appended_and_equals_a_full_load(path, monkeypatch):
    """CheckpointView (the NRI plugin's): after each save of the writer, compactions and torn
    appends included, it holds what a full load holds, and between compactions it never loads
    the files whole again."""
    from agent.prepare import checkpoint_view
    from agent.prepare.checkpoint_view import CheckpointView

    monkeypatch.setattr(checkpoint_view, "READ", 64)  # records span several reads
    writer = Checkpoint.load(path)
    writer.save()
    view = CheckpointView(path)
    assert view.claims() == {}
    loads = []
    real_load = Checkpoint.load.__func__
    monkeypatch.setattr(Checkpoint, "load", classmethod(lambda cls, *a, **k: loads.append(a) or real_load(cls, *a, **k)))
    for n in range(6):
        writer.claims[uid(n)] = entry(n, STARTED)
        writer.save(changed=[uid(n)])
        writer.claims[uid(n)] = entry(n)
        writer.save(changed=[uid(n)])
        if n % 2:
            writer.claims.pop(uid(n - 1))
            writer.save(changed=[uid(n - 1)])
        assert view.claims() == writer.claims == real_load(Checkpoint, path).claims
    assert loads == []  # appends only: read incrementally
    writer.compact()
    writer.claims[uid(9)] = entry(9)
    writer.save(changed=[uid(9)])
    assert view.claims() == writer.claims and len(loads) == 1  # a new generation: loaded whole once
    with open(writer.journal_path, "r+b") as f:  # an append under way: no newline yet
        f.seek(writer._journal_size)
        f.write(b"0badc0de {\"uid\": ")
    assert view.claims() == writer.claims and len(loads) == 1  # left for the next look
    with open(writer.journal_path, "r+b") as f:  # stale bytes of a torn append, a line of them
        f.seek(writer._journal_size)
        f.write(b"zz\n")
    assert view.claims() == writer.claims and len(loads) == 2  # loaded whole: the torn tail dropped


def test_a_view_takes_the_in_process_savers_entries_while_the_files_are_as_it_saved_them(path, monkeypatch):
    """With the driver's last save (``Saved``, the NRI plugin's case) the view reads no records
    while the files are as that save left them; another writer's append, an append under way and
    a compaction by another are read from the files; rejected entries count while in the files."""
    from agent.prepare.checkpoint_view import CheckpointView, Saved

    writer = Checkpoint.load(path)
    writer.save()
    saved = [Saved.of(writer)]
    view = CheckpointView(path, lambda: saved[0])
    reads = []
    real_read = CheckpointView._read_appended
    monkeypatch.setattr(CheckpointView, "_read_appended", staticmethod(lambda cp: reads.append(1) or real_read(cp)))
    assert view.claims() == {}
    for n in range(3):
        writer.claims[uid(n)] = entry(n)
        writer.save(changed=[uid(n)])
        saved[0] = Saved.of(writer)
        writer.claims[uid(n)] = entry(n, STARTED)  # memory moves on unsaved: the view keeps what the files hold
        assert view.appended() == {**{uid(i): entry(i) for i in range(n)}, uid(n): entry(n)}
        writer.claims[uid(n)] = entry(n)
    assert reads == [] and view.rejected() == {}
    other = Checkpoint.load(path)  # another process (sysdra metadata update) appends
    other.claims[uid(7)] = entry(7)
    other.save(changed=[uid(7)])
    assert view.claims() == other.claims and uid(7) in view.claims()  # read from the files
    with open(other.journal_path, "r+b") as f:  # an append of the saver's under way
        f.seek(other._journal_size)
        f.write(b"0badc0de {\"uid\": ")
    assert Saved.of(other).on_disk(path) is False
    other.compact()
    saved[0] = Saved.of(writer)  # the saver's last save, the files replaced since
    assert view.claims() == Checkpoint.load(path, move_corrupt=False).claims
    _append_records(other, b'{"uid":"u","entry":{"state":"Nope","devices":[]}}')
    mine = Checkpoint.load(path)  # moves the bad entry aside; the files keep it until a save
    saved[0], before = Saved.of(mine), len(reads)
    assert view.appended() == mine.claims and list(view.rejected()) == ["u"]
    mine.save()
    saved[0] = Saved.of(mine)
    assert view.appended() == mine.claims and view.rejected() == {} and list(mine.rejected) == ["u"]
    assert len(reads) == before  # both from the saver's entries


def test_a_readers_view_says_a_record_nested_too_deep_is_damage(path):
    """A record appended with a good CRC and JSON nested past the parser's recursion limit: the
    view's look (on the NRI plugin's event loop) raises what its callers take for damage
    (ValueError), never a RecursionError that escapes them."""
    import zlib

    import pytest

    from agent.prepare.checkpoint_view import CheckpointView

    writer = Checkpoint.load(path)
    writer.claims[uid(1)] = entry(1)
    writer.save()
    view = CheckpointView(path)
    assert view.claims() == writer.claims
    body = b'{"uid":"%s","entry":%s}' % (uid(2).encode(), b"[" * 100_000 + b"]" * 100_000)
    with open(writer.journal_path, "r+b") as f:
        f.seek(writer._journal_size)
        f.write(b"%08x %s\n" % (zlib.crc32(body), body))
    with pytest.raises(ValueError):
        view.claims()
