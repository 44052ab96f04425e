"""Two claims share one GPU end to end: the agent publishes it with --share, the scheduler's
allocator gives each claim a share, the kubelet plugin prepares both (v1 gRPC, share_id set),
and podman (runc) runs one container per claim: both see the same device node, each with its
own share environment; one container given two shares of it gets their sum. podman runs as in
tests/test_podman_cdi.py."""

from __future__ import annotations

import asyncio
import os

import pytest

from agent.kubeletplugin import KubeletPlugin
from agent.kubeletplugin.claims import DirClaimSource
from agent.prepare.driver import Driver
from agent.publish.sharing import share_plan
from agent.publish.slices import build_pool, render
from discovery.models import AttributeValue
from tests.conftest import require_podman
from tests.controlplane import allocate, with_allocation
from tests.kubelet_standin import KubeletStandIn, gpu, inventory, settings_for, store_claim
from tests.test_allocator import CLASSES, claim, exactly
from tests.test_podman_cdi import Podman

pytestmark = [pytest.mark.slow, pytest.mark.root]
DRIVER, NODE = "sysdra.io", "node-a"


def _node(tmp_path):
    """Settings, inventory, slices and the GPU of a node sharing one (fake NVIDIA) GPU."""
    host = str(tmp_path / "host")
    os.makedirs(os.path.join(host, "dev", "dri"))
    os.mknod(os.path.join(host, "dev", "dri", "renderD128"), 0o666 | 0o020000, os.makedev(1, 3))  # /dev/null's numbers
    s = settings_for(str(tmp_path), root=host, node_name=NODE, share=("gpu",), nvidia_mps=False)  # as published
    base = gpu(0, root=host, major=1, minor=3)
    dev = base.replace(attributes={"type": AttributeValue(string="gpu")}, capacity={"memory": "16Gi"},
                      pci=base.pci.replace(vendor_id="10de"))
    inv = inventory(dev, root=host)

    slices = render(build_pool(inv, node_name=NODE, driver_name=DRIVER, share=share_plan(("gpu",), None)),
                    driver_name=DRIVER, node_name=NODE, generation=1, full_name=True)  # fmt: skip
    return s, inv, slices, dev


def test_two_claims_share_one_gpu_in_two_containers(tmp_path):
    busybox = require_podman()
    s, inv, slices, dev = _node(tmp_path)
    claims, done = [], []
    for name, memory in (("alpha", "4Gi"), ("beta", "12Gi")):
        c = claim(name, exactly("gpu", "gpu-share.sysdra.io", capacity={"requests": {"memory": memory, "compute": "50"}}))
        c["metadata"]["uid"] = f"00000000-0000-4000-8000-00000000000{len(claims)}"
        (a,) = allocate(slices, CLASSES, c, node=NODE, allocated=done)
        done.append(with_allocation(c, a))
        claims.append(store_claim(s, done[-1]))
    shares = [c["status"]["allocation"]["devices"]["results"][0] for c in claims]
    assert {r["device"] for r in shares} == {dev.name} and shares[0]["shareID"] != shares[1]["shareID"]

    podman = Podman(str(tmp_path), s.cdi_dir)
    try:
        podman.import_busybox(busybox)
        asyncio.run(asyncio.wait_for(_prepare_and_run(s, inv, podman, claims, shares), 240))
    finally:
        podman.cleanup()


