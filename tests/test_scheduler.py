"""kube-scheduler v1.37.2 (tests/peers/kube-scheduler) against the real server: a Pod whose
claim asks for deploy/example-claim.yaml's devices is scheduled to a fake Ready Node from the
slices the agent published there; the scheduler writes the allocation and reservedFor, binds
the Pod, and that allocation drives the agent's prepare (CDI spec with the allocated devices)."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from agent.kubeletplugin import KubeletPlugin
from agent.kubeletplugin.claims import KubeClaimSource
from agent.prepare.driver import Driver
from agent.publish import Reconciler
from agent.publish.kubestore import KubeStore
from agent.publish.slices import build_pool
from discovery.models import AttributeValue
from lightkube import AsyncClient, KubeConfig
from tests.conftest import REPO
from tests.controlplane import load_yaml, unique, wait_until
from tests.kubelet_standin import KubeletStandIn, gpu, inventory, nic, settings_for

pytestmark = pytest.mark.slow
DRIVER = "sysdra.io"
EXAMPLE = next(d for d in load_yaml(os.path.join(REPO, "deploy", "example-claim.yaml")) if d["kind"] == "ResourceClaimTemplate")


@pytest.fixture(scope="module")
def scheduler(apiserver):
    proc = apiserver.start_scheduler()
    yield proc
    proc.terminate()
    proc.wait(15)
    apiserver._procs.remove(proc)


def wait_for(predicate, what: str, plane, timeout: float = 60.0):
    return wait_until(predicate, timeout, what=what, tail=lambda: plane.log_tail("kube-scheduler", 30))


def publish(apiserver, node: str, inv) -> None:
    """The pool of ``inv`` published as the agent publishes it, for ``node``."""

    async def sync():
        client = AsyncClient(config=KubeConfig.from_file(apiserver.kubeconfig), field_manager=DRIVER)
        try:
            rec = Reconciler(KubeStore(client, node_name=node, driver_name=DRIVER), node_name=node, driver_name=DRIVER)
            await rec.sync(build_pool(inv, node_name=node, driver_name=DRIVER))
        finally:
            await client.close()

    asyncio.run(sync())


def test_scheduler_allocates_the_claim_binds_the_pod_and_prepare_follows(apiserver, scheduler, tmp_path):
    node = apiserver.create_node(unique("sched"))
    name = node["metadata"]["name"]
    devices = [d.replace(attributes={"type": AttributeValue(string=d.kind)}) for d in (gpu(0), gpu(1), nic(0, "ens9f0"))]
    inv = inventory(*devices)
    s = settings_for(str(tmp_path), node_name=name, cluster="kube")

    apiserver.apply(f"{REPO}/deploy/deviceclasses.yaml")
    ns = unique("sched")
    apiserver.create_namespace(ns)
    apiserver.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": ns}})
    claim = apiserver.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                              "metadata": {"name": "devices", "namespace": ns}, "spec": EXAMPLE["spec"]["spec"]})  # fmt: skip

    publish(apiserver, name, inv)
    pod = apiserver.create({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "gpu-nic-demo", "namespace": ns},
        "spec": {"nodeSelector": {"kubernetes.io/hostname": name}, "restartPolicy": "Never",
                 "resourceClaims": [{"name": "devices", "resourceClaimName": "devices"}],
                 "containers": [{"name": "app", "image": "registry.k8s.io/e2e-test-images/busybox:1.36.1-1",
                                 "resources": {"claims": [{"name": "devices"}]}}]},
    })  # fmt: skip

    bound = wait_for(lambda: apiserver.get("Pod", "gpu-nic-demo", ns)["spec"].get("nodeName"), "pod bound", apiserver)
    assert bound == name
    claim = apiserver.get("ResourceClaim", "devices", ns)
    results = claim["status"]["allocation"]["devices"]["results"]
    got = {r["request"]: r["device"] for r in results}
    assert got == {"gpu": "gpu-0000-1b-00-0", "nic": "nic-0000-40-00-0"}  # first fit, in inventory order
    assert all(r["driver"] == DRIVER and r["pool"] == name for r in results)
    assert claim["status"]["reservedFor"] == [{"resource": "pods", "name": "gpu-nic-demo", "uid": pod["metadata"]["uid"]}]

    async def prepare():
        client = AsyncClient(config=KubeConfig.from_file(apiserver.kubeconfig), field_manager=DRIVER)
        plugin = KubeletPlugin(s, Driver(s, lambda: inv), KubeClaimSource(client))
        await plugin.start()
        try:
            kubelet = KubeletStandIn(s.registry_dir)
            await kubelet.register()
            resp = await kubelet.prepare(claim)
            result = resp.claims[claim["metadata"]["uid"]]
            assert result.error == "", result.error
            return {d.device_name for d in result.devices}
        finally:
            await plugin.stop()
            await client.close()

    assert asyncio.run(prepare()) == set(got.values())
    specs = [json.load(open(os.path.join(s.cdi_dir, f))) for f in os.listdir(s.cdi_dir) if claim["metadata"]["uid"] in f]
    assert specs, os.listdir(s.cdi_dir)


def _pod(ns: str, name: str, node: str, claim: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": node}, "restartPolicy": "Never",
                     "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
                     "containers": [{"name": "app", "image": "registry.k8s.io/e2e-test-images/busybox:1.36.1-1",
                                     "resources": {"claims": [{"name": "gpu"}]}}]}}  # fmt: skip


def test_a_device_taint_rule_takes_a_gpu_out_of_service(apiserver, scheduler):
    """docs/health.md, "Taking a device out of service": a DeviceTaintRule naming the agent's driver,
    its pool (the node's name) and a device keeps new claims off that device; a claim that tolerates
    the taint (a burn-in test) still gets it. The agent's slices are not changed for it."""
    node = apiserver.create_node(unique("taintrule"))
    name = node["metadata"]["name"]
    inv = inventory(*[d.replace(attributes={"type": AttributeValue(string=d.kind)}) for d in (gpu(0), gpu(1))])
    apiserver.apply(f"{REPO}/deploy/deviceclasses.yaml")
    rule = unique("maintenance")
    apiserver.create({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule", "metadata": {"name": rule},
                      "spec": {"deviceSelector": {"driver": DRIVER, "pool": name, "device": "gpu-0000-1b-00-0"},
                               "taint": {"key": "example.com/maintenance", "value": "fan", "effect": "NoSchedule"}}})

    publish(apiserver, name, inv)
    ns = unique("taintrule")
    apiserver.create_namespace(ns)
    apiserver.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": ns}})
    tolerate = [{"key": "example.com/maintenance", "operator": "Exists", "effect": "NoSchedule"}]
    for claim, tolerations in (("work", None), ("burn-in", tolerate)):
        exactly = {"deviceClassName": "gpu.sysdra.io", **({"tolerations": tolerations} if tolerations else {})}
        apiserver.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": claim, "namespace": ns},
                          "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}})  # fmt: skip
        apiserver.create(_pod(ns, claim, name, claim))
        wait_for(lambda: apiserver.get("Pod", claim, ns)["spec"].get("nodeName"), f"pod {claim} bound", apiserver)
    got = {c: apiserver.get("ResourceClaim", c, ns)["status"]["allocation"]["devices"]["results"][0]["device"]
           for c in ("work", "burn-in")}
    assert got == {"work": "gpu-0000-1c-00-0", "burn-in": "gpu-0000-1b-00-0"}  # first fit would give work gpu 0
    published = [d for s in apiserver.list("ResourceSlice") if s["spec"].get("pool", {}).get("name") == name
                 for d in s["spec"].get("devices", ())]
    assert published and not any(d.get("taints") for d in published)
