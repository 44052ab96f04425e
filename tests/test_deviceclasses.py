"""The chart's DeviceClasses (deploy/deviceclasses.yaml) under the scheduler's own allocator
(tests/peers/allocator, v0.37.2) on the slices the agent publishes, and the real kube-apiserver.

gpu.sysdra.io and nic.sysdra.io, the classes with the extended resource names, hand out whole
devices a claim holds alone: never a GPU partition or MIG device (``partitionOf``), never a device
published shared (``allowMultipleAllocations``), whose share the scheduler's claim for
``sysdra.io/gpu: 1`` would take at the policy's default (1Gi, compute 10). gpu-partition,
gpu-share and nic-share hand out those. The classes of an API server without
DRAConsumableCapacity leave ``allowMultipleAllocations`` out (it refuses a class naming it). The
kube-scheduler's own run of this is tests/test_extended_resources.py (slow)."""

from __future__ import annotations

import pytest
import yaml

from agent.publish.sharing import share_plan
from agent.publish.slices import build_pool, render as render_slices
from discovery.inventory import scan
from tests.conftest import copy_profile
from tests.controlplane import APIError, Unschedulable, allocate, resource_path, unique, with_allocation
from tests.helm import render
from tests.simkernel import SimPciKernel
from tests.test_allocator import CLASSES, DRIVER, NODE, claim, devices, picked, published

MIG_GPU, PLAIN_GPU = "gpu-0000-18-00-0", "gpu-0000-3a-00-0"  # h100-mig: one GPU with MIG instances, one without
AMD_GPUS = ["gpu-0000-05-00-0", "gpu-0000-27-00-0"]  # mi300x-partitions: CPX/NPS1 and SPX/NPS1
REQUEST = "container-0-request-0"
ON_VFIO = {"gpu-0000-01-00-0"}  # nvidia-minor-order's first GPU (the allocator's first pick), bound below
SRIOV_ON_VFIO = {"nic-0000-06-01-0", "nic-0000-06-01-2", "accelerator-0000-3b-02-6", "accelerator-0000-3b-02-7"}


def classes(*sets: str, kube_version: str = "v1.37.2") -> list[dict]:
    return [d for d in yaml.safe_load_all(render(sets=("namespace.create=true", *sets), kube_version=kube_version))
            if d and d["kind"] == "DeviceClass"]  # fmt: skip


def extended(cls: str = "gpu.sysdra.io", count: int = 1, mode: str = "ExactCount") -> dict:
    """The request kube-scheduler makes for ``<cls's extendedResourceName>: <count>`` (no capacity, no selector)."""
    spec = {"deviceClassName": cls, "allocationMode": mode, **({"count": count} if mode == "ExactCount" else {})}
    return claim("pod-extended-resources-x", {"name": REQUEST, "exactly": spec})


def got(slices: list[dict], c: dict, classes_: list[dict] = CLASSES, **kw) -> list[str]:
    (a,) = allocate(slices, classes_, c, node=NODE, **kw)
    return picked(a)[REQUEST]


def test_the_extended_resource_classes_are_the_whole_device_classes():
    names = {c["metadata"]["name"]: c["spec"].get("extendedResourceName") for c in CLASSES}
    assert names == {"gpu.sysdra.io": "sysdra.io/gpu", "gpu-partition.sysdra.io": None, "gpu-share.sysdra.io": None,
                     "nic.sysdra.io": "sysdra.io/nic", "nic-share.sysdra.io": None, "fpga.sysdra.io": "sysdra.io/fpga",
                     "accelerator.sysdra.io": "sysdra.io/accelerator", "vfio.sysdra.io": None}  # fmt: skip


def test_a_gpu_for_the_extended_resource_is_whole_beside_mig_devices():
    slices = published("h100-mig", partitions=True)
    gpus = [n for n, d in devices(slices).items() if d["attributes"]["type"]["string"] == "gpu"]
    assert gpus[0].startswith(MIG_GPU + "-mig-")  # what the allocator meets first: a MIG instance
    assert got(slices, extended()) == [PLAIN_GPU]
    assert got(slices, extended(mode="All")) == [PLAIN_GPU]
    with pytest.raises(Unschedulable):  # one whole GPU: the MIG instances are no GPUs of this class
        got(slices, extended(count=2))
    assert sorted(got(slices, extended("gpu-partition.sysdra.io", count=4))) == sorted(n for n in gpus if n != PLAIN_GPU)


