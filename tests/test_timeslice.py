"""NVIDIA time-slicing as a prepare step (agent/prepare/steps/timeslice.py) on a simulated
nvidia-smi (it logs its arguments; a marker file makes it fail): set at prepare from the claim's
GpuConfig, set back to Default at unprepare and after a failure (the claim's entry kept while it
cannot be), set again at start, refused for shares; never run unless a claim asks."""

from __future__ import annotations

import errno
import os
import shutil
import sys

import pytest

from agent.kubeletplugin.types import ClaimRef
from agent.prepare import cdifiles
from agent.prepare.checkpoint import Checkpoint
from agent.prepare.driver import Driver
from discovery.inventory import scan
from tests.conftest import profile_root
from tests.kubelet_standin import settings_for

GPU, GPU2 = "gpu-0000-18-00-0", "gpu-0000-19-00-0"
UID = "00000000-0000-4000-8000-00000000000a"
FAKE_SMI = """import os, sys
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "smi.log"), "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
fail = ("fail-" + sys.argv[-1], "fail-" + sys.argv[-3] + "-" + sys.argv[-1])  # any GPU, or this one
sys.exit(3 if any(os.path.exists(os.path.join(here, f)) for f in fail) else 0)
"""


def node(tmp_path) -> str:
    root = str(tmp_path / "node")
    shutil.copytree(profile_root("server-2s-gpu-nic"), root, symlinks=True)
    smi = os.path.join(root, "usr/bin/nvidia-smi")
    with open(smi, "w") as f:
        f.write(f"#!{sys.executable}\n" + FAKE_SMI)
    os.chmod(smi, 0o755)
    return root


def calls(root: str) -> list[str]:
    try:
        with open(os.path.join(root, "usr/bin/smi.log")) as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


def claim(devices: list[str], interval: str | None = "Long", share: bool = False) -> dict:
    sharing = {"strategy": "TimeSlicing", **({"timeSlicingConfig": {"interval": interval}} if interval else {})}
    results = [{"request": "gpu", "driver": "sysdra.io", "pool": "node-a", "device": d,
                **({"shareID": "11111111-2222-4333-8444-555555555555", "consumedCapacity": {"compute": "10"}} if share else {})}
               for d in devices]
    return {"metadata": {"namespace": "ns", "name": "ts", "uid": UID},
            "status": {"allocation": {"devices": {"results": results, "config": [
                {"source": "FromClaim", "requests": [], "opaque": {"driver": "sysdra.io", "parameters": {
                    "apiVersion": "sysdra.io/v1alpha1", "kind": "GpuConfig", "sharing": sharing}}}]}}}}


def driver(tmp_path, root: str, **kw) -> Driver:
    inv = scan(root)
    return Driver(settings_for(str(tmp_path / "agent"), root=root, node_name="node-a", **kw), lambda: inv)


def uuid(root: str, name: str) -> str:
    return scan(root).by_name()[name].gpu.nvidia_uuid


def test_set_at_prepare_and_back_at_unprepare(tmp_path):
    root = node(tmp_path)
    d = driver(tmp_path, root)
    res = d.prepare_claims([claim([GPU, GPU2])])[UID]
    assert res.error is None, res.error
    a, b = uuid(root, GPU), uuid(root, GPU2)
    assert calls(root) == [f"compute-policy -i {a} --set-timeslice 3", f"compute-policy -i {b} --set-timeslice 3"]
    assert d.checkpoint.claims[UID]["timeslice"] == [{"gpu": a, "interval": "Long"}, {"gpu": b, "interval": "Long"}]
    driver(tmp_path, root).recover()  # after a reboot the driver forgot it: set again at start
    assert calls(root)[2:] == calls(root)[:2]
    d.unprepare_claims([ClaimRef("ns", "ts", UID)])
    assert calls(root)[4:] == [f"compute-policy -i {a} --set-timeslice 0", f"compute-policy -i {b} --set-timeslice 0"]


def test_a_failure_sets_the_changed_gpus_back_and_fails_the_claim(tmp_path):
    root = node(tmp_path)
    open(os.path.join(root, "usr/bin", "fail-3"), "w").close()  # every --set-timeslice 3 fails
    res = driver(tmp_path, root).prepare_claims([claim([GPU])])[UID]
    assert "nvidia-smi compute-policy --set-timeslice 3 failed" in res.error
    assert calls(root) == [f"compute-policy -i {uuid(root, GPU)} --set-timeslice 3"]  # nothing changed, nothing to undo


def test_nvidia_smi_that_cannot_be_run_for_the_second_gpu_sets_the_first_back(tmp_path, monkeypatch):
    """Running nvidia-smi needs its libraries linked (``link_libraries`` under a DaemonSet's /host):
    that failing halfway is the claim's error, and the GPU already set goes back to Default."""
    root = node(tmp_path)
    d = driver(tmp_path, root)
    tool, asked = d.nvidia.tool, []

    def once_then_broken(name):
        asked.append(name)
        if len(asked) == 2:
            raise OSError(errno.EROFS, "Read-only file system")
        return tool(name)

    monkeypatch.setattr(d.nvidia, "tool", once_then_broken)
    err = d.prepare_claims([claim([GPU, GPU2])])[UID].error
    assert "nvidia-smi cannot be run" in err and "undoing it failed" not in err
    assert calls(root) == [f"compute-policy -i {uuid(root, GPU)} --set-timeslice 3", f"compute-policy -i {uuid(root, GPU)} --set-timeslice 0"]
    assert UID not in d.checkpoint.claims


