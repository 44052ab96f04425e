"""The scheduler's own allocator (k8s.io/dynamic-resource-allocation/structured v0.37.2, the
code kube-scheduler runs; tests/peers/allocator) allocates claims from the ResourceSlices the
agent publishes, with deploy/deviceclasses.yaml. No allocation here is written by hand."""

from __future__ import annotations

import copy
import json
import os

import pytest

from agent.publish.slices import build_pool, render
from discovery.inventory import scan
from tests.conftest import REPO, profile_root, profiles
from tests.controlplane import Unschedulable, allocate, claim_from, load_yaml, run_allocator, with_allocation

DRIVER, NODE = "sysdra.io", "node-a"
CLASSES = load_yaml(os.path.join(REPO, "deploy", "deviceclasses.yaml"))
EXAMPLE = next(d for d in load_yaml(os.path.join(REPO, "deploy", "example-claim.yaml")) if d["kind"] == "ResourceClaimTemplate")


def published(profile: str, node: str = NODE, **kw) -> list[dict]:
    """The ResourceSlices the agent would publish for a fixture node (as ``sysdra scan -o slices``)."""
    kw.setdefault("list_attributes", True)
    inv = scan(profile_root(profile), list_attributes=kw["list_attributes"])
    pool = build_pool(inv, node_name=node, driver_name=DRIVER, **kw)
    return render(pool, driver_name=DRIVER, node_name=node, generation=1, full_name=True)


def devices(slices: list[dict]) -> dict[str, dict]:
    return {d["name"]: d for s in slices for d in s["spec"].get("devices", [])}


def kind(device: dict) -> str:
    return device["attributes"]["type"]["string"]


def claim(name: str, *requests: dict, constraints: list[dict] | None = None) -> dict:
    spec: dict = {"devices": {"requests": list(requests)}}
    if constraints:
        spec["devices"]["constraints"] = constraints
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name, "namespace": "default"}, "spec": spec}


def exactly(name: str, cls: str, **kw) -> dict:
    return {"name": name, "exactly": {"deviceClassName": cls, **kw}}


def picked(allocation: dict) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for r in allocation["devices"]["results"]:
        assert r["driver"] == DRIVER and r["pool"] == NODE
        out.setdefault(r["request"], []).append(r["device"])
    return out


# --- deploy/example-claim.yaml ----------------------------------------------------------------
@pytest.mark.parametrize("profile", profiles())
def test_example_claim_allocates_one_gpu_and_one_nic_where_the_node_has_them(profile):
    slices = published(profile)
    kinds = {kind(d) for d in devices(slices).values()}
    if not {"gpu", "nic"} <= kinds:
        with pytest.raises(Unschedulable):
            allocate(slices, CLASSES, claim_from(EXAMPLE), node=NODE)
        return
    (allocation,) = allocate(slices, CLASSES, claim_from(EXAMPLE), node=NODE)
    got = picked(allocation)
    by_name = devices(slices)
    assert kind(by_name[got["gpu"][0]]) == "gpu" and kind(by_name[got["nic"][0]]) == "nic"
    # the result pins the claim to our node, as the scheduler writes it
    terms = allocation["nodeSelector"]["nodeSelectorTerms"]
    assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}]


def test_each_device_class_selects_exactly_its_kind():
    slices = published("server-2s-gpu-nic") + published("sriov-nic") + published("alveo")
    # three nodes' worth of slices under one node name would clash: keep one pool per class test
    for profile, cls, want in (("server-2s-gpu-nic", "gpu.sysdra.io", "gpu"), ("server-2s-gpu-nic", "nic.sysdra.io", "nic"),
                               ("alveo", "fpga.sysdra.io", "fpga"), ("accel-gaudi", "accelerator.sysdra.io", "accelerator")):
        slices = published(profile)
        n = sum(kind(d) == want for d in devices(slices).values())
        (allocation,) = allocate(slices, CLASSES, claim("all", exactly("all", cls, allocationMode="All")), node=NODE)
        got = picked(allocation)["all"]
        assert len(got) == n and all(kind(devices(slices)[d]) == want for d in got), (profile, cls)


