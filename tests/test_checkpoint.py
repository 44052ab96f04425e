"""Crash and reboot safety of prepare/unprepare: two-phase checkpoint and start-up recovery."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from agent.kubeletplugin.types import ClaimRef
from agent.prepare import cdifiles
from agent.prepare.checkpoint import COMPLETED, Checkpoint, CheckpointError
from agent.prepare.driver import Driver
from agent.prepare.metadata import layout as mdlayout
from agent.prepare.metadata import read_file as read_metadata
from tests.conftest import REPO
from tests.kubelet_standin import claim, gpu, inventory, nic, settings_for

FAULTS = ["prepare:started", "prepare:specs-written", "prepare:completed", "unprepare:saved", "unprepare:done"]


class Crash(BaseException):
    """Stands in for SIGKILL: nothing after the fault point runs, memory state is dropped."""


def make_env(tmp, boot="boot-1", **kw):
    root = os.path.join(str(tmp), "root")
    bootfile = os.path.join(root, "proc/sys/kernel/random/boot_id")
    os.makedirs(os.path.dirname(bootfile), exist_ok=True)
    with open(bootfile, "w") as f:
        f.write(boot + "\n")
    s = settings_for(str(tmp), root=root, **kw)
    state = {"inv": inventory(*(gpu(n, root=root) for n in range(4)), nic(0), nic(1), root=root)}
    return s, state


def new_driver(s, state):
    d = Driver(s, lambda: state["inv"])
    d.recover()
    return d


def ref(c):
    m = c["metadata"]
    return ClaimRef(m["namespace"], m["name"], m["uid"])


def assert_consistent(s, d):
    """Every spec in the CDI dir parses and belongs to a completed claim, and vice versa."""
    cp = Checkpoint.load(d.checkpoint_path)
    assert cp.corrupt_path is None
    specs = cdifiles.list_claim_specs(s.cdi_dir, s.driver_name)
    for uid, path in specs.items():
        cdifiles.read_spec(path)
        assert cp.claims.get(uid, {}).get("state") == COMPLETED, f"orphan spec {path}"
    for uid, entry in cp.claims.items():
        assert entry["state"] == COMPLETED
        if entry["devices"]:
            assert uid in specs
    for uid, paths in mdlayout.list_specs(s.cdi_dir, s.driver_name).items():  # KEP-5304 metadata specs
        assert cp.claims.get(uid, {}).get("state") == COMPLETED, f"orphan metadata spec {paths}"
        for path in paths:
            mount = cdifiles.read_spec(path)["devices"][0]["containerEdits"]["mounts"][0]
            assert read_metadata(mount["hostPath"])["metadata"]["uid"] == uid
    assert not [n for n in os.listdir(s.cdi_dir) if n.endswith(".tmp")] if os.path.isdir(s.cdi_dir) else True


@pytest.mark.parametrize("fault", FAULTS)
def test_crash_at_every_point_then_restart(tmp_path, fault):
    s, state = make_env(tmp_path)
    keep = claim("keep", [("r", "gpu-0000-1c-00-0")])
    c = claim("c", [("a", "gpu-0000-1b-00-0"), ("b", "nic-0000-40-00-0")])
    d = new_driver(s, state)
    assert d.prepare_claims([keep])[keep["metadata"]["uid"]].error is None

    def boom(point):
        if point == fault:
            raise Crash(point)
    d.fault = boom
    with pytest.raises(Crash):
        d.prepare_claims([c])
        d.unprepare_claims([ref(c)])

    d2 = new_driver(s, state)  # restart
    assert_consistent(s, d2)
    assert keep["metadata"]["uid"] in d2.checkpoint.claims
    res = d2.prepare_claims([c])[c["metadata"]["uid"]]
    assert res.error is None and [x.device for x in res.devices] == ["gpu-0000-1b-00-0", "nic-0000-40-00-0"]
    assert_consistent(s, d2)
    assert d2.unprepare_claims([ref(c), ref(keep)]) == {c["metadata"]["uid"]: None, keep["metadata"]["uid"]: None}
    assert cdifiles.list_claim_specs(s.cdi_dir, s.driver_name) == {}
    assert new_driver(s, state).checkpoint.claims == {}


def test_reprepare_is_idempotent_without_rereading_inventory(tmp_path):
    s, state = make_env(tmp_path)
    c = claim("c", [("a/sub", "gpu-0000-1b-00-0")])
    d = new_driver(s, state)
    first = d.prepare_claims([c])
    state["inv"] = None  # any inventory access would now fail
    assert d.prepare_claims([c]) == first
    assert first[c["metadata"]["uid"]].devices[0].requests == ["a/sub"]


def test_changed_allocation_is_prepared_again(tmp_path):
    s, state = make_env(tmp_path)
    c = claim("c", [("a", "gpu-0000-1b-00-0")])
    d = new_driver(s, state)
    d.prepare_claims([c])
    c["status"]["allocation"]["devices"]["results"][0]["device"] = "gpu-0000-1c-00-0"
    res = d.prepare_claims([c])[c["metadata"]["uid"]]
    assert [x.device for x in res.devices] == ["gpu-0000-1c-00-0"]
    spec = cdifiles.read_spec(cdifiles.claim_spec_path(s.cdi_dir, s.driver_name, c["metadata"]["uid"]))
    assert [x["name"].rsplit("-", 5)[-5:] for x in spec["devices"]] == [["gpu", "0000", "1c", "00", "0"]]


def test_vanished_device_is_that_claims_error(tmp_path):
    s, state = make_env(tmp_path)
    ok, bad = claim("ok", [("a", "gpu-0000-1b-00-0")]), claim("bad", [("a", "gpu-0000-77-00-0")])
    res = new_driver(s, state).prepare_claims([ok, bad])
    assert res[ok["metadata"]["uid"]].error is None
    assert "not on this node" in res[bad["metadata"]["uid"]].error
    assert list(cdifiles.list_claim_specs(s.cdi_dir, s.driver_name)) == [ok["metadata"]["uid"]]


def test_reboot_rebuilds_specs_from_current_inventory(tmp_path):
    s, state = make_env(tmp_path)
    c = claim("c", [("a", "gpu-0000-1b-00-0")])
    d = new_driver(s, state)
    d.prepare_claims([c])
    uid = c["metadata"]["uid"]
    # reboot: /var/run/cdi is tmpfs (emptied), new boot ID, the render node got new numbers
    for p in cdifiles.list_claim_specs(s.cdi_dir, s.driver_name).values():
        os.unlink(p)
    with open(os.path.join(s.root, "proc/sys/kernel/random/boot_id"), "w") as f:
        f.write("boot-2\n")
    state["inv"] = inventory(gpu(0, root=s.root, major=227, minor=5), root=s.root)
    d2 = Driver(s, lambda: state["inv"])
    report = d2.recover()
    assert report.rebuilt == [uid] and report.boot_changed
    spec = cdifiles.read_spec(cdifiles.claim_spec_path(s.cdi_dir, s.driver_name, uid))
    node = spec["devices"][0]["containerEdits"]["deviceNodes"][0]
    assert (node["major"], node["minor"], node["path"]) == (227, 5, "/dev/dri/renderD128") and "hostPath" not in node
    assert d2.checkpoint.claims[uid]["bootID"] == "boot-2"
    assert_consistent(s, d2)
    # the device is gone after the next reboot: the claim stays prepared, its spec of the boot before is not
    # written again (its numbers may be another device's now: tests/test_reboot_devices_gone.py)
    os.unlink(cdifiles.claim_spec_path(s.cdi_dir, s.driver_name, uid))
    with open(os.path.join(s.root, "proc/sys/kernel/random/boot_id"), "w") as f:
        f.write("boot-3\n")
    state["inv"] = inventory(root=s.root)
    assert new_driver(s, state).checkpoint.claims[uid]["state"] == COMPLETED
    assert not os.path.exists(cdifiles.claim_spec_path(s.cdi_dir, s.driver_name, uid))


def test_without_a_boot_id_every_start_counts_as_one_after_a_reboot(tmp_path):
    """agent/bootid.py: with no boot ID readable (""), a reboot cannot be told from a restart, so every
    start rebuilds the specs from the inventory as after one: the device numbers may have changed."""
    s, state = make_env(tmp_path)
    c = claim("c", [("a", "gpu-0000-1b-00-0")])
    uid = c["metadata"]["uid"]
    d = Driver(s, lambda: state["inv"])
    d.boot_id = ""
    assert d.prepare_claims([c])[uid].error is None
    state["inv"] = inventory(gpu(0, root=s.root, major=227, minor=5), root=s.root)  # rebooted, unknown to the agent
    d = Driver(s, lambda: state["inv"])
    d.boot_id = ""
    report = d.recover()
    assert report.boot_changed and report.rebuilt == [uid]
    spec = cdifiles.read_spec(cdifiles.claim_spec_path(s.cdi_dir, s.driver_name, uid))
    assert [(n["major"], n["minor"]) for n in spec["devices"][0]["containerEdits"]["deviceNodes"]] == [(227, 5)]
    assert d.prepare_claims([c])[uid].error is None  # the kubelet's re-prepare: as prepared


def test_orphan_specs_and_temps_removed_others_kept(tmp_path):
    s, state = make_env(tmp_path)
    d = new_driver(s, state)
    c = claim("c", [("a", "gpu-0000-1b-00-0")])
    d.prepare_claims([c])
    orphan = cdifiles.claim_spec_path(s.cdi_dir, s.driver_name, "0rphan00-0000-4000-8000-000000000000")
    with open(orphan, "w") as f:
        f.write("{}")
    for name in ("other-vendor_x.json", f".k8s.{s.driver_name}-claim_x.json.abc.tmp"):
        open(os.path.join(s.cdi_dir, name), "w").close()
    report = Driver(s, lambda: state["inv"]).recover()
    assert report.orphans_removed == ["0rphan00-0000-4000-8000-000000000000"]
    assert sorted(os.listdir(s.cdi_dir)) == sorted(
        ["other-vendor_x.json", os.path.basename(cdifiles.claim_spec_path(s.cdi_dir, s.driver_name, c["metadata"]["uid"])),
         f"{s.driver_name}_metadata_{c['metadata']['uid']}_a.json"])


@pytest.mark.parametrize("garbage", [b"{not json", b"", json.dumps({"version": 1, "checksum": "sha256:00", "claims": {}}).encode(),
                                     b"\xff\xfe", json.dumps([1]).encode()])
def test_corrupt_checkpoint_is_kept_aside_and_claims_adopted(tmp_path, garbage, caplog):
    s, state = make_env(tmp_path)
    d = new_driver(s, state)
    c = claim("c", [("a", "gpu-0000-1b-00-0")])
    d.prepare_claims([c])
    with open(d.checkpoint_path, "wb") as f:
        f.write(garbage)
    d2 = Driver(s, lambda: state["inv"])
    report = d2.recover()
    assert report.corrupt_checkpoint and open(report.corrupt_checkpoint, "rb").read() == garbage
    assert "CHECKPOINT CORRUPT" in caplog.text
    uid = c["metadata"]["uid"]
    assert report.adopted == [uid]  # the spec is still used by running containers: kept
    assert_consistent(s, d2)
    res = d2.prepare_claims([c])[uid]  # kubelet re-prepare maps the allocation again
    assert res.error is None and res.devices[0].requests == ["a"]
    assert d2.unprepare_claims([ref(c)]) == {uid: None}
    assert cdifiles.list_claim_specs(s.cdi_dir, s.driver_name) == {}


def test_newer_checkpoint_version_is_refused(tmp_path):
    s, state = make_env(tmp_path)
    os.makedirs(s.plugin_dir)
    path = os.path.join(s.plugin_dir, "checkpoint.json")
    with open(path, "w") as f:
        json.dump({"version": 99, "claims": {}}, f)
    with pytest.raises(CheckpointError, match="newer sysdra"):
        Driver(s, lambda: state["inv"]).recover()
    assert os.path.exists(path)


WORKER = r"""
import random, sys
from agent.kubeletplugin.types import ClaimRef
from agent.prepare.driver import Driver
from tests.test_checkpoint import make_env, CLAIMS
s, state = make_env(sys.argv[1])
d = Driver(s, lambda: state["inv"])
d.recover()
rnd = random.Random(int(sys.argv[2]))
print("ready", flush=True)
while True:
    batch = rnd.sample(CLAIMS, rnd.randint(1, len(CLAIMS)))
    if rnd.random() < 0.5:
        d.prepare_claims(batch)
    else:
        d.unprepare_claims([ClaimRef(c["metadata"]["namespace"], c["metadata"]["name"], c["metadata"]["uid"]) for c in batch])
