"""Dynamic MIG at prepare on the simulated NVML (tests/simnvml_mig.py, the H200's real profile
table): claims allocated by the scheduler's allocator from the agent's slices, the GPU and
compute instance created at their placement and destroyed at unprepare, the CDI spec with the
instance's /dev/nvidia-caps nodes, refusals, rollback, and start-up recovery."""

from __future__ import annotations

import errno
import json

import pytest

from agent.kubeletplugin.types import ClaimRef
from agent.prepare import cdifiles
from agent.prepare.checkpoint import Checkpoint
from agent.prepare.driver import Driver
from fixtures.generate import mig_minor
from tests.kubelet_standin import claim as hand_claim
from tests.simnvml import NVMLError
from tests.simnvml_mig import placement
from tests.mig_node import GPU, MigNode, profile, req, whole


@pytest.fixture
def node(tmp_path):
    return MigNode(str(tmp_path))


def driver_for(node: MigNode) -> Driver:
    d = Driver(node.settings, node.inventory)
    d.mig.nvml = lambda: node.nvml
    return d


def ref(c: dict) -> ClaimRef:
    m = c["metadata"]
    return ClaimRef(namespace=m["namespace"], name=m["name"], uid=m["uid"])


def spec_of(d: Driver, c: dict) -> dict[str, list[tuple[str, int, int]]]:
    """Device name -> its nodes (path, major, minor), from the spec file on disk."""
    uid = c["metadata"]["uid"]
    with open(d._spec_path(uid)) as f:
        spec = json.load(f)
    return {x["name"][len(uid) + 1:]: [(n["path"], n.get("major"), n.get("minor")) for n in x["containerEdits"]["deviceNodes"]]
            for x in spec["devices"]}


def test_prepare_creates_the_instance_and_unprepare_destroys_it(node):
    d = driver_for(node)
    c = node.allocated("a", req("m", profile("3g.71gb")))
    res = d.prepare_claims([c])[c["metadata"]["uid"]]
    assert not res.error, res.error
    (dev,) = [r.device for r in res.devices]
    start = int(dev.rsplit("-", 1)[1])
    (gi,) = node.sim.instances().items()
    assert gi[1]["profile"] == 9 and gi[1]["start"] == start and list(gi[1]["cis"]) == ["0"]
    nodes = spec_of(d, c)[dev]
    assert ("/dev/nvidia-caps/nvidia-cap%d" % mig_minor(0, int(gi[0])), 241, mig_minor(0, int(gi[0]))) in nodes
    assert ("/dev/nvidia-caps/nvidia-cap%d" % mig_minor(0, int(gi[0]), 0), 241, mig_minor(0, int(gi[0]), 0)) in nodes
    assert ("/dev/nvidia0", 195, 0) in nodes and ("/dev/nvidiactl", 195, 255) in nodes
    (rec,) = d.checkpoint.claims[c["metadata"]["uid"]]["mig"]
    assert rec == {"gpu": "0000:00:06.0", "device": dev, "profile": 9, "start": start, "size": 4, "gi": int(gi[0]), "ci": 0}
    assert d.unprepare_claims([ref(c)]) == {c["metadata"]["uid"]: None}
    assert node.sim.instances() == {}
    assert node.sim.threads == {"nvml"}  # every change on NVML's own thread (discovery/nvml.py)


def test_claims_share_the_gpu_at_their_placements(node):
    d = driver_for(node)
    done = []
    for name, prof in (("a", "4g.71gb"), ("b", "2g.35gb"), ("c", "1g.18gb")):
        c = node.allocated(name, req("m", profile(prof)), prepared=done)
        res = d.prepare_claims([c])[c["metadata"]["uid"]]
        assert not res.error, res.error
        done.append(c)
    assert sorted((g["profile"], g["start"], g["size"]) for g in node.sim.instances().values()) == [(5, 0, 4), (14, 4, 2), (19, 6, 1)]
    assert all(len(g["cis"]) == 1 for g in node.sim.instances().values())
    assert d.unprepare_claims([ref(c) for c in done]) == {c["metadata"]["uid"]: None for c in done}
    assert node.sim.instances() == {}


