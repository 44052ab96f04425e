"""A damaged checkpoint's entries that its files still establish (agent/prepare/checkpoint_salvage.py):
kept when the files are moved aside, on real files damaged as a disk or a stray writer would."""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import pytest

from agent.prepare.checkpoint import CORRUPT, Checkpoint
from agent.prepare.driver import Driver
from tests.checkpoint_files import entry, journal_lines, path, uid  # noqa: F401 - path: the fixture
from tests.kubelet_standin import claim, gpu, inventory, settings_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def history(path: str) -> Checkpoint:
    """Snapshot: claims 1, 2, 3. Journal: claim 1 changed, claim 4 added, claim 2 changed, claim 3 removed."""
    cp = Checkpoint.load(path)
    cp.claims = {uid(n): entry(n) for n in (1, 2, 3)}
    cp.save()
    for n, value in ((1, {**entry(1), "bootID": "again"}), (4, entry(4)), (2, {**entry(2), "bootID": "again"}), (3, None)):
        if value is None:
            del cp.claims[uid(n)]
        else:
            cp.claims[uid(n)] = value
        cp.save(changed=[uid(n)])
    return cp


def damage_line(cp: Checkpoint, n: int) -> None:
    """Bytes of journal line ``n`` (0: the header) flipped in place: its CRC no longer matches."""
    lines = journal_lines(cp)
    offset = sum(len(x) + 1 for x in lines[:n]) + 12
    with open(cp.journal_path, "r+b") as f:
        f.seek(offset)
        f.write(b"~~~~")


def test_entries_whose_last_record_follows_the_damage_are_kept_and_the_others_are_stale(path):
    cp = history(path)
    damage_line(cp, 2)  # claim 4's record: whose it was cannot be told once damaged
    counted = CORRUPT.values.get((), 0)
    got = Checkpoint.load(path)
    assert got.corrupt_path and CORRUPT.values[()] == counted + 1  # sysdra_checkpoint_corrupt_total
    assert got.claims == {uid(2): cp.claims[uid(2)]}  # its record follows the damage
    assert got.salvage.stale == {uid(1): cp.claims[uid(1)]}  # the damaged line may have changed it
    assert uid(3) in got.salvage.certain and uid(3) not in got.salvage.state  # removed after the damage
    assert uid(4) not in got.salvage.state  # only the damaged line knew it


def test_a_snapshot_that_fails_its_checksum_establishes_nothing(path):
    cp = history(path)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(b"0")
    got = Checkpoint.load(path)
    assert got.corrupt_path and got.claims == {} and got.salvage.state == {}


def test_a_torn_tail_after_the_damage_is_no_second_damage(path):
    cp = history(path)
    damage_line(cp, 4)  # claim 3's removal
    with open(cp.journal_path, "r+b") as f:  # a whole record, then a torn append (its bad lines last)
        f.seek(sum(len(x) + 1 for x in journal_lines(cp)))
        body = b'{"uid":"%s","entry":null}' % uid(1).encode()
        f.write(b"%08x %s\n%08x {\"uid\":\n%08x {\"uid\":" % (zlib.crc32(body), body, zlib.crc32(body), zlib.crc32(body)))
    got = Checkpoint.load(path)
    assert got.claims == {}  # claim 1 removed after the damage: its absence is certain
    assert uid(1) in got.salvage.certain
    assert got.salvage.stale == {uid(2): cp.claims[uid(2)], uid(3): entry(3), uid(4): entry(4)}


def test_an_invalid_entry_recorded_after_the_damage_leaves_its_claim_stale(path):
    cp = history(path)
    damage_line(cp, 1)
    with open(cp.journal_path, "r+b") as f:
        f.seek(sum(len(x) + 1 for x in journal_lines(cp)))
        body = b'{"uid":"%s","entry":{"state":"PrepareCompleted","devices":[{}]}}' % uid(2).encode()
        f.write(b"%08x %s\n" % (zlib.crc32(body), body))
    got = Checkpoint.load(path)
    assert uid(2) in got.salvage.stale and uid(2) not in got.claims
    assert got.claims == {uid(4): entry(4)}


