"""MPS as a prepare step (agent/prepare/steps/mps.py): with --share gpu, the shares of an NVIDIA GPU
are clients of one MPS control daemon per GPU (the fixture node's simulated
nvidia-cuda-mps-control): started with the first share, kept while any share holds the GPU,
stopped with the last, found again after the agent restarts; a share's CDI device mounts the
daemon's pipe directory at /tmp/nvidia-mps."""

from __future__ import annotations

import copy
import os

import psutil

from agent.prepare import driver as driver_mod
from agent.prepare.driver import Driver
from agent.publish.sharing import share_plan
from discovery.inventory import scan
from tests.conftest import profile_root
from tests.kubelet_standin import settings_for
from tests.test_allocator import NODE, published
from tests.test_sharing_allocator import devices, kind, one_gpu
from tests.test_sharing_prepare import _allocated, memory_claim

PROFILE = "server-2s-gpu-nic"


def _driver(tmp_path, **kw) -> Driver:
    s = settings_for(str(tmp_path), root=profile_root(PROFILE), node_name=NODE, share=("gpu",), **kw)
    inv = scan(profile_root(PROFILE))
    return Driver(s, lambda: inv)


def _running(d: Driver) -> dict[str, int]:
    return {u: r.pid for u, r in d.nvidia.mps.state.daemons.items() if d.nvidia.mps.alive(r)}


def test_shares_of_a_gpu_run_under_its_mps_daemon(tmp_path):
    slices, gpu = one_gpu(published(PROFILE, share=share_plan(("gpu",), None)))
    a, b = _allocated(slices, memory_claim("a", "8Gi"), memory_claim("b", "8Gi"))
    d = _driver(tmp_path)
    uuid = scan(profile_root(PROFILE)).by_name()[gpu].gpu.nvidia_uuid
    assert all(r.error is None for r in d.prepare_claims([a]).values())
    (pid,) = _running(d).values()
    assert list(_running(d)) == [uuid]
    spec = d.checkpoint.claims[a["metadata"]["uid"]]["cdiSpec"]["spec"]
    edits = spec["devices"][0]["containerEdits"]
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in edits["env"]
    assert edits["mounts"] == [{"hostPath": d.nvidia.mps.dirs(uuid)["pipe"], "containerPath": "/tmp/nvidia-mps",
                                "options": ["rw", "nosuid", "nodev", "bind"]},
                               {"hostPath": d.nvidia.mps.dirs(uuid)["shm"], "containerPath": "/dev/shm",
                                "options": ["rw", "nosuid", "nodev", "bind"]}]
    assert d.checkpoint.claims[a["metadata"]["uid"]]["mps"] == {"gpus": [uuid]}
    d.prepare_claims([b])
    assert _running(d) == {uuid: pid}  # one daemon per GPU
    restarted = _driver(tmp_path)  # the agent restarts: recovery finds the daemon again
    restarted.recover()
    assert _running(restarted) == {uuid: pid}
    restarted.unprepare_claims([_ref(a)])
    assert _running(restarted) == {uuid: pid}  # b still holds a share
    restarted.unprepare_claims([_ref(b)])
    assert _running(restarted) == {}
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_daemon_that_died_is_started_again_by_recovery(tmp_path):
    slices, _ = one_gpu(published(PROFILE, share=share_plan(("gpu",), None)))
    (a,) = _allocated(slices, memory_claim("a", "8Gi"))
    d = _driver(tmp_path)
    d.prepare_claims([a])
    (pid,) = _running(d).values()
    psutil.Process(pid).kill()
    psutil.Process(pid).wait(5)
    restarted = _driver(tmp_path)
    restarted.recover()
    (new,) = _running(restarted).values()
    assert new != pid


def test_a_daemon_that_cannot_start_again_fails_the_re_prepare(tmp_path, monkeypatch):
    """The GPU's daemon is gone (a reboot, or it died) and cannot be started when the kubelet
    re-prepares the share for the pod it restarts: that pod would run as the client of no daemon,
    its memory and compute limits not enforced, while the claim's record says they are. The
    re-prepare fails saying why; the kubelet's retry that can start the daemon succeeds."""
    slices, _ = one_gpu(published(PROFILE, share=share_plan(("gpu",), None)))
    (a,) = _allocated(slices, memory_claim("a", "8Gi"))
    uid = a["metadata"]["uid"]
    d = _driver(tmp_path)
    assert d.prepare_claims([a])[uid].error is None
    ((uuid, pid),) = _running(d).items()
    psutil.Process(pid).kill()
    psutil.Process(pid).wait(5)
    monkeypatch.setattr("agent.prepare.mps_process.ProcessLauncher.start_timeout", 0.3)  # starts that fail, fail fast
    monkeypatch.setenv("FAKE_MPS_NO_PIPE", "1")  # every start fails
    err = d.prepare_claims([a])[uid].error
    assert err and uuid in err, err
    assert _running(d) == {} and d.checkpoint.claims[uid]["state"] == "PrepareCompleted"
    monkeypatch.delenv("FAKE_MPS_NO_PIPE")
    assert d.prepare_claims([a])[uid].error is None
    assert list(_running(d)) == [uuid]