def _mark(root: str, name: str, on: bool = True) -> None:
    path = os.path.join(root, "usr/bin", name)
    open(path, "w").close() if on else os.remove(path)


@pytest.mark.parametrize("where", ["the second GPU's slice", "the spec"])
def test_a_slice_not_set_back_keeps_the_entry_until_it_is(tmp_path, monkeypatch, where):
    """The prepare fails (the second GPU refuses its slice, or the spec cannot be written) and
    the first GPU cannot be set back to Default: the claim's PrepareStarted entry stays, holding
    its GPUs, so the next claim on them does not inherit Long; the next start and the kubelet's
    retry set it back."""
    root = node(tmp_path)
    a, b = uuid(root, GPU), uuid(root, GPU2)
    if where == "the spec":
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(cdifiles, "write_spec", full)
    else:
        _mark(root, f"fail-{b}-3")
    _mark(root, "fail-0")
    d = driver(tmp_path, root)
    err = d.prepare_claims([claim([GPU, GPU2])])[UID].error
    assert f"GPU {a}: nvidia-smi compute-policy --set-timeslice 0 failed" in err and "undoing it failed (retried)" in err
    for entries in (d.checkpoint.claims, Checkpoint.load(d.checkpoint_path, move_corrupt=False).claims):
        assert entries[UID]["state"] == "PrepareStarted" and entries[UID]["timeslice"][0] == {"gpu": a, "interval": "Long"}
    other = claim([GPU])
    other["metadata"]["uid"] = "00000000-0000-4000-8000-00000000000b"
    assert "ns/ts" in d.prepare_claims([other])[other["metadata"]["uid"]].error  # the GPU is still the claim's
    again = driver(tmp_path, root)
    assert again.recover().rolled_back == [] and UID in again.checkpoint.claims  # retried at start, kept
    _mark(root, "fail-0", False)
    monkeypatch.undo()
    assert d.unprepare_claims([ClaimRef("ns", "ts", UID)]) == {UID: None}
    assert calls(root)[-2:] == [f"compute-policy -i {a} --set-timeslice 0", f"compute-policy -i {b} --set-timeslice 0"]
    assert UID not in Checkpoint.load(d.checkpoint_path, move_corrupt=False).claims


def test_default_interval_and_refusals(tmp_path):
    root = node(tmp_path)
    res = driver(tmp_path, root).prepare_claims([claim([GPU], interval=None)])[UID]
    assert res.error is None and calls(root) == [f"compute-policy -i {uuid(root, GPU)} --set-timeslice 0"]
    res = driver(tmp_path / "b", root, share=("gpu",)).prepare_claims([claim([GPU], share=True)])[UID]
    assert "time-slicing is for whole NVIDIA GPUs" in res.error
    admin = claim([GPU])
    admin["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    res = driver(tmp_path / "c", root).prepare_claims([admin])[UID]
    assert "not for one with admin access" in res.error and len(calls(root)) == 1


def test_nothing_runs_unless_a_claim_asks(tmp_path):
    root = node(tmp_path)
    c = claim([GPU])
    del c["status"]["allocation"]["devices"]["config"]
    assert driver(tmp_path, root).prepare_claims([c])[UID].error is None
    assert calls(root) == []


def test_an_adopted_claims_time_slice_goes_back_at_its_unprepare(tmp_path):
    """The checkpoint lost (the plugin dir wiped): the claim is adopted from its spec and the
    kubelet prepares it again; its entry is filled in with the time slice it set, so its unprepare
    sets Default again (filled in without, the GPU kept the claim's slice for the claims after it)."""
    root = node(tmp_path)
    d = driver(tmp_path, root)
    assert d.prepare_claims([claim([GPU])])[UID].error is None
    for name in os.listdir(d.settings.plugin_dir):
        if name.startswith("checkpoint.json"):
            os.unlink(os.path.join(d.settings.plugin_dir, name))
    again = driver(tmp_path, root)
    assert again.recover().adopted == [UID]
    assert again.prepare_claims([claim([GPU])])[UID].error is None
    assert again.unprepare_claims([ClaimRef("ns", "ts", UID)]) == {UID: None}
    assert calls(root)[-1] == f"compute-policy -i {uuid(root, GPU)} --set-timeslice 0"


def test_a_slice_not_set_again_after_a_reboot_fails_the_re_prepare_until_it_is(tmp_path):
    """After a reboot the driver forgot the claim's slice, and nvidia-smi fails at the agent's start
    (the driver not ready yet): the kubelet's re-prepare must not start the pod on the Default slice
    the claim did not ask for while its record says Long; it says why, and the retry that can set it does."""
    root = node(tmp_path)
    assert driver(tmp_path, root).prepare_claims([claim([GPU])])[UID].error is None
    _mark(root, "fail-3")
    d = driver(tmp_path, root)
    d.boot_id = "another-boot"
    d.recover()  # logged: the claim stays prepared, its unprepare sets Default
    assert d.checkpoint.claims[UID]["state"] == "PrepareCompleted"
    err = d.prepare_claims([claim([GPU])])[UID].error  # the kubelet's, for the pod it restarts
    assert err and f"GPU {uuid(root, GPU)}: nvidia-smi compute-policy --set-timeslice 3 failed" in err, err
    _mark(root, "fail-3", False)
    assert d.prepare_claims([claim([GPU])])[UID].error is None
    assert calls(root)[-1] == f"compute-policy -i {uuid(root, GPU)} --set-timeslice 3"
    assert UID in d.checkpoint.claims
