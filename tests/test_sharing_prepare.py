"""Prepare per share (agent/prepare/shares.py) on allocations the scheduler's allocator made
from the agent's --share slices: one response Device and one CDI device per share, the share's
environment, unprepare of one claim leaving the others, checkpoint and recovery after a reboot."""

from __future__ import annotations

import copy
import json
import os

from agent.prepare.driver import Driver
from agent.publish.sharing import share_plan
from discovery.inventory import scan
from tests.conftest import profile_root
from tests.controlplane import allocate, with_allocation
from tests.kubelet_standin import settings_for
from tests.test_allocator import CLASSES, NODE, claim, exactly, published
from tests.test_sharing_allocator import one_gpu

PROFILE = "server-2s-gpu-nic"


def _driver(tmp_path) -> Driver:
    # --share as the slices were published (shares of one device go together); MPS: tests/test_mps_prepare.py
    s = settings_for(str(tmp_path), root=profile_root(PROFILE), node_name=NODE, share=("gpu", "nic"), nvidia_mps=False)
    inv = scan(profile_root(PROFILE))
    return Driver(s, lambda: inv)


def _allocated(slices: list[dict], *claims: dict, before: list[dict] = ()) -> list[dict]:
    done = list(before)
    out = []
    for i, c in enumerate(claims):
        c = copy.deepcopy(c)
        c["metadata"]["uid"] = f"00000000-0000-4000-8000-{i:012d}"
        (a,) = allocate(slices, CLASSES, c, node=NODE, allocated=done)
        done.append(with_allocation(c, a))
        out.append(done[-1])
    return out


def _spec(d: Driver, uid: str) -> dict:
    with open(d._spec_path(uid)) as f:
        return json.load(f)


def _env(spec: dict, cdi_name: str) -> dict[str, str]:
    dev = next(x for x in spec["devices"] if x["name"] == cdi_name)
    return dict(e.split("=", 1) for e in dev["containerEdits"]["env"])


def memory_claim(name: str, memory: str, compute: str | None = None) -> dict:
    req = {"memory": memory, **({"compute": compute} if compute else {})}
    return claim(name, exactly("gpu", "gpu-share.sysdra.io", capacity={"requests": req}))


def test_claims_sharing_one_gpu_each_get_their_own_share(tmp_path):
    slices, gpu = one_gpu(published(PROFILE, share=share_plan(("gpu", "nic"), None)))
    claims = _allocated(slices, *(memory_claim(f"c{i}", "18Gi", compute="25") for i in range(4)))
    d = _driver(tmp_path)
    out = d.prepare_claims(claims)
    ids = set()
    for c in claims:
        uid = c["metadata"]["uid"]
        (r,) = c["status"]["allocation"]["devices"]["results"]
        res = out[uid]
        assert res.error is None, res.error
        (dev,) = [x for x in res.devices if x.device == gpu]
        assert dev.share_id == r["shareID"] and dev.requests == ["gpu"]
        cdi_name = f"{uid}-{gpu}-{r['shareID']}"
        assert dev.cdi_ids[0] == f"k8s.sysdra.io/claim={cdi_name}"
        ids.add(dev.cdi_ids[0])
        env = _env(_spec(d, uid), cdi_name)
        assert env["SYSDRA_SHARE_ID"] == r["shareID"] and env["SYSDRA_SHARE_DEVICE"] == gpu
        assert env["SYSDRA_SHARE_MEMORY"] == "18Gi" and env["SYSDRA_SHARE_MEMORY_VALUE"] == str(18 * 2**30)
        assert env["SYSDRA_SHARE_COMPUTE"] == "25" and env["SYSDRA_DEVICE_GPU_0000_18_00_0_MEMORY"] == "18Gi"
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"  # NVIDIA: MPS client limits
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=18432M"
        rec = d.checkpoint.claims[uid]["devices"][0]
        assert rec["shareID"] == r["shareID"] and "SYSDRA_SHARE_ID=" + r["shareID"] in rec["cdiEnv"]
    assert len(ids) == 4

    # unpreparing one claim leaves every other share's files as they were
    others = {c["metadata"]["uid"]: open(d._spec_path(c["metadata"]["uid"]), "rb").read() for c in claims[1:]}
    from agent.kubeletplugin.types import ClaimRef

    first = claims[0]["metadata"]
    assert d.unprepare_claims([ClaimRef(first["namespace"], first["name"], first["uid"])]) == {first["uid"]: None}
    assert not os.path.exists(d._spec_path(first["uid"]))
    for uid, content in others.items():
        assert open(d._spec_path(uid), "rb").read() == content

    # a reboot: the specs are rebuilt from the checkpoint with every share's environment
    specs = {uid: _spec(d, uid) for uid in others}
    for uid in others:
        os.unlink(d._spec_path(uid))
    again = _driver(tmp_path)
    again.boot_id = "another-boot"
    report = again.recover()
    assert report.boot_changed and sorted(report.rebuilt) == sorted(others)
    for uid, spec in specs.items():
        assert _spec(again, uid) == spec