def test_without_mps_shares_are_accounted_only(tmp_path):
    slices, _ = one_gpu(published(PROFILE, share=share_plan(("gpu",), None)))
    (a,) = _allocated(slices, memory_claim("a", "8Gi"))
    d = _driver(tmp_path, nvidia_mps=False)
    assert d.prepare_claims([a])[a["metadata"]["uid"]].error is None
    assert d.nvidia.mps is None and "mps" not in d.checkpoint.claims[a["metadata"]["uid"]]
    assert not os.path.exists(os.path.join(str(tmp_path), "kubelet", "plugins", "sysdra.io", "mps"))


def _ref(c: dict):
    from agent.kubeletplugin.types import ClaimRef

    m = c["metadata"]
    return ClaimRef(m["namespace"], m["name"], m["uid"])


def test_a_daemon_no_claim_needs_is_stopped_at_start(tmp_path):
    """The last share went while the agent was away (here: its entry is gone from the
    checkpoint): the next start stops the orphaned daemon and removes its directories."""
    slices, _ = one_gpu(published(PROFILE, share=share_plan(("gpu",), None)))
    (a,) = _allocated(slices, memory_claim("a", "8Gi"))
    d = _driver(tmp_path)
    d.prepare_claims([a])
    ((uuid, pid),) = _running(d).items()
    del d.checkpoint.claims[a["metadata"]["uid"]]
    d.checkpoint.save()
    restarted = _driver(tmp_path)
    restarted.recover()
    assert _running(restarted) == {} and restarted.nvidia.mps.state.daemons == {}
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not os.path.exists(os.path.dirname(restarted.nvidia.mps.dirs(uuid)["pipe"]))


def test_mps_shares_of_two_gpus_in_one_claim_are_refused(tmp_path):
    """A CUDA process is a client of one MPS daemon (one /tmp/nvidia-mps) under one set of limits:
    a container given both shares would keep one GPU's pipe and limits. The claim is refused
    before any daemon starts; with mpsLimits off and no daemons there is nothing to conflict."""
    from tests.test_allocator import claim, exactly

    slices = published(PROFILE, share=share_plan(("gpu",), None))
    two = claim("two", exactly("a", "gpu-share.sysdra.io", capacity={"requests": {"memory": "8Gi"}}),
                exactly("b", "gpu-share.sysdra.io", capacity={"requests": {"memory": "8Gi"}}))
    two["spec"]["devices"]["constraints"] = [{"distinctAttribute": "resource.kubernetes.io/pciBusID"}]
    (c,) = _allocated(slices, two)
    gpus = [r["device"] for r in c["status"]["allocation"]["devices"]["results"]]
    assert len(set(gpus)) == 2
    d = _driver(tmp_path)
    (res,) = d.prepare_claims([c]).values()
    assert res.error is not None and "MPS shares of 2 GPUs" in res.error and all(g in res.error for g in gpus)
    assert _running(d) == {} and c["metadata"]["uid"] not in d.checkpoint.claims
    c["status"]["allocation"]["devices"]["config"] = [{"source": "FromClaim", "opaque": {"driver": "sysdra.io", "parameters": {
        "apiVersion": "sysdra.io/v1alpha1", "kind": "GpuConfig", "sharing": {"mpsLimits": False}}}}]
    (res,) = _driver(tmp_path / "off", nvidia_mps=False).prepare_claims([c]).values()
    assert res.error is None, res.error


