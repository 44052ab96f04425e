"""A setting changed at a restart while claims are prepared: what the agent does with the claims
prepared under the setting of before (docs/operations.md). ``cdi_dir``: their specs are written in
the new dir and the files in the dir of before go (before, they stayed there for good, also after
the claim's unprepare: the runtime kept resolving the gone claim's devices from them). ``kubelet_dir``
with MPS shares running: their daemon stays in charge where it runs."""

from __future__ import annotations

import os

import psutil

from agent.kubeletplugin.types import ClaimRef
from agent.prepare.driver import Driver
from discovery.inventory import scan
from tests.conftest import profile_root
from tests.kubelet_standin import claim, settings_for
from tests.test_mig_prepare import ref
from tests.test_mps_prepare import PROFILE, _allocated, _driver, _running, memory_claim, one_gpu, published, share_plan

NIC = "nic-0000-3c-00-0"


def started(s) -> Driver:
    inv = scan(s.root)
    d = Driver(s, lambda: inv)
    d.recover()
    return d


def test_a_changed_cdi_dir_takes_the_prepared_claims_files_along(tmp_path):
    s = settings_for(str(tmp_path), root=profile_root("server-2s-gpu-nic"))
    c = claim("nic", [("net1", NIC)])
    uid = c["metadata"]["uid"]
    assert started(s).prepare_claims([c])[uid].error is None
    files = sorted(os.listdir(s.cdi_dir))
    assert len(files) == 2  # the claim's spec and its metadata's
    moved = s.replace(cdi_dir=str(tmp_path / "cdi-moved"))
    d = started(moved)
    assert sorted(os.listdir(moved.cdi_dir)) == files and os.listdir(s.cdi_dir) == []
    assert d.prepare_claims([c])[uid].error is None
    assert d.unprepare_claims([ClaimRef("default", "nic", uid)]) == {uid: None}
    assert os.listdir(moved.cdi_dir) == [] and os.listdir(s.cdi_dir) == []


def test_a_recorded_spec_path_of_another_name_is_left(tmp_path, caplog):
    """The checkpoint is input: a recorded path that is not the claim's spec name is never removed."""
    s = settings_for(str(tmp_path), root=profile_root("server-2s-gpu-nic"))
    c = claim("nic", [("net1", NIC)])
    uid = c["metadata"]["uid"]
    d = started(s)
    assert d.prepare_claims([c])[uid].error is None
    other = tmp_path / "elsewhere" / "k8s.sysdra.io-claim_11111111-2222-4333-8444-555555555555.json"
    other.parent.mkdir()
    other.write_text("{}")
    d.checkpoint.claims[uid]["cdiSpec"]["path"] = str(other)
    d.checkpoint.save()
    started(s)
    assert other.exists() and "not our file" in caplog.text


def test_kubelet_dir_changed_while_mps_shares_run_keeps_their_daemon_in_charge(tmp_path):
    """The shares' containers are clients of the daemon under the plugin dir of before (their spec
    mounts its pipe): the agent keeps its MPS daemons there while those claims are adopted, so a new
    share of the GPU is a client of the same daemon and the last share's unprepare stops it. Before,
    a second daemon was started for the GPU under the new dir beside it, and the first one ran on
    for good, neither supervised nor stopped."""
    slices, _ = one_gpu(published(PROFILE, share=share_plan(("gpu",), None)))
    a, b = _allocated(slices, memory_claim("a", "8Gi"), memory_claim("b", "8Gi"))
    first = _driver(tmp_path)
    assert first.prepare_claims([a])[a["metadata"]["uid"]].error is None
    (pid,) = _running(first).values()
    try:
        d = _driver(tmp_path, kubelet_dir=str(tmp_path / "moved"))
        assert d.recover().adopted == [a["metadata"]["uid"]] and list(_running(d).values()) == [pid]
        assert d.prepare_claims([a])[a["metadata"]["uid"]].error is None
        assert d.prepare_claims([b])[b["metadata"]["uid"]].error is None and list(_running(d).values()) == [pid]
        assert d.unprepare_claims([ref(a)]) == {a["metadata"]["uid"]: None} and list(_running(d).values()) == [pid]
        assert d.unprepare_claims([ref(b)]) == {b["metadata"]["uid"]: None}
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        if psutil.pid_exists(pid):
            psutil.Process(pid).kill()
