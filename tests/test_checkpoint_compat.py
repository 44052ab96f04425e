"""Checkpoint entries a newer sysdra wrote (agent/prepare/checkpoint_entries.py; docs/kubelet-plugin.md,
"Checkpoint compatibility"): fields this agent does not know are kept as written through every
journal append and compaction, by a second process sharing the plugin dir as the older agent of a
rolling update does; the claim's known part is held and answered; an unprepare undoes that part; a
restart keeps them; a damaged entry is still moved aside.

The newer agent is this code with one more field in its schema (``futureThing``), in its own process:
its saves are what a later version's would be (the same format, an entry with a field more)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from agent.prepare import cdifiles
from agent.prepare.checkpoint import Checkpoint
from agent.prepare.checkpoint_entries import FOREIGN_ENTRIES, sort_entry
from agent.prepare.checkpoint_format import canonical, journal_line
from agent.prepare.driver import Driver
from agent.prepare.metadata.update import NetworkData, UpdateError, update_request
from tests.checkpoint_files import entry, uid
from tests.conftest import REPO
from tests.kubelet_standin import claim, gpu, inventory
from tests.test_checkpoint import make_env, new_driver, ref

FUTURE = {"futureThing": {"gpu": "0000:1c:00.0", "was": "on"}}
GPUS = {"keep": "1b", "newer": "1c", "other": "1d", "churn": "1e", "taken": "1c"}  # "taken": "newer"'s device
CLAIMS = {n: claim(n, [("a", f"gpu-0000-{bus}-00-0")], uid=f"{i + 1}0000000-0000-4000-8000-000000000000")
          for i, (n, bus) in enumerate(GPUS.items())}
NEWER = CLAIMS["newer"]["metadata"]["uid"]


def newer_writes(path: str, uid_: str, extra: dict = FUTURE) -> bytes:
    """What a newer agent's save does to a claim's entry when its new feature acts: the entry with
    a field more, appended to the journal -> the entry's canonical JSON (what the files hold)."""
    cp = Checkpoint.load(path, move_corrupt=False)
    foreign = cp.foreign.pop(uid_, None)  # the newer agent knows every field of its entries
    cp.claims[uid_] = {**(json.loads(foreign.raw) if foreign else cp.claims[uid_]), **extra}
    cp.save(changed=[uid_])
    return canonical(cp.claims[uid_])


# --- which entries are foreign ------------------------------------------------------------------
FOREIGN = [({"futureThing": 1}, ("futureThing",)),
           ({"devices": [{**entry(1)["devices"][0], "share": {"x": 1}}], "next": None}, ("devices.*.share", "next")),
           ({"netdevs": [{"device": "nic", "request": "r", "host": "eth1", "pod": "net1", "vlan": 5}]}, ("netdevs.*.vlan",)),
           ({"bad\nname": 1}, ("bad\\nname",))]  # a name is said escaped, never interpreted


@pytest.mark.parametrize("extra, unknown", FOREIGN)
def test_an_entry_with_fields_this_agent_does_not_know_is_foreign(extra, unknown):
    known, foreign, why = sort_entry("cp", uid(1), {**entry(1), **extra})
    assert why is None and foreign.unknown == unknown and foreign.raw == canonical({**entry(1), **extra})
    assert set(known) <= set(entry(1)) | {"netdevs"} and sort_entry("cp", uid(1), known)[1] is None  # the known part is ours


DAMAGED = [{"futureThing": 1, "devices": [{}]},  # a known field that is not valid: damaged, whatever else
           {"futureThing": 1, "state": "PrepareSuspended"},  # a new value of a known field is no new field
           {"futureThing": 1, "name": "Not_A_Name"},
           {"futureThing": 1, "devices": 5}]


@pytest.mark.parametrize("extra", DAMAGED)
def test_an_entry_that_is_not_valid_beside_unknown_fields_is_damaged(extra):
    known, foreign, why = sort_entry("cp", uid(1), {**entry(1), **extra})
    assert known is None and foreign is None and why