def test_shares_unprepared_together_stop_their_daemon(tmp_path):
    """The last shares of a GPU unprepared in one call (a pod's claims): its daemon stops, as
    when they go one call each."""
    slices, _ = one_gpu(published(PROFILE, share=share_plan(("gpu",), None)))
    a, b = _allocated(slices, memory_claim("a", "8Gi"), memory_claim("b", "8Gi"))
    d = _driver(tmp_path)
    assert all(r.error is None for r in d.prepare_claims([a, b]).values())
    (pid,) = _running(d).values()
    assert d.unprepare_claims([_ref(a), _ref(b)]) == {a["metadata"]["uid"]: None, b["metadata"]["uid"]: None}
    assert d.checkpoint.claims == {}
    assert _running(d) == {}
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def _on_gpu(gpu_index: int, claim: dict, uid: str) -> dict:
    slices = published(PROFILE, share=share_plan(("gpu",), None))
    gpu = [n for n, d in devices(slices).items() if kind(d) == "gpu"][gpu_index]
    for s in slices:
        s["spec"]["devices"] = [d for d in s["spec"].get("devices", []) if kind(d) != "gpu" or d["name"] == gpu]
    (c,) = _allocated(slices, copy.deepcopy(claim))
    c["metadata"]["uid"] = uid
    return c


def test_a_claim_that_failed_in_the_same_call_gets_no_daemon(tmp_path, monkeypatch):
    """Claims a (GPU 0) and b (GPU 1) prepared in one call; a fails after its daemon started (its
    device metadata cannot be written): a's daemon is stopped and a leaves the checkpoint. b's
    prepare must not start a's GPU's daemon again: nothing holds that GPU."""
    a = _on_gpu(0, memory_claim("a", "8Gi"), "00000000-0000-4000-8000-00000000000a")
    b = _on_gpu(1, memory_claim("b", "8Gi"), "00000000-0000-4000-8000-00000000000b")
    d = _driver(tmp_path)
    write = driver_mod.metadata.write_claim

    def failing(settings, uid, entry):
        if uid == a["metadata"]["uid"]:
            raise OSError("disk full (the test's)")
        return write(settings, uid, entry)

    monkeypatch.setattr(driver_mod.metadata, "write_claim", failing)
    out = d.prepare_claims([a, b])
    assert out[a["metadata"]["uid"]].error is not None and out[b["metadata"]["uid"]].error is None
    assert set(d.checkpoint.claims) == {b["metadata"]["uid"]}
    (gpu_b,) = d.checkpoint.claims[b["metadata"]["uid"]]["mps"]["gpus"]
    assert set(_running(d)) == {gpu_b}, "a daemon runs for a GPU whose only claim failed"
    assert d.nvidia.mps.wanted == {gpu_b}


def test_an_adopted_claims_shares_keep_their_daemon(tmp_path):
    """The checkpoint damaged: the claim is adopted from its spec, whose shares mount the GPU's
    daemon pipe. Before, the adopted entry named no daemon: the start stopped the one serving the
    running containers (its pipe and tmpfs removed under them), and the kubelet's re-prepare of the
    adopted claim started none. Its unprepare stops it."""
    slices, _ = one_gpu(published(PROFILE, share=share_plan(("gpu",), None)))
    (a,) = _allocated(slices, memory_claim("a", "8Gi"))
    d = _driver(tmp_path)
    assert all(r.error is None for r in d.prepare_claims([a]).values())
    running = _running(d)
    with open(d.checkpoint_path, "w") as f:
        f.write("garbage")
    restarted = _driver(tmp_path)
    assert restarted.recover().adopted == [a["metadata"]["uid"]]
    assert _running(restarted) == running
    assert restarted.prepare_claims([a])[a["metadata"]["uid"]].error is None and _running(restarted) == running
    assert restarted.unprepare_claims([_ref(a)]) == {a["metadata"]["uid"]: None} and _running(restarted) == {}


def test_the_plugin_dir_wiped_under_running_shares_keeps_their_daemon(tmp_path):
    """The plugin dir wiped while shares run (their checkpoint, the daemon records and the pipe dirs
    gone with it; the running containers keep the pipe they mount): the daemon serving them is not a
    stray to stop; the adopted claim keeps it and its unprepare stops it."""
    import shutil

    slices, _ = one_gpu(published(PROFILE, share=share_plan(("gpu",), None)))
    (a,) = _allocated(slices, memory_claim("a", "8Gi"))
    d = _driver(tmp_path)
    assert all(r.error is None for r in d.prepare_claims([a]).values())
    running = _running(d)
    shutil.rmtree(d.settings.plugin_dir, ignore_errors=True)  # as rm -rf: the tmpfs mounts (busy) and their dirs stay
    restarted = _driver(tmp_path)
    assert restarted.recover().adopted == [a["metadata"]["uid"]]
    assert _running(restarted) == running
    assert restarted.prepare_claims([a])[a["metadata"]["uid"]].error is None and _running(restarted) == running
    assert restarted.unprepare_claims([_ref(a)]) == {a["metadata"]["uid"]: None} and _running(restarted) == {}
    assert all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in running.values())