async def _prepare_and_run(s, inv, podman: Podman, claims: list[dict], shares: list[dict]) -> None:
    plugin = KubeletPlugin(s, Driver(s, lambda: inv), DirClaimSource(s.cluster_dir))
    await plugin.start()
    try:
        kubelet = KubeletStandIn(s.registry_dir)
        await kubelet.register()
        ids = []
        for c, share in zip(claims, shares):
            uid = c["metadata"]["uid"]
            resp = await kubelet.prepare(c)
            assert resp.claims[uid].error == "", resp.claims[uid].error
            (d,) = [d for d in resp.claims[uid].devices if d.device_name == share["device"]]
            assert d.share_id == share["shareID"]
            ids.append([i for d in resp.claims[uid].devices for i in d.cdi_device_ids])
        script = ("/bin/busybox stat -c '%F %t:%T' /dev/dri/renderD128; "
                  "/bin/busybox env | /bin/busybox grep -E '^(SYSDRA_SHARE_|CUDA_MPS_)' | /bin/busybox sort")
        outs = [await asyncio.to_thread(podman.run, i, script) for i in ids]
        for out, share, memory in zip(outs, shares, ("4Gi", "12Gi")):
            assert out.returncode == 0, out.stderr
            lines = out.stdout.splitlines()
            assert lines[0] == "character special file 1:3"  # the same device node in both
            mib = {"4Gi": 4096, "12Gi": 12288}[memory]
            assert lines[1:] == sorted([
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50", f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={mib}M",
                "SYSDRA_SHARE_COMPUTE=50", "SYSDRA_SHARE_COMPUTE_VALUE=50", f"SYSDRA_SHARE_DEVICE={share['device']}",
                f"SYSDRA_SHARE_ID={share['shareID']}", f"SYSDRA_SHARE_MEMORY={memory}",
                f"SYSDRA_SHARE_MEMORY_VALUE={mib * 2**20}",
            ])  # fmt: skip
        # the first claim goes: the second one's container still runs with its share
        assert (await kubelet.unprepare(claims[0])).claims[claims[0]["metadata"]["uid"]].error == ""
        out = await asyncio.to_thread(podman.run, ids[1], "/bin/busybox env | /bin/busybox grep ^SYSDRA_SHARE_ID=")
        assert out.returncode == 0 and out.stdout.strip() == f"SYSDRA_SHARE_ID={shares[1]['shareID']}", out.stderr
        assert (await kubelet.unprepare(claims[1])).claims[claims[1]["metadata"]["uid"]].error == ""
    finally:
        await plugin.stop()


def test_one_container_with_two_shares_of_a_gpu_gets_their_sum(tmp_path):
    """One claim, two requests, both shares of the GPU, one container given both CDI devices, in
    either order: the runtime keeps one value per variable, and every value is the claim's sum."""
    busybox = require_podman()
    s, inv, slices, dev = _node(tmp_path)
    c = claim("two", exactly("a", "gpu-share.sysdra.io", capacity={"requests": {"memory": "4Gi", "compute": "30"}}),
              exactly("b", "gpu-share.sysdra.io", capacity={"requests": {"memory": "8Gi", "compute": "20"}}))
    c["metadata"]["uid"] = "00000000-0000-4000-8000-000000000009"
    (a,) = allocate(slices, CLASSES, c, node=NODE)
    c = store_claim(s, with_allocation(c, a))
    podman = Podman(str(tmp_path), s.cdi_dir)
    try:
        podman.import_busybox(busybox)
        asyncio.run(asyncio.wait_for(_both_shares(s, inv, podman, c), 240))
    finally:
        podman.cleanup()


async def _both_shares(s, inv, podman: Podman, c: dict) -> None:
    plugin = KubeletPlugin(s, Driver(s, lambda: inv), DirClaimSource(s.cluster_dir))
    await plugin.start()
    try:
        kubelet = KubeletStandIn(s.registry_dir)
        await kubelet.register()
        uid = c["metadata"]["uid"]
        resp = await kubelet.prepare(c)
        assert resp.claims[uid].error == "", resp.claims[uid].error
        ids = [i for d in resp.claims[uid].devices for i in d.cdi_device_ids if "/claim=" in i]
        assert len(ids) == 2
        script = "/bin/busybox env | /bin/busybox grep -E '^(SYSDRA_SHARE_(MEMORY|COMPUTE)|CUDA_MPS_)' | /bin/busybox sort"
        for order in (ids, ids[::-1]):
            out = await asyncio.to_thread(podman.run, order, script)
            assert out.returncode == 0, out.stderr
            assert out.stdout.splitlines() == [
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50", f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={12 * 1024}M",
                "SYSDRA_SHARE_COMPUTE=50", "SYSDRA_SHARE_COMPUTE_VALUE=50",
                f"SYSDRA_SHARE_MEMORY={12 * 2**30}", f"SYSDRA_SHARE_MEMORY_VALUE={12 * 2**30}"]
        assert (await kubelet.unprepare(c)).claims[uid].error == ""
    finally:
        await plugin.stop()