def test_gpu_not_in_mig_mode_fails_the_claim_unless_enabling_is_configured(tmp_path):
    node = MigNode(str(tmp_path / "off"), mig=0)
    d = driver_for(node)
    c = node.allocated("a", req("m", profile("1g.18gb")))
    res = d.prepare_claims([c])[c["metadata"]["uid"]]
    assert res.error and "not in MIG mode" in res.error and "nvidia_mig_enable" in res.error
    assert node.sim.instances() == {} and d.checkpoint.claims == {}
    assert not any(call.startswith("set-mig-mode") for call in node.sim.calls)
    on = MigNode(str(tmp_path / "on"), mig=0, nvidia_mig_enable=True)
    d = driver_for(on)
    res = d.prepare_claims([c])[c["metadata"]["uid"]]
    assert not res.error, res.error
    assert on.sim.nvmlDeviceGetMigMode(on.sim.gpus["0000:00:06.0"]) == [1, 1] and len(on.sim.instances()) == 1


def test_nvml_refusal_fails_the_claim_and_leaves_nothing(node):
    """An instance made by hand at slices 0-3 after the agent started (not the agent's): the
    allocator does not know it, NVML refuses the overlapping placement; the claim's first
    device, created, is destroyed."""
    d = driver_for(node)
    d.recover()
    nv = node.sim
    h = nv.nvmlDeviceGetHandleByPciBusId("0000:00:06.0")
    nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, 5, placement(0, 4))  # 4g.71gb by hand
    c = hand_claim("a", [("m", f"{GPU}-mig-1g-18gb-6"), ("n", f"{GPU}-mig-2g-35gb-2")])
    res = d.prepare_claims([c])[c["metadata"]["uid"]]
    assert res.error and "Insufficient Resources" in res.error and "2g-35gb-2" in res.error
    assert [(g["profile"], g["start"]) for g in nv.instances().values()] == [(5, 0)]  # only the hand-made one
    assert d.checkpoint.claims == {}


def _refuse_destroy(node, monkeypatch) -> None:
    def refuse(h):
        raise NVMLError(999)  # NVML_ERROR_UNKNOWN

    monkeypatch.setattr(node.sim, "nvmlGpuInstanceDestroy", refuse)


def test_an_undo_that_fails_keeps_the_entry_and_its_slices_until_retried(node, monkeypatch):
    """The spec cannot be written (a full disk) and NVML does not destroy the instance made for
    the claim: its PrepareStarted entry stays, in memory and on disk, holding the placement's
    slices; the next start keeps it while NVML still refuses, the kubelet's retry finishes it."""
    d = driver_for(node)
    c = hand_claim("a", [("m", f"{GPU}-mig-2g-35gb-2")])
    uid = c["metadata"]["uid"]

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cdifiles, "write_spec", full)
    _refuse_destroy(node, monkeypatch)
    err = d.prepare_claims([c])[uid].error
    assert "No space left on device" in err and "undoing it failed (retried)" in err and "destroying MIG device" in err
    assert [(g["profile"], g["start"]) for g in node.sim.instances().values()] == [(14, 2)]
    for entries in (d.checkpoint.claims, Checkpoint.load(d.checkpoint_path, move_corrupt=False).claims):
        assert entries[uid]["state"] == "PrepareStarted" and [m["start"] for m in entries[uid]["mig"]] == [2]
    b = hand_claim("b", [("m", f"{GPU}-mig-1g-18gb-3")])
    assert "memory slice 3" in (d.prepare_claims([b])[b["metadata"]["uid"]].error or "")  # still held
    again = driver_for(node)
    assert uid not in again.recover().rolled_back and uid in again.checkpoint.claims  # not undone yet: kept
    assert len(node.sim.instances()) == 1
    monkeypatch.undo()
    assert not d.prepare_claims([c])[uid].error  # the kubelet's retry: undone, then prepared
    assert d.checkpoint.claims[uid]["state"] == "PrepareCompleted" and len(node.sim.instances()) == 1