"""

# each claim its own devices: one device is never prepared whole for two claims (ownership.py)
CLAIMS = [claim(f"c{i}", [("a", f"gpu-0000-{0x1b + i:02x}-00-0"), ("b", f"nic-0000-{0x40 + i // 2:02x}-00-0")][: 1 + i % 2],
                uid=f"{i}0000000-0000-4000-8000-000000000000") for i in range(4)]


@pytest.mark.slow
def test_sigkill_at_random_moments(tmp_path):
    """>= 100 SIGKILLs of a process looping prepare/unprepare; after each, restart invariants hold."""
    rnd = random.Random(1234)
    env = dict(os.environ, PYTHONPATH=REPO)
    for trial in range(100):
        proc = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path), str(trial)], cwd=REPO, env=env,
                                stdout=subprocess.PIPE)
        assert proc.stdout.readline() == b"ready\n"
        time.sleep(rnd.uniform(0, 0.05))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        s, state = make_env(tmp_path)
        d = new_driver(s, state)
        assert_consistent(s, d)
        res = d.prepare_claims(CLAIMS[:2])
        assert all(r.error is None for r in res.values())
        assert_consistent(s, d)
    assert d.unprepare_claims([ref(c) for c in CLAIMS]) == {c["metadata"]["uid"]: None for c in CLAIMS}
    assert cdifiles.list_claim_specs(s.cdi_dir, s.driver_name) == {}


def test_an_entry_naming_another_claims_spec_never_removes_it(tmp_path):
    """Checkpoint paths are untrusted: an entry whose recorded spec is another claim's file (ours,
    in the CDI dir) leaves that file to its claim at unprepare."""
    s, state = make_env(tmp_path)
    d = new_driver(s, state)
    a, b = CLAIMS[0], CLAIMS[2]
    assert all(r.error is None for r in d.prepare_claims([a, b]).values())
    ua, ub = a["metadata"]["uid"], b["metadata"]["uid"]
    theirs = d._spec_path(ub)
    cp = Checkpoint.load(d.checkpoint_path)
    cp.claims[ua] = {**cp.claims[ua], "cdiSpec": {**cp.claims[ua]["cdiSpec"], "path": theirs}}
    cp.save()
    assert d.unprepare_claims([ref(a)]) == {ua: None}
    assert os.path.exists(theirs) and not os.path.exists(d._spec_path(ua))