# --- the demo claim (agent/tools/demo.py) --------------------------------------------------
def test_demo_claim_gets_what_the_demo_hands_out(tmp_path):
    from agent.tools import demo

    slices = published("server-2s-gpu-nic", list_attributes=False)
    names = [d["name"] for s in slices for d in s["spec"].get("devices", [])]
    gpus, nics = [n for n in names if n.startswith("gpu-")], [n for n in names if n.startswith("nic-")]
    hand = demo.make_claim(str(tmp_path), gpus[0], nics[0])  # the demo's stand-in for the scheduler
    (allocation,) = allocate(slices, CLASSES, claim_from(hand), node=NODE)
    want = {r["request"]: [r["device"]] for r in hand["status"]["allocation"]["devices"]["results"]}
    assert picked(allocation) == want


# --- already-allocated devices, constraints, counters ----------------------------------------
def test_allocated_devices_are_not_handed_out_twice():
    slices = published("server-2s-gpu-nic")
    gpus = [n for n, d in devices(slices).items() if kind(d) == "gpu"]
    allocated: list[dict] = []
    for i in range(len(gpus)):
        c = claim(f"one-gpu-{i}", exactly("gpu", "gpu.sysdra.io"))
        (allocation,) = allocate(slices, CLASSES, c, node=NODE, allocated=allocated)
        allocated.append(with_allocation(c, allocation))
    assert sorted(picked(a["status"]["allocation"])["gpu"][0] for a in allocated) == sorted(gpus)
    with pytest.raises(Unschedulable):
        allocate(slices, CLASSES, claim("one-too-many", exactly("gpu", "gpu.sysdra.io")), node=NODE, allocated=allocated)


def test_pcie_root_constraint_pairs_gpu_and_nic_behind_one_root():
    slices = published("server-2s-gpu-nic")
    by_name = devices(slices)
    root = lambda name: by_name[name]["attributes"]["resource.kubernetes.io/pcieRoot"]["string"]  # noqa: E731
    # both GPUs behind the first root are taken: the pair must move to the next root together
    first = [n for n, d in by_name.items() if kind(d) == "gpu" and root(n) == root(next(iter(by_name)))]
    taken = claim("taken", exactly("gpu", "gpu.sysdra.io", count=len(first)))
    (a,) = allocate(slices, CLASSES, taken, node=NODE)
    assert sorted(picked(a)["gpu"]) == sorted(first)
    pair = claim("pair", exactly("gpu", "gpu.sysdra.io"), exactly("nic", "nic.sysdra.io"),
                 constraints=[{"matchAttribute": "resource.kubernetes.io/pcieRoot"}])  # fmt: skip
    (b,) = allocate(slices, CLASSES, pair, node=NODE, allocated=[with_allocation(taken, a)])
    got = picked(b)
    assert root(got["gpu"][0]) == root(got["nic"][0]) != root(first[0])


def test_pcie_switch_constraint_pairs_gpu_and_nic_behind_one_switch():
    """``sysdra.io/pcieSwitch``: on the server each switch holds two GPUs and a NIC (the pair is
    found); on the workstation every device shares the root complex but no GPU shares a switch
    with a NIC, so the same claim is unschedulable there while a pcieRoot pair is not."""
    pair = lambda attribute: claim("pair", exactly("gpu", "gpu.sysdra.io"), exactly("nic", "nic.sysdra.io"),  # noqa: E731
                                   constraints=[{"matchAttribute": attribute}])
    slices = published("server-2s-gpu-nic")
    by_name = devices(slices)
    (a,) = allocate(slices, CLASSES, pair("sysdra.io/pcieSwitch"), node=NODE)
    got = picked(a)
    assert by_name[got["gpu"][0]]["attributes"]["pcieSwitch"] == by_name[got["nic"][0]]["attributes"]["pcieSwitch"]
    slices = published("workstation-deep-bridges")
    allocate(slices, CLASSES, pair("resource.kubernetes.io/pcieRoot"), node=NODE)
    with pytest.raises(Unschedulable):
        allocate(slices, CLASSES, pair("sysdra.io/pcieSwitch"), node=NODE)