def test_a_create_whose_rollback_fails_keeps_the_entry(node, monkeypatch):
    """NVML refuses the claim's second placement and then the destroy of its first: the claim's
    entry stays, and its unprepare destroys the first once NVML lets it."""
    d = driver_for(node)
    d.recover()
    h = node.sim.nvmlDeviceGetHandleByPciBusId("0000:00:06.0")
    node.sim.nvmlDeviceCreateGpuInstanceWithPlacement(h, 5, placement(0, 4))  # 4g.71gb by hand
    c = hand_claim("a", [("m", f"{GPU}-mig-1g-18gb-6"), ("n", f"{GPU}-mig-2g-35gb-2")])
    uid = c["metadata"]["uid"]
    _refuse_destroy(node, monkeypatch)
    err = d.prepare_claims([c])[uid].error
    assert "Insufficient Resources" in err and "undoing it failed (retried)" in err
    assert sorted(g["start"] for g in node.sim.instances().values()) == [0, 6]
    assert Checkpoint.load(d.checkpoint_path, move_corrupt=False).claims[uid]["state"] == "PrepareStarted"
    assert d.unprepare_claims([ref(c)])[uid]  # still refused: an error, the entry kept
    monkeypatch.undo()
    assert d.unprepare_claims([ref(c)]) == {uid: None}
    assert [g["start"] for g in node.sim.instances().values()] == [0] and uid not in d.checkpoint.claims


def test_overlapping_placements_of_two_claims_refused_before_nvml(node):
    d = driver_for(node)
    a = hand_claim("a", [("m", f"{GPU}-mig-2g-35gb-2")])
    assert not d.prepare_claims([a])[a["metadata"]["uid"]].error
    b = hand_claim("b", [("m", f"{GPU}-mig-1g-18gb-3")])
    err = d.prepare_claims([b])[b["metadata"]["uid"]].error
    assert err and "memory slice 3" in err
    assert len(node.sim.instances()) == 1
    w = hand_claim("w", [("w", GPU)])  # the whole GPU beside a MIG device
    assert "partition" in (d.prepare_claims([w])[w["metadata"]["uid"]].error or "")


def test_start_up_destroys_mig_devices_no_checkpoint_knows(node):
    d = driver_for(node)
    c = node.allocated("a", req("m", profile("1g.35gb")))
    assert not d.prepare_claims([c])[c["metadata"]["uid"]].error
    nv = node.sim
    h = nv.nvmlDeviceGetHandleByPciBusId("0000:00:06.0")
    taken = {g["start"] for g in nv.instances().values()}
    stray = next(s for s in (0, 2, 4, 6) if s not in taken)
    gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, 15, placement(stray, 2))
    nv.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    assert len(nv.instances()) == 2
    again = driver_for(node)
    report = again.recover()
    assert [g["start"] for g in nv.instances().values()] == sorted(taken)
    assert any("no claim knows, destroyed" in line for line in report.host_restored)
    assert list(again.checkpoint.claims) == [c["metadata"]["uid"]]


