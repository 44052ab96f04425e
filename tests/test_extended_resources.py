"""Extended resources backed by DRA (KEP-5004, GA in 1.37) on the real kube-apiserver v1.37.2:
deploy/deviceclasses.yaml's extendedResourceName values are accepted, and prepare handles the
claim the scheduler creates for a Pod asking ``sysdra.io/gpu: 1`` (shaped as
``pkg/scheduler/framework/plugins/dynamicresources/extendeddynamicresources.go`` builds it:
generateName ``<pod>-extended-resources-``, the Pod as controller owner, annotation
``resource.kubernetes.io/extended-resource-claim: "true"``, ExactCount requests named
``container-<i>-request-<j>``). The slow test lets kube-scheduler itself create and allocate it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time

import pytest
from lightkube import AsyncClient, KubeConfig

from agent.kubeletplugin.claims import KubeClaimSource
from agent.kubeletplugin.statusbackends import KubeStatus
from agent.kubeletplugin.statuswriter import StatusWriter
from agent.prepare import cdifiles
from agent.publish import Reconciler
from agent.publish.kubestore import KubeStore
from agent.publish.sharing import share_plan
from agent.publish.slices import build_pool
from discovery.inventory import scan
from discovery.models import AttributeValue
from tests.conftest import REPO, profile_root
from tests.controlplane import APIError, allocate, load_yaml, resource_path, unique
from tests.kubelet_standin import gpu, inventory, registered_plugin, settings_for
from tests.test_deviceclasses import ON_VFIO, gpu_for_vms_root

DRIVER = "sysdra.io"
ANNOTATION = "resource.kubernetes.io/extended-resource-claim"
CLASSES = {d["metadata"]["name"]: d for d in load_yaml(f"{REPO}/deploy/deviceclasses.yaml")}


def run(coro, timeout: float = 90):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_deviceclasses_carry_extended_resource_names_the_server_accepts(apiserver):
    names = {n: c["spec"]["extendedResourceName"] for n, c in CLASSES.items() if "extendedResourceName" in c["spec"]}
    assert names == {f"{k}.sysdra.io": f"sysdra.io/{k}" for k in ("gpu", "nic", "fpga", "accelerator")}
    stored = apiserver.apply(f"{REPO}/deploy/deviceclasses.yaml")
    assert {c["metadata"]["name"]: c["spec"]["extendedResourceName"] for c in stored if "extendedResourceName" in c["spec"]} == names
    # the server does check the name: kubernetes.io is reserved
    bad = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": unique("bad")},
           "spec": {"extendedResourceName": "kubernetes.io/gpu"}}  # fmt: skip
    with pytest.raises(APIError) as err:
        apiserver.create(bad)
    assert err.value.status == 422


class Node:
    """A node in the API with the pool the agent publishes for ``inv`` (two GPUs by default) with
    ``options`` (build_pool's: partitions, share, ...)."""

    def __init__(self, plane, tmp, prefix: str, inv=None, **options):
        self.plane = plane
        plane.apply(f"{REPO}/deploy/deviceclasses.yaml")
        self.node = plane.create_node(unique(prefix))
        self.name = self.node["metadata"]["name"]
        self.ns = unique(prefix)
        plane.create_namespace(self.ns)
        plane.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": self.ns}})
        devices = [d.replace(attributes={"type": AttributeValue(string="gpu")}) for d in (gpu(0), gpu(1))]
        self.inv = inv if inv is not None else inventory(*devices)
        self.settings = settings_for(str(tmp), node_name=self.name, cluster="kube")
        run(self._publish(options))

    async def _publish(self, options: dict):
        client = AsyncClient(config=KubeConfig.from_file(self.plane.kubeconfig), field_manager=DRIVER)
        try:
            store = KubeStore(client, node_name=self.name, driver_name=DRIVER)
            await Reconciler(store, node_name=self.name, driver_name=DRIVER).sync(
                build_pool(self.inv, node_name=self.name, driver_name=DRIVER, **options))
        finally:
            await client.close()

    def pod(self, name: str, gpus: int = 1) -> dict:
        return self.plane.create({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": self.ns},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": self.name}, "restartPolicy": "Never",
                     "containers": [{"name": "app", "image": "registry.k8s.io/e2e-test-images/busybox:1.36.1-1",
                                     "resources": {"requests": {"sysdra.io/gpu": str(gpus)},
                                                   "limits": {"sysdra.io/gpu": str(gpus)}}}]},
        })  # fmt: skip

    def prepare(self, claim: dict) -> tuple[list[str], dict]:
        """NodePrepareResources for ``claim`` as the kubelet sends it -> (device names, claim after status)."""

        async def go():
            client = AsyncClient(config=KubeConfig.from_file(self.plane.kubeconfig), field_manager=DRIVER)
            writer = StatusWriter(KubeStatus(DRIVER, client))
            try:
                async with registered_plugin(self.settings, self.inv, KubeClaimSource(client), writer) as kubelet:
                    result = (await kubelet.prepare(claim)).claims[claim["metadata"]["uid"]]
                    assert result.error == "", result.error
                    await writer.idle(30)
                    assert writer.failed == 0, writer.last_error
                    return [d.device_name for d in result.devices]
            finally:
                await client.close()

        devices = run(go())
        return devices, self.plane.get("ResourceClaim", claim["metadata"]["name"], claim["metadata"]["namespace"])

    def check_prepared(self, claim: dict, request: str, devices: list[str], after: dict) -> None:
        uid, name, ns = claim["metadata"]["uid"], claim["metadata"]["name"], claim["metadata"]["namespace"]
        s = self.settings
        spec = json.load(open(cdifiles.claim_spec_path(s.cdi_dir, DRIVER, uid)))
        assert [d["name"] for d in spec["devices"]] == [f"{uid}-{d}" for d in devices]
        # metadata: no pod-claim-name annotation on these claims, so the claim's own name is the path
        host = os.path.join(s.plugin_dir, "dra-device-metadata", f"{ns}_{name}", request, "metadata.json")
        assert json.loads(open(host).readline())["requests"][0]["name"] == request
        mspec = json.load(open(os.path.join(s.cdi_dir, f"{DRIVER}_metadata_{uid}_{request}.json")))
        (mount,) = mspec["devices"][0]["containerEdits"]["mounts"]
        assert mount["containerPath"] == (f"/var/run/kubernetes.io/dra-device-attributes/resourceclaims/{name}/"
                                          f"{request}/{DRIVER}-metadata.json")  # fmt: skip
        assert [e["device"] for e in after["status"]["devices"]] == devices


