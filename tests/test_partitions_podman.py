"""A GPU partition end to end: the allocator picks partition 3 of CPX on the MI300X that runs
SPX (mi300x-partitions, kernel simulated by fixtures/simkernel/amdgpu.py), the kubelet plugin
prepares it over its real socket (switching the GPU to CPX), and podman (runc) sees exactly
that partition's render node and /dev/kfd. Render nodes and /dev/kfd are real char nodes with
/dev/null's numbers. Needs root, podman, runc, unshare, busybox, as tests/test_podman_cdi.py."""

from __future__ import annotations

import asyncio
import os

import pytest

from agent.kubeletplugin import KubeletPlugin
from agent.kubeletplugin.claims import DirClaimSource
from agent.prepare.driver import Driver
from tests.conftest import require_podman
from tests.kubelet_standin import KubeletStandIn, store_claim
from tests.partition_node import SPX_GPU, Node, devices_of, mode_of, part_of
from tests.test_partitions_allocator import gpu_bdf
from tests.test_podman_cdi import Podman

pytestmark = [pytest.mark.slow, pytest.mark.root]


def test_podman_sees_the_partition_the_switch_exposed(tmp_path):
    busybox = require_podman()
    node = Node(str(tmp_path), mknod=True)
    for rel in ("dev/dri/renderD136", "dev/kfd"):  # the nodes the fixture has before any switch
        os.unlink(os.path.join(node.root, rel))
        os.mknod(os.path.join(node.root, rel), 0o666 | 0o020000, os.makedev(1, 3))
    node.rescan()
    selectors = part_of(SPX_GPU, "CPX/NPS1")
    selectors[0]["cel"]["expression"] += ' && device.attributes["sysdra.io"].partitionIndex == 3'
    c = node.allocated("part3", selectors)
    assert devices_of(c) == [f"{SPX_GPU}-cpx-nps1-3"]
    podman = Podman(str(tmp_path), node.settings.cdi_dir)
    try:
        podman.import_busybox(busybox)
        with node.sim:
            asyncio.run(_prepare_and_run(node, c, podman))
    finally:
        podman.cleanup()


async def _prepare_and_run(node: Node, c: dict, podman: Podman) -> None:
    s = node.settings
    driver = Driver(s, node.inventory)
    driver.hardware_changed = node.rescan
    plugin = KubeletPlugin(s, driver, DirClaimSource(s.cluster_dir))
    await plugin.start()
    try:
        kubelet = KubeletStandIn(s.registry_dir)
        await kubelet.register()
        store_claim(s, c)
        uid = c["metadata"]["uid"]
        resp = await kubelet.prepare(c)
        assert resp.claims[uid].error == ""
        assert mode_of(node.root, gpu_bdf(SPX_GPU)) == "CPX/NPS1" and node.rescans == 2  # republished after the switch
        ids = [i for d in resp.claims[uid].devices for i in d.cdi_device_ids]
        script = ("/bin/busybox stat -c '%n %F %t:%T' /dev/dri/renderD139 /dev/kfd; "
                  "/bin/busybox ls /dev/dri; /bin/busybox env | /bin/busybox grep ^SYSDRA_DEVICES=")
        out = await asyncio.to_thread(podman.run, ids, script)
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines() == [
            "/dev/dri/renderD139 character special file 1:3",
            "/dev/kfd character special file 1:3",
            "renderD139",  # that partition only: not the GPU's own renderD136, not its siblings
            f"SYSDRA_DEVICES={SPX_GPU}-cpx-nps1-3",
        ]
        assert (await kubelet.unprepare(c)).claims[uid].error == ""
    finally:
        await plugin.stop()