def test_all_gpus_of_a_partitioned_node_are_its_whole_gpus():
    """allocationMode All: every whole GPU, and no partition of them (which could not fit beside them)."""
    slices = published("mi300x-partitions", partitions=True, compatibility_groups=True)
    assert got(slices, extended(mode="All")) == AMD_GPUS
    part = got(slices, extended("gpu-partition.sysdra.io"))
    assert devices(slices)[part[0]]["attributes"]["partitionOf"]["string"] in AMD_GPUS


@pytest.mark.parametrize("kind", ["gpu", "nic"])
def test_a_shared_device_is_never_a_whole_one(kind):
    """``--share``: every device of the kind is published shared, and its share is what the claim
    would get (the default: 1Gi and 10% of a GPU): no whole one on this node, so the extended
    resource does not fit here. A share is asked for with the share class."""
    slices = published("server-2s-gpu-nic", share=share_plan((kind,), None))
    with pytest.raises(Unschedulable):
        got(slices, extended(f"{kind}.sysdra.io"))
    c = extended(f"{kind}-share.sysdra.io")
    (a,) = allocate(slices, CLASSES, c, node=NODE)
    (result,) = a["devices"]["results"]
    assert result["shareID"] and result["consumedCapacity"]
    # the other kind, not shared, stays whole; its share class has nothing
    other = {"gpu": "nic", "nic": "gpu"}[kind]
    (a,) = allocate(slices, CLASSES, extended(f"{other}.sysdra.io"), node=NODE)
    assert "shareID" not in a["devices"]["results"][0]
    with pytest.raises(Unschedulable):
        got(slices, extended(f"{other}-share.sysdra.io"))


def test_shares_of_one_gpu_never_keep_the_whole_class_from_knowing_it():
    """A shared GPU that some shares hold is still no whole GPU for the extended resource; taken
    shares and whole claims do not mix either way round."""
    slices = published("server-2s-gpu-nic", share=share_plan(("gpu",), None))
    share = extended("gpu-share.sysdra.io")
    (a,) = allocate(slices, CLASSES, share, node=NODE)
    with pytest.raises(Unschedulable):
        got(slices, extended(), allocated=[with_allocation(share, a)])


def gpu_for_vms_root(tmp_path) -> str:
    """A copy of nvidia-minor-order with its first GPU bound to vfio-pci by the operator (KubeVirt's VMs)."""
    root = copy_profile(tmp_path / str(len(list(tmp_path.iterdir()))), "nvidia-minor-order")
    sim = SimPciKernel(root)
    sim.unbind("nvidia", "0000:01:00.0")
    sim.bind("vfio-pci", "0000:01:00.0")
    return root


def gpu_for_vms(tmp_path, **kw) -> list[dict]:
    pool = build_pool(scan(gpu_for_vms_root(tmp_path)), node_name=NODE, driver_name=DRIVER, **kw)
    return render_slices(pool, driver_name=DRIVER, node_name=NODE, generation=1, full_name=True)


def test_a_gpu_on_vfio_pci_is_never_the_extended_resources_but_the_vfio_class_s(tmp_path):
    """Its container would get /dev/vfio/<group>, no /dev/nvidia*: CUDA finds no GPU. A device
    plugin keeps such GPUs under a resource name of their own; here that is vfio.sysdra.io."""
    slices = gpu_for_vms(tmp_path)
    gpus = {n for n, d in devices(slices).items() if d["attributes"]["type"]["string"] == "gpu"}
    assert len(gpus) == 5 and devices(slices)[min(ON_VFIO)]["attributes"]["driver"]["string"] == "vfio-pci"
    assert got(slices, extended()) != list(ON_VFIO)
    assert set(got(slices, extended(mode="All"))) == gpus - ON_VFIO
    with pytest.raises(Unschedulable):
        got(slices, extended(count=5))
    assert got(slices, extended("vfio.sysdra.io", mode="All")) == list(ON_VFIO)
    shared = gpu_for_vms(tmp_path, share=share_plan(("gpu",), None))  # nor is a share of it a container's
    assert set(got(shared, extended("gpu-share.sysdra.io", mode="All"))) == gpus - ON_VFIO