def test_a_second_repair_in_the_same_second_keeps_the_first_files(path):
    cp = history(path)
    damage_line(cp, 1)
    first = Checkpoint.load(path).corrupt_path
    cp = history(path)
    damage_line(cp, 1)
    second = Checkpoint.load(path).corrupt_path
    assert first != second and os.path.exists(first) and os.path.exists(second)


# the other instance of a rolling update (a process of its own, as on a node): a real driver on the
# same plugin directory unprepares a claim, as the kubelet asked it to
OTHER_INSTANCE = """
import sys
from agent.kubeletplugin.types import ClaimRef
from agent.prepare.driver import Driver
from tests.kubelet_standin import gpu, inventory, settings_for
inv = inventory(gpu(0), gpu(1))
d = Driver(settings_for(sys.argv[1]), lambda: inv)
assert d.unprepare_claims([ClaimRef("default", sys.argv[2], sys.argv[3])]) == {sys.argv[3]: None}
if sys.argv[4] == "compaction":  # its save due for one: a new snapshot and journal
    d.checkpoint.compact()
"""


@pytest.mark.parametrize("save", ["append", "compaction"])
def test_a_claim_another_process_unprepared_is_not_taken_back_from_memory(tmp_path, save):
    """This agent's last save still has claim x; the other instance of a rolling update unprepares
    it (its spec removed, the kubelet done with it), then the files are found damaged. This
    process's memory is older than the files: x taken back from it would hold its GPU and have its
    CDI spec written again, with no unprepare ever to come. Memory stands in only while no other
    process saved after it; otherwise the repair is the start's (claims adopted from their specs)."""
    inv = inventory(gpu(0), gpu(1))
    d = Driver(settings_for(str(tmp_path)), lambda: inv)
    d.recover()
    x, y, z = claim("x", [("r", gpu(0).name)], uid=uid(10)), claim("y", [("r", gpu(1).name)], uid=uid(11)), \
        claim("z", [("r", gpu(0).name)], uid=uid(12))
    assert [r.error for r in d.prepare_claims([x, y]).values()] == [None, None]
    subprocess.run([sys.executable, "-c", OTHER_INSTANCE, str(tmp_path), "x", uid(10), save], check=True, cwd=REPO)
    assert not os.path.exists(d._spec_path(uid(10)))
    with open(d.checkpoint_path, "r+b") as f:  # then the snapshot is damaged: nothing of the files is certain
        f.seek(os.path.getsize(d.checkpoint_path) // 2)
        f.write(b"\x00garbage\x00")
    assert d.prepare_claims([z])[uid(12)].error is None  # x's GPU is free
    assert d.recovery.corrupt_checkpoint and d.recovery.from_memory == [] and d.recovery.adopted == [uid(11)]
    assert set(d.checkpoint.claims) == {uid(11), uid(12)} and not os.path.exists(d._spec_path(uid(10)))


def test_a_journal_record_nested_too_deep_to_parse_is_damage_not_a_crash(path):
    """A record with a good CRC whose JSON is nested past the parser's recursion limit: the files
    are moved aside as for any damage (the agent starts), the claims they establish kept."""
    cp = history(path)
    body = b'{"uid":"%s","entry":%s}' % (uid(5).encode(), b"[" * 100_000 + b"]" * 100_000)
    with open(cp.journal_path, "r+b") as f:
        f.seek(cp._journal_size)
        f.write(b"%08x %s\n" % (zlib.crc32(body), body))
    got = Checkpoint.load(path)
    assert got.corrupt_path and not os.path.exists(path)
    assert got.claims == {uid(n): cp.claims[uid(n)] for n in (1, 2, 4)}  # the records before it are whole


def test_a_journal_header_nested_too_deep_to_parse_is_damage_not_a_crash(path):
    cp = history(path)
    body = b"[" * 100_000 + b"]" * 100_000
    with open(cp.journal_path, "wb") as f:
        f.write(b"%08x %s\n" % (zlib.crc32(body), body))
    got = Checkpoint.load(path)
    assert got.corrupt_path and not os.path.exists(path)