def scheduler_shaped_claim(pod: dict, requests: list[tuple[str, int]]) -> dict:
    """The claim exactly as the 1.37 scheduler creates it (createExtendedResourceClaimInAPI)."""
    meta = pod["metadata"]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"generateName": meta["name"] + "-extended-resources-", "namespace": meta["namespace"],
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"],
                                              "controller": True}],
                         "annotations": {ANNOTATION: "true"}},
            "spec": {"devices": {"requests": [
                {"name": name, "exactly": {"deviceClassName": "gpu.sysdra.io", "allocationMode": "ExactCount", "count": n}}
                for name, n in requests]}}}  # fmt: skip


def test_prepare_handles_the_claim_the_scheduler_creates_for_an_extended_resource(apiserver, tmp_path):
    node = Node(apiserver, tmp_path, "ext")
    pod = node.pod("trainer", gpus=2)
    claim = apiserver.create(scheduler_shaped_claim(pod, [("container-0-request-0", 2)]))
    assert claim["metadata"]["name"].startswith("trainer-extended-resources-")
    slices = apiserver.list("ResourceSlice", fields={"spec.nodeName": node.name})
    (allocation,) = allocate(slices, list(CLASSES.values()), claim, node=node.node)
    path = resource_path("ResourceClaim", node.ns, claim["metadata"]["name"]) + "/status"
    claim = apiserver.request("PUT", path, body=dict(claim, status={"allocation": allocation})).json()
    devices, after = node.prepare(claim)
    assert sorted(devices) == ["gpu-0000-1b-00-0", "gpu-0000-1c-00-0"]
    node.check_prepared(claim, "container-0-request-0", devices, after)


@contextlib.contextmanager
def scheduler(plane):
    proc = plane.start_scheduler()
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(15)
        plane._procs.remove(proc)


def wait_for(plane, what: str, probe, timeout: float = 90):
    deadline = time.monotonic() + timeout
    while not (value := probe()):
        assert time.monotonic() < deadline, f"{what}\n" + plane.log_tail("kube-scheduler", 40)
        time.sleep(0.2)
    return value


def scheduled(plane, node: Node, pod: str) -> dict | None:
    got = plane.get("Pod", pod, node.ns)
    return got if got["spec"].get("nodeName") else None