def test_instances_made_again_after_a_reboot(node):
    """GPU instances do not survive a reboot: the claim's is made again, under another GI ID
    (the spec's cap nodes follow), after a stray one made at boot is destroyed (it could
    stand where the claim's placement is)."""
    d = driver_for(node)
    z = node.allocated("z", req("m", profile("1g.18gb")))
    assert not d.prepare_claims([z])[z["metadata"]["uid"]].error  # takes GI ID 1: the claim's is another
    c = node.allocated("a", req("m", profile("2g.35gb")), prepared=[z])
    assert not d.prepare_claims([c])[c["metadata"]["uid"]].error
    assert d.unprepare_claims([ref(z)]) == {z["metadata"]["uid"]: None}
    (dev,) = spec_of(d, c)
    start = int(dev.rsplit("-", 1)[1])
    nv = node.sim
    (before,) = nv.instances()
    nv.reboot()
    h = nv.nvmlDeviceGetHandleByPciBusId("0000:00:06.0")
    nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, placement(start, 1))  # made at boot, over the claim's placement
    again = driver_for(node)
    again.boot_id = "another-boot"
    again.recover()
    (gid, g), = nv.instances().items()  # the claim's, made again; the stray one destroyed
    assert (g["profile"], g["start"], list(g["cis"])) == (14, start, ["0"]) and gid != before
    caps = [n for n in spec_of(again, c)[dev] if n[0].startswith("/dev/nvidia-caps/")]
    assert caps == [(f"/dev/nvidia-caps/nvidia-cap{m}", 241, m) for m in (mig_minor(0, int(gid)), mig_minor(0, int(gid), 0))]


def test_a_claim_adopted_after_a_corrupt_checkpoint_keeps_its_mig_device(node):
    """Its record lost with the checkpoint, its spec kept (a container uses the MIG device): the
    placement tells the record again, so the start-up sweep spares the instance, an overlapping
    claim is refused and the claim's unprepare destroys it."""
    d = driver_for(node)
    a = hand_claim("a", [("m", f"{GPU}-mig-2g-35gb-2")])
    assert not d.prepare_claims([a])[a["metadata"]["uid"]].error
    with open(d.checkpoint_path, "wb") as f:
        f.write(b"{not json")
    again = driver_for(node)
    report = again.recover()
    uid = a["metadata"]["uid"]
    assert report.adopted == [uid] and [(g["profile"], g["start"]) for g in node.sim.instances().values()] == [(14, 2)]
    assert again.checkpoint.claims[uid]["mig"] == [{"gpu": "0000:00:06.0", "device": f"{GPU}-mig-2g-35gb-2", "profile": 14,
                                                    "start": 2, "size": 2, "gi": None, "ci": None}]  # fmt: skip
    b = hand_claim("b", [("m", f"{GPU}-mig-1g-18gb-3")])
    assert "memory slice 3" in (again.prepare_claims([b])[b["metadata"]["uid"]].error or "")
    assert again.unprepare_claims([ClaimRef(namespace="", name="", uid=uid)]) == {uid: None}
    assert node.sim.instances() == {}
def test_a_failed_create_whose_own_destroy_fails_keeps_the_entry(node, monkeypatch):
    """NVML makes the GPU instance, refuses its compute instance, then refuses to destroy the GPU
    instance: the host is not as before, so (the step protocol) the claim keeps its PrepareStarted
    entry holding the placement, and its retried undo destroys the instance once NVML lets it."""
    d = driver_for(node)
    d.recover()
    c = hand_claim("a", [("m", f"{GPU}-mig-2g-35gb-2")])
    uid = c["metadata"]["uid"]

    def no_ci(h, profile):
        raise NVMLError(999)  # NVML_ERROR_UNKNOWN

    monkeypatch.setattr(node.sim, "nvmlGpuInstanceCreateComputeInstance", no_ci)
    _refuse_destroy(node, monkeypatch)
    err = d.prepare_claims([c])[uid].error
    assert [(g["profile"], g["start"]) for g in node.sim.instances().values()] == [(14, 2)]  # left by the claim
    assert err and "undoing it failed (retried)" in err
    assert Checkpoint.load(d.checkpoint_path, move_corrupt=False).claims[uid]["state"] == "PrepareStarted"
    monkeypatch.undo()
    assert d.unprepare_claims([ref(c)]) == {uid: None}
    assert node.sim.instances() == {} and uid not in d.checkpoint.claims