def test_journal_appends_and_compactions_write_it_back_as_read(tmp_path, caplog):
    path = str(tmp_path / "checkpoint.json")
    cp = Checkpoint.load(path)
    cp.claims = {uid(1): entry(1), uid(2): entry(2)}
    cp.save()
    counted = FOREIGN_ENTRIES.values.get((), 0)
    raw = newer_writes(path, uid(2))
    older = Checkpoint.load(path, move_corrupt=False)
    assert list(older.foreign) == [uid(2)] and "futureThing" not in older.claims[uid(2)]
    older.claims[uid(2)] = {**older.claims[uid(2)], "bootID": "changed here"}  # memory only: the entry is not ours
    older.claims[uid(3)] = entry(3)
    older.save()  # a full diff: nothing of uid 2 is journaled
    assert b'"uid":"%s"' % uid(2).encode() not in open(path + ".journal", "rb").read().split(raw)[-1]
    older.compact()
    assert raw in open(path, "rb").read()  # byte for byte in the snapshot
    again = Checkpoint.load(path)
    assert again.foreign[uid(2)].raw == raw and not again.rejected and again.rejected_path is None
    assert FOREIGN_ENTRIES.values[()] == counted + 1 and caplog.text.count("CHECKPOINT ENTRY OF A NEWER SYSDRA") == 1
    assert f"claim {uid(2)}" in caplog.text and "futureThing" in caplog.text


def test_a_compaction_that_drops_a_newer_entry_forgets_it(tmp_path, caplog):
    """The unprepare's save is a compaction: the entry is said removed, and the claim's next entry
    (this agent's own, prepared anew) is written as it is, not as the newer one was."""
    path = str(tmp_path / "checkpoint.json")
    cp = Checkpoint.load(path)
    cp.claims = {uid(1): entry(1)}
    cp.save()
    newer_writes(path, uid(1))
    older = Checkpoint.load(path, move_corrupt=False)
    del older.claims[uid(1)]
    older.compact()
    assert f"CHECKPOINT ENTRY OF A NEWER SYSDRA REMOVED: claim {uid(1)}" in caplog.text
    older.claims[uid(1)] = entry(11)
    older.save(changed=[uid(1)])
    again = Checkpoint.load(path)
    assert again.claims == {uid(1): entry(11)} and not again.foreign


# --- two processes on one plugin dir ----------------------------------------------------------
AGENT = r"""
import json, os, sys
if sys.argv[3] == "newer":  # a later version: its schema has one field more
    from agent.prepare import records
    class NewerEntry(records.ClaimEntry):
        futureThing: dict | None = None
    records.ClaimEntry = NewerEntry
from agent.prepare.checkpoint import Checkpoint
from agent.prepare.checkpoint_format import canonical
from agent.prepare.metadata.update import Flock
from agent.prepare.driver import Driver
from tests.test_checkpoint import make_env, ref
from tests.test_checkpoint_compat import CLAIMS, FUTURE
Checkpoint.compact_bytes = int(sys.argv[2])
s, state = make_env(sys.argv[1])
os.makedirs(s.plugin_dir, exist_ok=True)
lock = os.path.join(s.plugin_dir, "serialize.lock")
d = Driver(s, lambda: state["inv"])
with Flock(lock, 30):  # as the kubelet plugin holds it, start-up recovery included
    d.recover()
print("ready", flush=True)
for line in sys.stdin:
    cmd, name = line.split()
    c = CLAIMS[name]
    u = c["metadata"]["uid"]
    with Flock(lock, 30):
        if cmd == "prepare":
            out = d.prepare_claims([c])[u].error
        elif cmd == "unprepare":
            out = d.unprepare_claims([ref(c)])[u]
        elif cmd == "future":  # the newer version's feature acts on the claim: recorded in its entry
            d._cp()
            d.checkpoint.claims[u] = {**d.checkpoint.claims[u], **FUTURE}
            d.checkpoint.save(changed=[u])
            out = None
        else:  # "entry": the claim's entry as this agent reads the files now
            out = canonical(d._cp().claims[u]).decode()
    print(json.dumps({"out": out, "generation": d.checkpoint.generation}), flush=True)
"""