@pytest.mark.slow
def test_kube_scheduler_creates_allocates_and_prepare_follows(apiserver, tmp_path):
    node = Node(apiserver, tmp_path, "extsched")
    with scheduler(apiserver):
        pod = node.pod("inference")
        got = wait_for(apiserver, "pod inference scheduled", lambda: scheduled(apiserver, node, "inference"))
    assert got["spec"]["nodeName"] == node.name
    status = got["status"]["extendedResourceClaimStatus"]
    assert status["requestMappings"] == [{"containerName": "app", "resourceName": "sysdra.io/gpu",
                                          "requestName": "container-0-request-0"}]  # fmt: skip
    claim = apiserver.get("ResourceClaim", status["resourceClaimName"], node.ns)
    want = scheduler_shaped_claim(pod, [("container-0-request-0", 1)])
    assert claim["metadata"]["annotations"] == want["metadata"]["annotations"]
    assert claim["metadata"]["ownerReferences"] == want["metadata"]["ownerReferences"]
    assert claim["metadata"]["name"].startswith(want["metadata"]["generateName"])
    assert claim["spec"]["devices"]["requests"][0]["exactly"] | want["spec"]["devices"]["requests"][0]["exactly"] == \
        claim["spec"]["devices"]["requests"][0]["exactly"]
    devices, after = node.prepare(claim)
    assert devices == ["gpu-0000-1b-00-0"]
    node.check_prepared(claim, "container-0-request-0", devices, after)


@pytest.mark.slow
def test_kube_scheduler_gives_the_extended_resource_a_whole_gpu_only(apiserver, tmp_path):
    """Beside partitions and shares (tests/test_deviceclasses.py with the allocator alone): on an
    h100-mig node with --partitions, whose pool holds a GPU's MIG instances before the other, plain
    GPU, ``sysdra.io/gpu: 1`` gets the plain GPU; on a node with --share gpu, where every GPU is
    shared and a claim without capacity requests would get 1Gi and 10% of one, it is not scheduled."""
    mig = Node(apiserver, tmp_path / "mig", "extmig", inv=scan(profile_root("h100-mig")), partitions=True)
    shared = Node(apiserver, tmp_path / "shared", "extshare", inv=scan(profile_root("server-2s-gpu-nic")),
                  share=share_plan(("gpu",), None))  # fmt: skip
    first = next(d["name"] for s in apiserver.list("ResourceSlice", fields={"spec.nodeName": mig.name})
                 for d in s["spec"].get("devices", []))  # fmt: skip
    assert first.startswith("gpu-0000-18-00-0-mig-")  # what the allocator meets first
    with scheduler(apiserver):
        mig.pod("whole")
        shared.pod("whole")
        got = wait_for(apiserver, "pod whole scheduled on the MIG node", lambda: scheduled(apiserver, mig, "whole"))
        # decided either way: found unschedulable, or (wrongly) placed on a share
        other = wait_for(apiserver, "the shared node's pod decided", lambda: scheduled(apiserver, shared, "whole") or next(
            (c for c in apiserver.get("Pod", "whole", shared.ns)["status"].get("conditions", [])
             if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"), None))  # fmt: skip
    assert got["spec"]["nodeName"] == mig.name
    claim = apiserver.get("ResourceClaim", got["status"]["extendedResourceClaimStatus"]["resourceClaimName"], mig.ns)
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["device"] == "gpu-0000-3a-00-0" and "shareID" not in result
    assert other.get("status") == "False", f"scheduled on a share: {other.get('status')}"


@pytest.mark.slow
def test_kube_scheduler_never_gives_the_extended_resource_a_gpu_on_vfio_pci(apiserver, tmp_path):
    """nvidia-minor-order with its first GPU (the allocator's first pick) bound to vfio-pci for VMs:
    ``sysdra.io/gpu: 4`` gets the four GPUs on nvidia, ``sysdra.io/gpu: 5`` is not scheduled."""
    vms = Node(apiserver, tmp_path, "extvfio", inv=scan(gpu_for_vms_root(tmp_path)))
    with scheduler(apiserver):
        vms.pod("four", gpus=4)
        got = wait_for(apiserver, "pod four scheduled", lambda: scheduled(apiserver, vms, "four"))
        vms.pod("five", gpus=5)
        five = wait_for(apiserver, "pod five decided", lambda: scheduled(apiserver, vms, "five") or next(
            (c for c in apiserver.get("Pod", "five", vms.ns)["status"].get("conditions", [])
             if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"), None))  # fmt: skip
    claim = apiserver.get("ResourceClaim", got["status"]["extendedResourceClaimStatus"]["resourceClaimName"], vms.ns)
    results = claim["status"]["allocation"]["devices"]["results"]
    assert len(results) == 4 and not {r["device"] for r in results} & ON_VFIO
    assert five.get("status") == "False", "pod five got the GPU on vfio-pci"