def _admin(name: str, device: str) -> dict:
    c = hand_claim(name, [("m", device)])
    c["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    return c


def test_admin_access_to_a_prepared_mig_device_is_not_refused(node):
    """Admin access (docs/kubelet-plugin.md): prepared beside whoever holds the device, partitions
    included, and nobody is refused because of it. The admin claim gets the instance the other
    claim made (its caps nodes); it is neither made a second time nor destroyed when the admin
    claim goes."""
    d = driver_for(node)
    dev = f"{GPU}-mig-2g-35gb-2"
    a = hand_claim("a", [("m", dev)])
    assert not d.prepare_claims([a])[a["metadata"]["uid"]].error
    adm = _admin("adm", dev)
    err = d.prepare_claims([adm])[adm["metadata"]["uid"]].error
    assert not err, err
    ((gi, _),) = node.sim.instances().items()
    caps = [n for n in spec_of(d, adm)[dev] if n[0].startswith("/dev/nvidia-caps/")]
    assert caps == [(f"/dev/nvidia-caps/nvidia-cap{m}", 241, m) for m in (mig_minor(0, int(gi)), mig_minor(0, int(gi), 0))]
    assert caps == [n for n in spec_of(d, a)[dev] if n[0].startswith("/dev/nvidia-caps/")]
    assert d.unprepare_claims([ref(adm)]) == {adm["metadata"]["uid"]: None}
    assert [(g["profile"], g["start"]) for g in node.sim.instances().values()] == [(14, 2)]  # still a's
    assert d.unprepare_claims([ref(a)]) == {a["metadata"]["uid"]: None}
    assert node.sim.instances() == {}


def test_admin_access_to_a_mig_device_no_claim_made_is_refused_and_makes_none(node):
    """Admin access makes no instance (the allocator counts no memory slices for it: an instance
    made for it would stand in the way of the claim the placement is allocated to next)."""
    d = driver_for(node)
    dev = f"{GPU}-mig-2g-35gb-2"
    adm = _admin("adm", dev)
    err = d.prepare_claims([adm])[adm["metadata"]["uid"]].error
    assert err and "no MIG instance is at its placement" in err
    assert node.sim.instances() == {} and d.checkpoint.claims == {}
    a = hand_claim("a", [("m", dev)])
    assert not d.prepare_claims([a])[a["metadata"]["uid"]].error


def test_two_adopted_claims_of_one_instance_destroy_it_with_the_last(node):
    """A corrupt checkpoint: a claim and an admin claim of one MIG device are both adopted from
    their specs, and both record its placement (adoption cannot tell admin access). The first
    to go leaves the instance to the other."""
    d = driver_for(node)
    dev = f"{GPU}-mig-2g-35gb-2"
    a, adm = hand_claim("a", [("m", dev)]), _admin("adm", dev)
    assert not d.prepare_claims([a])[a["metadata"]["uid"]].error
    assert not d.prepare_claims([adm])[adm["metadata"]["uid"]].error
    with open(d.checkpoint_path, "w") as f:
        f.write("{not json")
    again = driver_for(node)
    report = again.recover()
    assert sorted(report.adopted) == sorted(c["metadata"]["uid"] for c in (a, adm))
    assert again.unprepare_claims([ref(a)]) == {a["metadata"]["uid"]: None}
    assert [(g["profile"], g["start"]) for g in node.sim.instances().values()] == [(14, 2)]
    assert again.unprepare_claims([ref(adm)]) == {adm["metadata"]["uid"]: None}
    assert node.sim.instances() == {}


def test_a_gpu_nvml_refuses_does_not_keep_the_others_leftovers(node):
    """The start-up sweep goes GPU by GPU: one NVML answers with an error for (gone, or in a bad
    state) is logged, and the next GPU's leftovers are destroyed still."""
    d = driver_for(node)
    nv = node.sim
    nv.nvmlDeviceCreateGpuInstanceWithPlacement(nv.nvmlDeviceGetHandleByPciBusId("0000:00:06.0"), 5, placement(0, 4))
    profiles = tuple(p.id for p in node.inventory().by_name()[GPU].gpu.partitioning.profiles)
    done = d.mig.orphans({"0000:ff:00.0": profiles, "0000:00:06.0": profiles}, set())
    assert len(done) == 1 and "0000:00:06.0" in done[0] and nv.instances() == {}
