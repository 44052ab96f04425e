"""The whole chain with nothing written by hand: the agent publishes to the real kube-apiserver
with its ServiceAccount token; deploy/example-claim.yaml's claim is allocated by the scheduler's
allocator from what the server holds and written to the claim's status as the scheduler does;
the kubelet plugin reads that claim from the server, prepares it, and podman (runc) runs a
container with the CDI devices it returned.

podman runs as in tests/test_podman_cdi.py (private mount namespace, local busybox image).
Needs root, podman, runc, unshare and busybox: under CI=true a missing one fails the test."""

from __future__ import annotations

import asyncio
import os

import pytest
from lightkube import AsyncClient, KubeConfig

from agent.kubeletplugin import KubeletPlugin
from agent.kubeletplugin.claims import KubeClaimSource
from agent.prepare.driver import Driver
from agent.publish import Reconciler
from agent.publish.kubestore import KubeStore
from agent.publish.slices import build_pool
from discovery.models import AttributeValue
from tests.conftest import REPO, require_podman
from tests.controlplane import allocate, claim_from, load_yaml, resource_path, unique
from tests.kubelet_standin import KubeletStandIn, gpu, inventory, nic, settings_for
from tests.test_podman_cdi import Podman

pytestmark = [pytest.mark.slow, pytest.mark.root]
DRIVER = "sysdra.io"
EXAMPLE = next(d for d in load_yaml(os.path.join(REPO, "deploy", "example-claim.yaml")) if d["kind"] == "ResourceClaimTemplate")


def test_example_claim_allocated_by_the_scheduler_code_then_prepared_and_run(apiserver, tmp_path):
    busybox = require_podman()

    host = str(tmp_path / "host")
    os.makedirs(os.path.join(host, "dev", "dri"))
    # a harmless "GPU": a real char device node with the numbers of /dev/null
    os.mknod(os.path.join(host, "dev", "dri", "renderD128"), 0o666 | 0o020000, os.makedev(1, 3))
    node = apiserver.create_node(unique("e2e"))
    name = node["metadata"]["name"]
    s = settings_for(str(tmp_path), root=host, node_name=name, cluster="kube")
    # discovery always sets the `type` attribute deploy/deviceclasses.yaml selects on; the factory
    # devices do not, and a class selector reading a missing attribute is a CEL runtime error
    devices = [d.replace(attributes={"type": AttributeValue(string=d.kind)})
               for d in (gpu(0, root=host, major=1, minor=3), nic(0, "ens9f0"))]  # fmt: skip
    inv = inventory(*devices, root=host)

    # the agent's identity: deploy/ manifests, token bound to the node
    apiserver.apply(f"{REPO}/deploy/namespace.yaml")
    apiserver.apply(f"{REPO}/deploy/rbac.yaml")
    apiserver.apply(f"{REPO}/deploy/deviceclasses.yaml")
    kubeconfig = apiserver.write_kubeconfig(str(tmp_path / "agent.kubeconfig"), token=apiserver.token("sysdra", "sysdra", node=name))

    ns = unique("e2e")
    apiserver.create_namespace(ns)
    template = dict(EXAMPLE, metadata=dict(EXAMPLE["metadata"], namespace=ns))
    claim = claim_from(template, name="gpu-nic-demo-devices")
    claim["metadata"].pop("uid")
    stored = apiserver.create(claim)

    podman = Podman(str(tmp_path), s.cdi_dir)
    try:
        podman.import_busybox(busybox)
        asyncio.run(asyncio.wait_for(_publish_allocate_prepare_run(apiserver, s, inv, kubeconfig, stored, node, podman), 240))
    finally:
        podman.cleanup()


async def _publish_allocate_prepare_run(apiserver, s, inv, kubeconfig, stored, node, podman) -> None:
    name = node["metadata"]["name"]
    client = AsyncClient(config=KubeConfig.from_file(kubeconfig), field_manager=DRIVER)
    try:
        # 1. publish, as the agent
        rec = Reconciler(KubeStore(client, node_name=name, driver_name=DRIVER), node_name=name, driver_name=DRIVER)
        stats = await rec.sync(build_pool(inv, node_name=name, driver_name=DRIVER))
        assert stats.created == 1

        # 2. allocate from what the server holds, with the scheduler's code; write it as the scheduler does
        slices = await asyncio.to_thread(apiserver.list, "ResourceSlice", fields={"spec.nodeName": name})
        classes = await asyncio.to_thread(apiserver.list, "DeviceClass")
        (allocation,) = allocate(slices, classes, stored, node=node)
        got = {r["request"]: r["device"] for r in allocation["devices"]["results"]}
        assert got == {"gpu": "gpu-0000-1b-00-0", "nic": "nic-0000-40-00-0"}
        meta = stored["metadata"]
        stored = dict(stored, status={"allocation": allocation})
        path = resource_path("ResourceClaim", meta["namespace"], meta["name"]) + "/status"
        stored = (await asyncio.to_thread(apiserver.request, "PUT", path, body=stored)).json()
        assert stored["status"]["allocation"]["devices"]["results"] == allocation["devices"]["results"]

        # 3. the kubelet's prepare; the plugin reads the claim from the server with the agent's token
        plugin = KubeletPlugin(s, Driver(s, lambda: inv), KubeClaimSource(client))
        await plugin.start()
        try:
            kubelet = KubeletStandIn(s.registry_dir)
            await kubelet.register()
            uid = meta["uid"]
            resp = await kubelet.prepare(stored)
            assert resp.claims[uid].error == "", resp.claims[uid].error
            ids = [i for d in resp.claims[uid].devices for i in d.cdi_device_ids]

            # 4. the container gets what the allocator picked
            script = ("/bin/busybox stat -c '%F %t:%T' /dev/dri/renderD128; "
                      "/bin/busybox env | /bin/busybox grep ^SYSDRA_DEVICES=")  # fmt: skip
            out = await asyncio.to_thread(podman.run, ids, script)
            assert out.returncode == 0, out.stderr
            assert out.stdout.splitlines() == ["character special file 1:3", "SYSDRA_DEVICES=gpu-0000-1b-00-0,nic-0000-40-00-0"]
            assert (await kubelet.unprepare(stored)).claims[uid].error == ""
        finally:
            await plugin.stop()
    finally:
        await client.close()