@pytest.mark.parametrize("kind", ["gpu", "nic"])
def test_a_function_on_vfio_pci_is_published_whole_where_its_kind_is_shared(tmp_path, kind):
    """``share: [gpu]`` / ``[nic]``: a function on vfio-pci goes to one VM whole (no VM takes a share of
    it, and a container's share would be /dev/vfio/<group>): published shared, no class gave it."""
    slices = gpu_for_vms(tmp_path, share=share_plan((kind,), None)) if kind == "gpu" else \
        published("sriov-nic", share=share_plan((kind,), None))
    on_vfio = ON_VFIO if kind == "gpu" else {n for n in SRIOV_ON_VFIO if n.startswith("nic-")}
    assert not any(devices(slices)[n].get("allowMultipleAllocations") for n in on_vfio)
    assert on_vfio <= set(got(slices, extended("vfio.sysdra.io", mode="All")))
    shares = got(slices, extended(f"{kind}-share.sysdra.io", mode="All"))
    assert shares and all(devices(slices)[n]["allowMultipleAllocations"] for n in shares)


def test_functions_on_vfio_pci_are_the_vfio_class_s_of_every_kind():
    """sriov-nic: two mlx5 VFs and two QAT VFs on vfio-pci; nic/accelerator.sysdra.io (sysdra.io/nic:
    a netdev expected) never give them, vfio.sysdra.io gives only them."""
    slices = published("sriov-nic")
    for cls in ("nic.sysdra.io", "accelerator.sysdra.io"):
        assert not set(got(slices, extended(cls, mode="All"))) & SRIOV_ON_VFIO, cls
    assert set(got(slices, extended("vfio.sysdra.io", mode="All"))) == SRIOV_ON_VFIO
    with pytest.raises(Unschedulable):  # the host's GPUs have no function on vfio-pci
        got(published("server-2s-gpu-nic"), extended("vfio.sysdra.io"))


def test_vendor_picks_one_vendors_gpus():
    amd = classes("deviceClasses.gpu.vendor=amd", "deviceClasses.gpuPartition.vendor=amd")
    with pytest.raises(Unschedulable):
        got(published("server-2s-gpu-nic"), extended(), amd)  # NVIDIA GPUs
    assert got(published("server-2s-gpu-nic"), extended()) != []  # (the default takes any vendor)
    mi300x = published("mi300x-partitions", partitions=True)
    assert got(mi300x, extended(mode="All"), amd) == AMD_GPUS
    assert got(mi300x, extended("gpu-partition.sysdra.io"), amd)[0].startswith(AMD_GPUS[0] + "-")
    with pytest.raises(Unschedulable):
        got(published("h100-mig", partitions=True), extended("gpu-partition.sysdra.io"), amd)


def test_consumable_capacity_follows_the_clusters_version():
    def exprs(cls: list[dict]) -> dict[str, str]:
        return {c["metadata"]["name"]: c["spec"]["selectors"][0]["cel"]["expression"] for c in cls}

    new, old = exprs(classes()), exprs(classes(kube_version="v1.35.3"))
    assert "!device.allowMultipleAllocations" in new["gpu.sysdra.io"] and "!device.allowMultipleAllocations" in new["nic.sysdra.io"]
    assert not any("allowMultipleAllocations" in e for e in old.values())
    assert set(new) - set(old) == {"gpu-share.sysdra.io", "nic-share.sysdra.io"}
    assert "allowMultipleAllocations" in new["vfio.sysdra.io"] and "vfio.sysdra.io" in old
    assert exprs(classes("deviceClasses.consumableCapacity=false")) == old
    assert exprs(classes("deviceClasses.consumableCapacity=true", kube_version="v1.35.3")) == new
    assert all("!has(device.attributes[\"sysdra.io\"].partitionOf)" in e["gpu.sysdra.io"] for e in (new, old))


def _dry_run(plane, obj: dict) -> None:
    path = resource_path(obj["kind"], None, obj["metadata"]["name"])
    plane.request("PATCH", path, body=obj, content_type="application/apply-patch+yaml",
                  params={"fieldManager": "sysdra-tests", "force": "true", "dryRun": "All"})  # fmt: skip


def test_the_server_accepts_the_classes_rendered_for_it(apiserver, older_apiserver):
    """The 1.37 server takes every class; one without DRAConsumableCapacity refuses a class that names
    device.allowMultipleAllocations (so the chart leaves it out there) and takes those rendered for it."""
    for c in classes():
        _dry_run(apiserver, c)
    for c in classes(kube_version="v1.35.3"):
        _dry_run(older_apiserver, c)
    whole = next(c for c in classes() if c["metadata"]["name"] == "gpu.sysdra.io")
    with pytest.raises(APIError) as err:
        _dry_run(older_apiserver, dict(whole, metadata={"name": unique("gpu")}))
    assert err.value.status == 422 and "allowMultipleAllocations" in str(err.value)