class Agent:
    """One agent process serving the plugin dir under ``tmp``."""

    def __init__(self, tmp, schema: str, compact_bytes: int = 1 << 20):
        self.proc = subprocess.Popen([sys.executable, "-c", AGENT, str(tmp), str(compact_bytes), schema], cwd=REPO,
                                     env=dict(os.environ, PYTHONPATH=REPO), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline() == "ready\n", self.proc.stderr.read()

    def __call__(self, cmd: str, name: str) -> dict:
        self.proc.stdin.write(f"{cmd} {name}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read()
        return json.loads(line)

    def stop(self) -> str:
        """-> its log."""
        self.proc.stdin.close()
        self.proc.wait(30)
        return self.proc.stderr.read()


def last_record(path: str, uid_: str) -> bytes:
    """The entry's bytes in the journal's last record of ``uid_``, as its writer wrote them."""
    head = b'{"uid":"%s","entry":' % uid_.encode()
    bodies = [line.split(b" ", 1)[1] for line in open(path + ".journal", "rb").read().rstrip(b"\0").split(b"\n")[1:-1]]
    return [b[len(head):-1] for b in bodies if b.startswith(head)][-1]


@pytest.fixture
def agents():
    """Agent processes, killed at the end whatever the test did."""
    started: list[Agent] = []
    yield lambda *a, **kw: started.append(Agent(*a, **kw)) or started[-1]
    for agent in started:
        if agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait()


def test_the_older_agent_of_a_rolling_update_compacts_and_the_newer_entry_survives(tmp_path, agents):
    """Both serve one plugin dir, serialized by serialize.lock. The newer agent prepares a claim and
    records its new feature in the entry; the older one reads that save, holds the claim's device,
    and its saves (appends, then a compaction) write the entry back byte for byte: the newer one
    finds it whole. Before, the older one's compaction dropped it."""
    s, _ = make_env(tmp_path)
    path = os.path.join(s.plugin_dir, "checkpoint.json")
    older = agents(tmp_path, "older", compact_bytes=4096)
    assert older("prepare", "keep")["out"] is None
    newer = agents(tmp_path, "newer")
    assert newer("prepare", "newer")["out"] is None and newer("future", "newer")["out"] is None
    raw = last_record(path, NEWER)
    assert b'"futureThing":' in raw
    generation = older("prepare", "other")["generation"]
    for _ in range(20):  # the older agent's appends, until one of its saves compacts (a new generation)
        assert older("prepare", "churn")["out"] is None
        if older("unprepare", "churn")["generation"] > generation:
            break
    else:
        pytest.fail("the older agent never compacted")
    assert raw in open(path, "rb").read()  # in the older agent's snapshot as the newer agent wrote it
    err = older("prepare", "taken")["out"]  # the newer claim's device: held by what the older one knows of it
    assert err and "gpu-0000-1c-00-0" in err and NEWER in err
    assert not [n for n in os.listdir(s.plugin_dir) if ".rejected-" in n or ".corrupt-" in n]
    assert newer("entry", "newer")["out"].encode() == raw  # the newer agent reads its own entry, whole
    assert newer("unprepare", "newer")["out"] is None  # its own: the newer agent ends it
    older_log, newer_log = older.stop(), newer.stop()
    assert older_log.count("CHECKPOINT ENTRY OF A NEWER SYSDRA:") == 1 and "futureThing" in older_log
    assert "CHECKPOINT CORRUPT" not in older_log + newer_log
    seen = Checkpoint.load(path, move_corrupt=False)
    assert set(seen.claims) == {u("keep"), u("other")} and not seen.foreign


def u(name: str) -> str:
    return CLAIMS[name]["metadata"]["uid"]


# --- this agent alone with a newer agent's entries ---------------------------------------------
def prepared_by_newer(tmp_path):
    """The claim "newer" prepared, then the newer agent's feature recorded in its entry -> (settings,
    state, the driver, the entry's bytes in the files)."""
    s, state = make_env(tmp_path)
    d = new_driver(s, state)
    assert d.prepare_claims([CLAIMS["newer"]])[NEWER].error is None
    return s, state, d, newer_writes(d.checkpoint_path, NEWER)


def files_hold(d: Driver) -> dict[str, bytes]:
    """uid -> the foreign entries' bytes, as the files hold them now (read-only)."""
    return {k: f.raw for k, f in Checkpoint.load(d.checkpoint_path, move_corrupt=False).foreign.items()}


def test_a_prepare_is_answered_from_what_this_agent_knows_of_the_entry(tmp_path):
    s, state, d, raw = prepared_by_newer(tmp_path)
    res = d.prepare_claims([CLAIMS["newer"]])[NEWER]  # the kubelet again (the driver reads the other save first)
    assert res.error is None and [x.device for x in res.devices] == ["gpu-0000-1c-00-0"]
    moved = json.loads(json.dumps(CLAIMS["newer"]))
    moved["status"]["allocation"]["devices"]["results"][0]["device"] = "gpu-0000-1e-00-0"
    err = d.prepare_claims([moved])[NEWER].error
    assert "written by a newer sysdra (fields this one does not know: futureThing) and its allocation changed" in err
    assert files_hold(d) == {NEWER: raw} and os.path.exists(cdifiles.claim_spec_path(s.cdi_dir, s.driver_name, NEWER))


def test_an_unprepare_undoes_what_this_agent_knows_and_says_what_it_cannot(tmp_path, caplog):
    s, state, d, raw = prepared_by_newer(tmp_path)
    spec = cdifiles.claim_spec_path(s.cdi_dir, s.driver_name, NEWER)
    with caplog.at_level(logging.ERROR):
        assert d.unprepare_claims([ref(CLAIMS["newer"])]) == {NEWER: None}
    assert not os.path.exists(spec) and NEWER not in Checkpoint.load(d.checkpoint_path, move_corrupt=False).claims
    assert f"CHECKPOINT ENTRY OF A NEWER SYSDRA REMOVED: claim {NEWER}" in caplog.text
    assert "its fields futureThing recorded on the host is NOT undone" in caplog.text
    assert d.prepare_claims([CLAIMS["taken"]])[u("taken")].error is None  # its device is free


def test_a_restart_keeps_the_entries_and_makes_their_known_part_good(tmp_path, caplog):
    """After a reboot (a rollback, say): a prepared claim's spec is rebuilt from what this agent
    knows of its entry; an interrupted prepare of the newer agent is not rolled back (left to it);
    the files keep both entries as written (their old boot ID too: the newer agent redoes its part)."""
    s, state, d, raw = prepared_by_newer(tmp_path)
    assert d.prepare_claims([CLAIMS["other"]])[u("other")].error is None
    started = newer_writes(d.checkpoint_path, u("other"), {**FUTURE, "state": "PrepareStarted"})
    for path in cdifiles.list_claim_specs(s.cdi_dir, s.driver_name).values():  # the reboot: tmpfs emptied
        os.unlink(path)
    with open(os.path.join(s.root, "proc/sys/kernel/random/boot_id"), "w") as f:
        f.write("boot-2\n")
    state["inv"] = inventory(*(gpu(n, root=s.root, major=227) for n in range(4)), root=s.root)
    with caplog.at_level(logging.WARNING):
        d2 = Driver(s, lambda: state["inv"])
        report = d2.recover()
    assert report.foreign == sorted([NEWER, u("other")]) and report.rebuilt == [NEWER]
    assert not (report.rejected or report.adopted or report.rolled_back or report.corrupt_checkpoint)
    node = cdifiles.read_spec(cdifiles.claim_spec_path(s.cdi_dir, s.driver_name, NEWER))["devices"][0]
    assert node["containerEdits"]["deviceNodes"][0]["major"] == 227
    assert files_hold(d2) == {NEWER: raw, u("other"): started} and b'"bootID":"boot-1"' in raw
    assert not [n for n in os.listdir(s.plugin_dir) if ".rejected-" in n]
    assert "a newer sysdra's prepare of it was interrupted" in caplog.text and "are not cleaned up" in caplog.text
    err = d2.prepare_claims([CLAIMS["other"]])[u("other")].error
    assert "written by a newer sysdra" in err and "its prepare was interrupted" in err
    assert d2.prepare_claims([CLAIMS["taken"]])[u("taken")].error  # held, interrupted or not
    assert d2.unprepare_claims([ref(CLAIMS["other"])]) == {u("other"): None}
    assert files_hold(Driver(s, lambda: state["inv"])) == {NEWER: raw}


@pytest.mark.parametrize("damage", [{"devices": [{}]}, {"state": "PrepareSuspended"}])
def test_a_damaged_entry_with_unknown_fields_is_still_moved_aside(tmp_path, damage):
    s, state = make_env(tmp_path)
    d = new_driver(s, state)
    assert d.prepare_claims([CLAIMS["newer"]])[NEWER].error is None
    newer_writes(d.checkpoint_path, NEWER, {**FUTURE, **damage})
    report = Driver(s, lambda: state["inv"]).recover()
    assert report.rejected == [NEWER] and report.adopted == [NEWER] and report.foreign == []
    aside = [n for n in os.listdir(s.plugin_dir) if ".rejected-" in n]
    assert len(aside) == 1 and "futureThing" in json.load(open(os.path.join(s.plugin_dir, aside[0])))[NEWER]["entry"]


def test_a_repair_while_serving_keeps_a_newer_entry_from_the_agents_last_save(tmp_path):
    """The snapshot is damaged (nothing of the files can be trusted): the entries come from the
    agent's last save, the newer agent's whole, not what this agent knows of it."""
    s, state, d, raw = prepared_by_newer(tmp_path)
    assert d.prepare_claims([CLAIMS["other"]])[u("other")].error is None  # a save of this agent's
    with open(d.checkpoint_path, "r+b") as f:
        f.seek(os.path.getsize(d.checkpoint_path) // 2)
        f.write(b"\x00garbage\x00")
    report = d.repair_checkpoint()
    assert report.corrupt_checkpoint and NEWER in report.from_memory and report.foreign == [NEWER]
    assert files_hold(d) == {NEWER: raw}


def test_a_damaged_journal_keeps_a_newer_entry_it_still_establishes(tmp_path):
    """A damaged line, then the newer agent's record of its entry: that record is the claim's last
    word (checkpoint_salvage.py), kept whole."""
    s, state, d, raw = prepared_by_newer(tmp_path)
    journal = d.checkpoint_path + ".journal"
    with open(journal, "r+b") as f:
        f.seek(len(f.read().rstrip(b"\0")))
        f.write(b"0badc0de {\"uid\":\"\x00\xff\"}\n" + journal_line(b'{"uid":"%s","entry":%s}' % (NEWER.encode(), raw)))
    report = Driver(s, lambda: state["inv"]).recover()
    assert report.corrupt_checkpoint and report.salvaged == [NEWER] and report.foreign == [NEWER]
    assert not report.adopted and files_hold(d) == {NEWER: raw}


def test_sysdra_metadata_update_refuses_a_newer_entry(tmp_path):
    s, state, d, raw = prepared_by_newer(tmp_path)
    with pytest.raises(UpdateError, match="prepared by a newer sysdra .*futureThing"):
        update_request(s, ref(CLAIMS["newer"]), "a", NetworkData("eth1"))
    assert files_hold(d) == {NEWER: raw}


def test_sysdra_metadata_update_refuses_while_an_entry_is_damaged(tmp_path):
    """A damaged entry (not a newer sysdra's) the agent has not yet kept aside: the update would
    journal its removal, and its claim would vanish unadopted. Refused; the files keep it."""
    s, state = make_env(tmp_path)
    d = new_driver(s, state)
    assert all(r.error is None for r in d.prepare_claims([CLAIMS["keep"], CLAIMS["newer"]]).values())
    newer_writes(d.checkpoint_path, NEWER, {"devices": [{}]})
    with pytest.raises(UpdateError, match="not valid .*" + NEWER):
        update_request(s, ref(CLAIMS["keep"]), "a", NetworkData("eth1"))
    assert NEWER in Checkpoint.load(d.checkpoint_path, move_corrupt=False).rejected


def test_no_leftover_is_swept_while_a_newer_entry_may_record_it(tmp_path):
    """A MIG device no entry records as this agent reads them may be one a newer sysdra's entry
    records in a field this agent does not know: the start leaves it while such an entry is there,
    and sweeps it at the first start after (docs/partitions.md: leftovers)."""
    from tests.mig_node import MigNode, profile, req
    from tests.simnvml_mig import placement
    from tests.test_mig_prepare import driver_for

    node = MigNode(str(tmp_path))
    d = driver_for(node)
    c = node.allocated("a", req("m", profile("1g.35gb")))
    uid_ = c["metadata"]["uid"]
    assert not d.prepare_claims([c])[uid_].error
    nv = node.sim
    stray = next(s for s in (0, 2, 4, 6) if s not in {g["start"] for g in nv.instances().values()})
    nv.nvmlGpuInstanceCreateComputeInstance(nv.nvmlDeviceCreateGpuInstanceWithPlacement(
        nv.nvmlDeviceGetHandleByPciBusId("0000:00:06.0"), 15, placement(stray, 2)), 0)
    newer_writes(d.checkpoint_path, uid_, {"futureMig": [{"gpu": "0000:00:06.0", "start": stray}]})
    again = driver_for(node)
    assert again.recover().foreign == [uid_] and len(nv.instances()) == 2
    assert again.unprepare_claims([ref(c)]) == {uid_: None}  # the claim's own device, as its known part says
    assert [g["start"] for g in nv.instances().values()] == [stray]
    driver_for(node).recover()  # no newer entry now: the leftover is swept
    assert nv.instances() == {}


@pytest.mark.parametrize("damage", [{"devices": [{}]}, {"state": "PrepareSuspended"}])
def test_a_damaged_entry_another_process_appends_while_serving_is_moved_aside_and_its_claim_held(tmp_path, damage):
    """As at start (the test above), an entry found damaged when the agent reloads another
    process's save before a call is kept aside, and its claim adopted from its spec: its devices
    stay held, never given to another claim."""
    s, state = make_env(tmp_path)
    d = new_driver(s, state)
    assert d.prepare_claims([CLAIMS["newer"]])[NEWER].error is None
    newer_writes(d.checkpoint_path, NEWER, {**FUTURE, **damage})  # the other instance, while this one serves
    assert d.prepare_claims([CLAIMS["taken"]])[u("taken")].error  # "newer"'s device: held
    assert [n for n in os.listdir(s.plugin_dir) if ".rejected-" in n]
    assert os.path.exists(cdifiles.claim_spec_path(s.cdi_dir, s.driver_name, NEWER))