def test_two_shares_of_one_gpu_in_one_claim(tmp_path):
    slices, gpu = one_gpu(published(PROFILE, share=share_plan(("gpu",), None)))
    two = claim("two", exactly("a", "gpu-share.sysdra.io", capacity={"requests": {"memory": "8Gi"}}),
                exactly("b", "gpu-share.sysdra.io", capacity={"requests": {"memory": "16Gi"}}))
    (c,) = _allocated(slices, two)
    d = _driver(tmp_path)
    uid = c["metadata"]["uid"]
    res = d.prepare_claims([c])[uid]
    assert res.error is None, res.error
    devs = [x for x in res.devices if x.device == gpu]
    assert [x.requests for x in devs] == [["a"], ["b"]] and devs[0].share_id != devs[1].share_id
    assert devs[0].cdi_ids[0] != devs[1].cdi_ids[0]
    spec = _spec(d, uid)
    names = [x["name"] for x in spec["devices"]]
    assert len(names) == len(set(names)) == 2
    assert "SYSDRA_DEVICES=" + gpu in spec["containerEdits"]["env"]  # the device once, however many shares
    # one container may get both: each CDI device carries the claim's shares of the GPU together,
    # so whichever the runtime applies last, MPS enforces the sum (one client process)
    a, b = (_env(spec, n) for n in names)
    assert a == b
    assert a["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={24 * 1024}M" and a["SYSDRA_SHARE_MEMORY"] == str(24 * 2**30)
    assert a["SYSDRA_SHARE_ID"] == a["SYSDRA_DEVICE_GPU_0000_18_00_0_SHARE"] == f"{devs[0].share_id},{devs[1].share_id}"
    assert a["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "20"  # two default compute shares of 10
    # KEP-5304 metadata lists the device for each request
    meta = d.checkpoint.claims[uid]["metadata"]["requests"]
    assert [x["devices"][0]["name"] for r in ("a", "b") for x in meta[r]["requests"]] == [gpu, gpu]
    # one share with MPS limits and one without would give the container either
    c["status"]["allocation"]["devices"]["config"] = [{"source": "FromClaim", "requests": ["a"], "opaque": {
        "driver": "sysdra.io", "parameters": {"apiVersion": "sysdra.io/v1alpha1", "kind": "GpuConfig",
                                              "sharing": {"mpsLimits": False}}}}]
    res = _driver(tmp_path / "mixed").prepare_claims([c])[uid]
    assert "differ in sharing.mpsLimits" in res.error


def test_claim_config_turns_mps_limits_off_and_adds_env(tmp_path):
    slices, gpu = one_gpu(published(PROFILE, share=share_plan(("gpu",), None)))
    c = memory_claim("cfg", "4Gi")
    c["spec"]["devices"]["config"] = [{"opaque": {"driver": "sysdra.io", "parameters": {
        "apiVersion": "sysdra.io/v1alpha1", "kind": "GpuConfig", "sharing": {"mpsLimits": False}, "env": {"APP_MODE": "infer"}}}}]
    (c,) = _allocated(slices, c)
    d = _driver(tmp_path)
    uid = c["metadata"]["uid"]
    res = d.prepare_claims([c])[uid]
    assert res.error is None, res.error
    env = _env(_spec(d, uid), res.devices[0].cdi_ids[0].split("=", 1)[1])
    assert env["APP_MODE"] == "infer" and env["SYSDRA_SHARE_MEMORY"] == "4Gi"
    assert not any(k.startswith("CUDA_MPS_") for k in env)


def test_a_bad_claim_config_is_that_claims_error_only(tmp_path):
    slices, _ = one_gpu(published(PROFILE, share=share_plan(("gpu",), None)))
    bad = memory_claim("bad", "4Gi")
    bad["spec"]["devices"]["config"] = [{"opaque": {"driver": "sysdra.io", "parameters": {
        "apiVersion": "sysdra.io/v1alpha1", "kind": "GpuConfig", "sharing": {"mps": True}}}}]
    good, bad = _allocated(slices, memory_claim("good", "4Gi"), bad)
    out = _driver(tmp_path).prepare_claims([good, bad])
    assert out[good["metadata"]["uid"]].error is None
    assert "GpuConfig: sharing.mps" in out[bad["metadata"]["uid"]].error