def test_numa_list_attribute_constraint_is_understood_by_the_allocator():
    # --list-attributes publishes numaNode as a list; DRAListTypeAttributes matches on overlap
    slices = published("server-2s-gpu-nic", list_attributes=True)
    by_name = devices(slices)
    c = claim("numa", exactly("gpu", "gpu.sysdra.io", count=4), exactly("nic", "nic.sysdra.io", count=2),
              constraints=[{"matchAttribute": "resource.kubernetes.io/numaNode"}])  # fmt: skip
    (allocation,) = allocate(slices, CLASSES, c, node=NODE)
    got = [d for ds in picked(allocation).values() for d in ds]
    common = set.intersection(*(set(by_name[d]["attributes"]["resource.kubernetes.io/numaNode"]["ints"]) for d in got))
    assert common and len(got) == 6
    with pytest.raises(Unschedulable):  # 5 GPUs never share a NUMA node on this 4+4 machine
        allocate(slices, CLASSES, claim("numa5", exactly("gpu", "gpu.sysdra.io", count=5),
                                        constraints=[{"matchAttribute": "resource.kubernetes.io/numaNode"}]), node=NODE)  # fmt: skip


def test_pf_vf_counters_keep_a_pf_and_its_vfs_apart():
    slices = published("sriov-nic", pf_vf_exclusive=True)
    by_name = devices(slices)
    counter_sets = {cs["name"] for s in slices for cs in s["spec"].get("sharedCounters", [])}
    assert counter_sets, "pf_vf_exclusive publishes counter sets"
    pf = next(n for n, d in by_name.items()
              if kind(d) == "nic" and any(c["counters"]["functions"]["value"] != "1" for c in d.get("consumesCounters", [])))  # fmt: skip
    pf_set = by_name[pf]["consumesCounters"][0]["counterSet"]
    vfs = [n for n, d in by_name.items() if n != pf and any(c["counterSet"] == pf_set for c in d.get("consumesCounters", []))]
    vfio = [n for n in vfs if by_name[n]["attributes"]["driver"]["string"] == "vfio-pci"]  # vfio.sysdra.io's, not nic's
    vfs = [n for n in vfs if n not in vfio]
    assert vfs and vfio
    pf_pci = by_name[pf]["attributes"]["pciAddress"]["string"]
    want_pf = claim("pf", exactly("pf", "nic.sysdra.io", selectors=[{"cel": {"expression": f'device.attributes["sysdra.io"].pciAddress == "{pf_pci}"'}}]))
    (a,) = allocate(slices, CLASSES, want_pf, node=NODE)
    assert picked(a)["pf"] == [pf]
    one_vf = claim("vf", exactly("vf", "nic.sysdra.io", selectors=[
        # a PF has no pfPciAddress: a plain field access would be a CEL runtime error on it
        {"cel": {"expression": f'device.attributes["sysdra.io"].?pfPciAddress.orValue("") == "{pf_pci}"'}}]))  # fmt: skip
    with pytest.raises(Unschedulable):  # the PF holds the whole counter: none of its VFs fit
        allocate(slices, CLASSES, one_vf, node=NODE, allocated=[with_allocation(want_pf, a)])
    # without the PF taken, all of its VFs fit together, and then the PF does not
    all_vfs = copy.deepcopy(one_vf)
    all_vfs["spec"]["devices"]["requests"][0]["exactly"].update(allocationMode="All")
    (b,) = allocate(slices, CLASSES, all_vfs, node=NODE)
    assert sorted(picked(b)["vf"]) == sorted(vfs)
    with pytest.raises(Unschedulable):
        allocate(slices, CLASSES, want_pf, node=NODE, allocated=[with_allocation(all_vfs, b)])
    vm = copy.deepcopy(one_vf)  # a VF on vfio-pci, for a VM, keeps the PF out as well
    vm["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "vfio.sysdra.io"
    (c,) = allocate(slices, CLASSES, vm, node=NODE)
    assert picked(c)["vf"][0] in vfio
    with pytest.raises(Unschedulable):
        allocate(slices, CLASSES, want_pf, node=NODE, allocated=[with_allocation(vm, c)])


def test_tainted_device_is_not_allocated():
    slices_plain = published("vm-numa-none")
    gpu = next(n for n, d in devices(slices_plain).items() if kind(d) == "gpu")
    taint = {"key": "sysdra.io/unhealthy", "value": "true", "effect": "NoSchedule"}
    slices = published("vm-numa-none", taints={gpu: [taint]})
    assert devices(slices)[gpu]["taints"][0]["key"] == taint["key"]
    c = claim("gpu", exactly("gpu", "gpu.sysdra.io"))
    with pytest.raises(Unschedulable):
        allocate(slices, CLASSES, c, node=NODE)
    tolerating = claim("gpu", exactly("gpu", "gpu.sysdra.io", tolerations=[{"key": "sysdra.io/unhealthy", "operator": "Exists"}]))
    (a,) = allocate(slices, CLASSES, tolerating, node=NODE)
    assert picked(a)["gpu"] == [gpu]


def test_incomplete_pool_is_not_allocated_from():
    slices = published("server-2s-gpu-nic")
    for s in slices:
        s["spec"]["pool"]["resourceSliceCount"] += 1  # one slice of the pool not seen yet
    with pytest.raises(Unschedulable):
        allocate(slices, CLASSES, claim("gpu", exactly("gpu", "gpu.sysdra.io")), node=NODE)


def test_slices_of_another_node_are_not_allocated_from():
    slices = published("server-2s-gpu-nic", node="node-b")
    with pytest.raises(Unschedulable):
        allocate(slices, CLASSES, claim("gpu", exactly("gpu", "gpu.sysdra.io")), node=NODE)


def test_allocator_reports_its_implementation_and_every_feature():
    out = run_allocator({"resourceSlices": published("vm-numa-none"), "deviceClasses": CLASSES, "nodeName": NODE,
                         "claim": claim("gpu", exactly("gpu", "gpu.sysdra.io"))})  # fmt: skip
    assert out["allocator"] == "experimental"
    for feature in ("DRAPartitionableDevices", "DRAConsumableCapacity", "DRADeviceTaints", "DRAListTypeAttributes",
                    "DRADeviceCompatibilityGroups", "DRAPrioritizedList", "DRAAdminAccess", "DRAOptionalNodeOperations"):
        assert feature in out["features"]


def test_allocator_rejects_fields_the_v137_api_does_not_have():
    slices = published("vm-numa-none")
    slices[0]["spec"]["devices"][0]["notAField"] = True
    with pytest.raises(RuntimeError, match="notAField"):
        allocate(slices, CLASSES, claim("gpu", exactly("gpu", "gpu.sysdra.io")), node=NODE)


# --- make allocate (tests/allocate.py) --------------------------------------------------------
def test_make_allocate_prints_the_allocation_for_a_profile(capsys):
    from tests import allocate as tool

    assert tool.main(["--profile", "server-2s-gpu-nic", "--node", NODE]) == 0
    allocation = json.loads(capsys.readouterr().out)
    assert picked(allocation) == {"gpu": ["gpu-0000-18-00-0"], "nic": ["nic-0000-1a-00-0"]}
    assert tool.main(["--profile", "alveo"]) == 2  # no GPU there: unschedulable, said on stderr
    assert "unschedulable" in capsys.readouterr().err


def test_make_allocate_reads_an_offline_cluster_dir(tmp_path, capsys):
    from tests import allocate as tool

    d = tmp_path / "cluster" / "resourceslices"
    d.mkdir(parents=True)
    for obj in published("vm-numa-none"):
        (d / f"{obj['metadata']['name']}.json").write_text(json.dumps(obj))
    assert tool.main(["--slices", str(tmp_path / "cluster")]) == 0
    got = picked(json.loads(capsys.readouterr().out))
    assert set(got) == {"gpu", "nic"}
