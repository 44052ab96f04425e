"""The cluster of the status.devices tests on the real kube-apiserver v1.37.2
(tests/test_claim_status.py, test_claim_status_writes.py).

The agent runs as the DaemonSet does: ServiceAccount sysdra/sysdra (deploy/rbac.yaml) with the
token the kubelet mounts into its pod (bound to the Pod object, so it carries the node name).
Claims are allocated by the upstream allocator from what the server holds, and written as the
scheduler does. Another driver (``OTHER``) shares the claim and has a slice on both nodes."""

from __future__ import annotations

import asyncio
import copy
import os

import pytest
from lightkube import AsyncClient, KubeConfig

from agent.kubeletplugin.types import ClaimRef
from agent.publish import Reconciler
from agent.publish.kubestore import KubeStore
from agent.publish.slices import build_pool
from discovery.models import AttributeValue, NetInterface, NicInfo
from tests.conftest import REPO
from tests.controlplane import allocate, load_yaml, resource_path, unique
from tests.kubelet_standin import gpu, inventory, nic, settings_for

DRIVER = "sysdra.io"
OTHER = "other.example.com"
MAC = "0c:42:a1:00:00:01"


def run(coro, timeout: float = 90):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def typed(*devices):
    # the `type` attribute deploy/deviceclasses.yaml selects on (discovery always sets it)
    return [d.replace(attributes={"type": AttributeValue(string=d.kind)}) for d in devices]


def host_root(tmp) -> str:
    """A host tree whose init's network namespace lists one global IPv6 address on ens9f0
    (``/proc/1/net/if_inet6``, the kernel's format) and one link-local that is left out."""
    root = os.path.join(str(tmp), "host")
    os.makedirs(os.path.join(root, "proc", "1", "net"))
    with open(os.path.join(root, "proc", "1", "net", "if_inet6"), "w") as f:
        f.write("20010db8000000000000000000000005 05 40 00 80 ens9f0\n"
                "fe800000000000000e42a1fffe000001 05 40 20 80 ens9f0\n")  # fmt: skip
    return root


class Cluster:
    """The deploy/ manifests on the server, a class for the other driver, two nodes."""

    def __init__(self, plane, tmp):
        self.plane = plane
        for name in ("namespace.yaml", "rbac.yaml", "deviceclasses.yaml"):
            plane.apply(f"{REPO}/deploy/{name}")
        self.other_class = unique("other")
        plane.apply({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": self.other_class},
                     "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{OTHER}"'}}]}})  # fmt: skip
        self.node = plane.create_node(unique("status-own"))
        self.name = self.node["metadata"]["name"]
        self.far = plane.create_node(unique("status-far"))
        self.ns = unique("status")
        plane.create_namespace(self.ns)
        self.pod_token = self.daemonset_pod_token()
        self.kubeconfig = plane.write_kubeconfig(str(tmp / "agent.kubeconfig"), token=self.pod_token, namespace="sysdra")
        host = host_root(tmp)
        devices = typed(gpu(0, root=host), nic(0, "ens9f0"))
        devices[1] = devices[1].replace(nic=NicInfo(interfaces=(NetInterface(name="ens9f0", mac=MAC),)))
        self.inv = inventory(*devices, root=host)
        self.settings = settings_for(str(tmp), root=host, node_name=self.name, cluster="kube")
        for node in (self.name, self.far["metadata"]["name"]):
            self.publish(node)

    def daemonset_pod_token(self) -> str:
        """What the kubelet mounts into the DaemonSet's pod: a token bound to the Pod, which runs
        on our node. The Pod is the DaemonSet's own template, so the server validates that too."""
        (ds,) = [d for d in load_yaml(f"{REPO}/deploy/daemonset.yaml") if d["kind"] == "DaemonSet"]
        self.plane.apply(ds)
        template = copy.deepcopy(ds["spec"]["template"])
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": unique("sysdra"), "namespace": "sysdra", "labels": template["metadata"]["labels"]},
               "spec": dict(template["spec"], nodeName=self.name)}  # fmt: skip
        pod = self.plane.create(pod)
        assert any(v.get("projected") for v in pod["spec"]["volumes"]), "the kube-api-access volume is mounted"
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": pod["metadata"]["name"],
                                            "uid": pod["metadata"]["uid"]}}}  # fmt: skip
        path = resource_path("ServiceAccount", "sysdra", "sysdra") + "/token"
        return self.plane.request("POST", path, body=body).json()["status"]["token"]

    def publish(self, node: str) -> None:
        async def sync():
            client = AsyncClient(config=KubeConfig.from_file(self.plane.kubeconfig), field_manager=DRIVER)
            try:
                store = KubeStore(client, node_name=node, driver_name=DRIVER)
                await Reconciler(store, node_name=node, driver_name=DRIVER).sync(
                    build_pool(self.inv, node_name=node, driver_name=DRIVER))
            finally:
                await client.close()

        run(sync())
        self.plane.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{node}-{OTHER}"},
                           "spec": {"driver": OTHER, "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                                    "devices": [{"name": "other-0"}]}})  # fmt: skip

    def allocated_claim(self, node: str, other: bool = True) -> dict:
        """A claim for a GPU, a NIC (and the other driver's device), allocated on ``node`` by the allocator."""
        requests = [{"name": "gpu", "exactly": {"deviceClassName": "gpu.sysdra.io"}},
                    {"name": "nic", "exactly": {"deviceClassName": "nic.sysdra.io"}}]  # fmt: skip
        if other:
            requests.append({"name": "other", "exactly": {"deviceClassName": self.other_class}})
        stored = self.plane.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                    "metadata": {"name": unique("claim"), "namespace": self.ns},
                                    "spec": {"devices": {"requests": requests}}})  # fmt: skip
        slices = self.plane.list("ResourceSlice", fields={"spec.nodeName": node})
        classes = self.plane.list("DeviceClass")
        (allocation,) = allocate(slices, classes, stored, node=self.plane.get("Node", node))
        meta = stored["metadata"]
        path = resource_path("ResourceClaim", meta["namespace"], meta["name"]) + "/status"
        return self.plane.request("PUT", path, body=dict(stored, status={"allocation": allocation})).json()

    def claim(self, c: dict) -> dict:
        return self.plane.get("ResourceClaim", c["metadata"]["name"], c["metadata"]["namespace"])

    def apply_status_as(self, manager: str, c: dict, entries: list[dict]) -> dict:
        meta = c["metadata"]
        path = resource_path("ResourceClaim", meta["namespace"], meta["name"]) + "/status"
        body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": meta["name"], "namespace": meta["namespace"]}, "status": {"devices": entries}}  # fmt: skip
        return self.plane.request("PATCH", path, body=body, params={"fieldManager": manager, "force": "true"},
                                  content_type="application/apply-patch+yaml").json()

    def agent_client(self) -> AsyncClient:
        return AsyncClient(config=KubeConfig.from_file(self.kubeconfig), field_manager=DRIVER)


@pytest.fixture(scope="module")
def cluster(apiserver, tmp_path_factory):
    return Cluster(apiserver, tmp_path_factory.mktemp("status"))


def ref(c: dict) -> ClaimRef:
    m = c["metadata"]
    return ClaimRef(m["namespace"], m["name"], m["uid"])


def ours(c: dict) -> list[dict]:
    return [e for e in (c.get("status") or {}).get("devices") or [] if e["driver"] == DRIVER]


def _entry(r: dict) -> dict:
    return {"driver": r["driver"], "pool": r["pool"], "device": r["device"], "data": {"x": 1}}
