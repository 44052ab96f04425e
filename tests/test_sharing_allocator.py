"""Shared devices (consumable capacity) with the scheduler's own allocator: the slices the
agent publishes with --share, deploy/deviceclasses.yaml, and claims asking for capacity.
Nothing here is allocated by hand (tests/peers/allocator, k8s.io/dynamic-resource-allocation v0.37.2)."""

from __future__ import annotations

import pytest

from agent.publish.sharing import share_plan
from tests.controlplane import Unschedulable, allocate, with_allocation
from tests.test_allocator import CLASSES, NODE, claim, devices, exactly, kind, published

GPU_PROFILE = "server-2s-gpu-nic"  # 8 x NVIDIA H100 80GB (memory 80G from the PCI ID table: 74.5Gi), 4 RDMA NICs


def shared(profile: str = GPU_PROFILE, kinds=("gpu", "nic"), policies: dict | None = None) -> list[dict]:
    return published(profile, share=share_plan(kinds, policies))


def one_gpu(slices: list[dict]) -> tuple[list[dict], str]:
    """The slices with a single GPU left (so N claims must all land on it) and its name."""
    gpu = next(n for n, d in devices(slices).items() if kind(d) == "gpu")
    for s in slices:
        s["spec"]["devices"] = [d for d in s["spec"].get("devices", []) if kind(d) != "gpu" or d["name"] == gpu]
    return slices, gpu


def gpu_share(name: str, cls: str = "gpu-share.sysdra.io", **requests: str) -> dict:
    cap = {"capacity": {"requests": requests}} if requests else {}
    return claim(name, exactly("gpu", cls, **cap))


def fill(slices: list[dict], make, limit: int = 200) -> list[dict]:
    """Allocate ``make(i)`` claims one by one until the allocator says no; -> the allocated claims."""
    allocated: list[dict] = []
    for i in range(limit):
        c = make(i)
        try:
            (a,) = allocate(slices, CLASSES, c, node=NODE, allocated=allocated)
        except Unschedulable:
            return allocated
        allocated.append(with_allocation(c, a))
    pytest.fail(f"more than {limit} claims fit")


def results(claim_obj: dict) -> list[dict]:
    return claim_obj["status"]["allocation"]["devices"]["results"]


def test_memory_shares_fit_exactly_as_capacity_and_step_allow():
    slices, gpu = one_gpu(shared())
    # 80G (74.5Gi), step 1Gi: 18Gi claims fit 4 times; compute defaults to 10 each (well within 100)
    got = fill(slices, lambda i: gpu_share(f"m{i}", memory="18Gi"))
    assert len(got) == 4
    share_ids = set()
    for c in got:
        (r,) = results(c)
        assert r["device"] == gpu and r["shareID"]
        assert r["consumedCapacity"] == {"memory": "18Gi", "compute": "10"}  # every capacity, defaults included
        share_ids.add(r["shareID"])
    assert len(share_ids) == 4


def test_requests_between_steps_are_rounded_up_as_upstream():
    slices, _ = one_gpu(shared())
    # 15.5Gi rounds up to 16Gi: four fit (64Gi of 74.5Gi), the fifth does not
    got = fill(slices, lambda i: gpu_share(f"r{i}", memory="15.5Gi"))
    assert len(got) == 4 and all(results(c)[0]["consumedCapacity"]["memory"] == "16Gi" for c in got)
    # below min is raised to min; compute 33 of 100 (step 1): three fit, not four
    got = fill(slices, lambda i: gpu_share(f"c{i}", compute="33", memory="1Mi"))
    assert len(got) == 3 and results(got[0])[0]["consumedCapacity"] == {"compute": "33", "memory": "1Gi"}


def test_requests_outside_the_policy_are_refused():
    slices, _ = one_gpu(shared())
    for too_much in ({"compute": "101"}, {"memory": "75Gi"}, {"bandwidth": "1G"}):  # over max, over value, not a GPU capacity
        with pytest.raises(Unschedulable):
            allocate(slices, CLASSES, gpu_share("no", **too_much), node=NODE)


def test_valid_values_round_up_to_the_next_value_and_refuse_above_the_last():
    policies = {"gpu": {"compute": {"value": 100, "default": 25, "validValues": [25, 50, 100]}}}
    slices, _ = one_gpu(shared(policies=policies))
    got = fill(slices, lambda i: gpu_share(f"v{i}", compute="30"))  # 30 -> 50: two fit
    assert len(got) == 2 and results(got[0])[0]["consumedCapacity"]["compute"] == "50"
    with pytest.raises(Unschedulable):
        allocate(slices, CLASSES, gpu_share("big", compute="101"), node=NODE)


def test_default_consumption_bounds_the_number_of_shares():
    slices, _ = one_gpu(shared())
    got = fill(slices, lambda i: gpu_share(f"d{i}"))  # no request: compute default 10 of 100
    assert len(got) == 10


def test_an_amd_gpu_is_shared_as_any_other():
    # AMD GPUs carry computeUnits and simdUnits (KFD topology): on a multi-allocatable device a
    # capacity without a request policy is consumed whole by every share, so one share took the GPU
    slices, gpu = one_gpu(shared("mi300x-partitions", kinds=("gpu",)))
    got = fill(slices, lambda i: gpu_share(f"a{i}"))  # compute default 10 of 100
    assert len(got) == 10
    for c in got:
        (r,) = results(c)
        assert r["device"] == gpu and r["consumedCapacity"] == {"memory": "1Gi", "compute": "10"}


def test_an_amd_gpu_with_partitions_is_shared_as_any_other():
    # --partitions --share gpu: the whole GPU (a way beside its partitions, on the same counters)
    # is published multi-allocatable, so it must keep the shared capacities and their policies
    slices = published("mi300x-partitions", share=share_plan(("gpu",), None), partitions=True)
    whole = devices(slices)["gpu-0000-05-00-0"]
    assert whole["allowMultipleAllocations"] and whole["capacity"]["compute"]["requestPolicy"]["default"] == "10"
    for s in slices:  # that GPU only (its partitions stay)
        s["spec"]["devices"] = [d for d in s["spec"].get("devices", []) if d["name"].startswith("gpu-0000-05-00-0")]
    got = fill(slices, lambda i: gpu_share(f"p{i}"))  # compute default 10 of 100
    assert len(got) == 10
    assert {results(c)[0]["device"] for c in got} == {"gpu-0000-05-00-0"}


def test_distinct_attribute_spreads_shares_over_distinct_gpus():
    slices = shared()
    by_name = devices(slices)
    two = claim("two", exactly("a", "gpu-share.sysdra.io", capacity={"requests": {"memory": "8Gi"}}),
                exactly("b", "gpu-share.sysdra.io", capacity={"requests": {"memory": "8Gi"}}),
                constraints=[{"distinctAttribute": "resource.kubernetes.io/pciBusID"}])  # fmt: skip
    (a,) = allocate(slices, CLASSES, two, node=NODE)
    picked = [r["device"] for r in a["devices"]["results"]]
    assert len(set(picked)) == 2 and all(kind(by_name[d]) == "gpu" for d in picked)
    # without the constraint both shares may come from one GPU (first fit)
    same = claim("same", exactly("a", "gpu-share.sysdra.io", capacity={"requests": {"memory": "8Gi"}}),
                 exactly("b", "gpu-share.sysdra.io", capacity={"requests": {"memory": "8Gi"}}))
    (b,) = allocate(slices, CLASSES, same, node=NODE)
    res = b["devices"]["results"]
    assert res[0]["device"] == res[1]["device"] and res[0]["shareID"] != res[1]["shareID"]
    # one GPU left: two distinct GPUs cannot be had
    only, _ = one_gpu(shared())
    with pytest.raises(Unschedulable):
        allocate(only, CLASSES, two, node=NODE)


def test_gpu_share_and_nic_share_under_one_pcie_root():
    slices = shared()
    by_name = devices(slices)
    pair = claim("pair", exactly("gpu", "gpu-share.sysdra.io", capacity={"requests": {"memory": "10Gi"}}),
                 exactly("nic", "nic-share.sysdra.io", capacity={"requests": {"bandwidth": "25G"}}),
                 constraints=[{"matchAttribute": "resource.kubernetes.io/pcieRoot"}])  # fmt: skip
    (a,) = allocate(slices, CLASSES, pair, node=NODE)
    r = {x["request"]: x for x in a["devices"]["results"]}
    root = lambda n: by_name[n]["attributes"]["resource.kubernetes.io/pcieRoot"]["string"]  # noqa: E731
    assert root(r["gpu"]["device"]) == root(r["nic"]["device"])
    assert r["nic"]["consumedCapacity"] == {"bandwidth": "25G", "slots": "1"}


def test_nic_bandwidth_and_slots_bound_the_shares():
    slices = shared()
    ten_g = next(n for n, d in devices(slices).items() if kind(d) == "nic" and d["capacity"]["bandwidth"]["value"] == "10G")
    pick = [{"cel": {"expression": f'device.attributes["sysdra.io"].pciAddress == "{devices(slices)[ten_g]["attributes"]["pciAddress"]["string"]}"'}}]
    got = fill(slices, lambda i: claim(f"n{i}", exactly("nic", "nic-share.sysdra.io", selectors=pick, capacity={"requests": {"bandwidth": "3G"}})))
    assert len(got) == 3  # 3 x 3G of 10G
    got = fill(slices, lambda i: claim(f"s{i}", exactly("nic", "nic-share.sysdra.io", selectors=pick)))
    assert len(got) == 10  # default 1G each: bandwidth runs out before the 32 slots


def test_exclusive_devices_are_unchanged_without_share():
    plain = published(GPU_PROFILE)
    assert not any("allowMultipleAllocations" in d for d in devices(plain).values())
    # an unshared GPU is allocated whole: a capacity request only has to fit its capacity
    (a,) = allocate(plain, CLASSES, gpu_share("m", "gpu.sysdra.io", memory="1Gi"), node=NODE)
    assert "shareID" not in a["devices"]["results"][0] and "consumedCapacity" not in a["devices"]["results"][0]
    with pytest.raises(Unschedulable):
        allocate(plain, CLASSES, gpu_share("big", "gpu.sysdra.io", memory="75Gi"), node=NODE)
    with pytest.raises(Unschedulable):  # and no share of it is to be had
        allocate(plain, CLASSES, gpu_share("s", memory="1Gi"), node=NODE)


def test_demo_share_claims_get_what_the_demo_hands_out(tmp_path):
    """agent/tools/demo.py plays the scheduler for its two sharing claims: the allocator agrees."""
    from agent.tools import demo
    from tests.controlplane import claim_from

    slices = published(GPU_PROFILE, list_attributes=False, share=share_plan(("gpu",), None))
    gpus = [n for n, d in devices(slices).items() if kind(d) == "gpu"]
    hand = demo.make_share_claims(str(tmp_path), gpus[1])
    allocated: list[dict] = []
    # the demo's first claim takes gpus[0] whole (its default share); the sharing claims then land where the demo says
    first = claim("train", exactly("gpu", "gpu-share.sysdra.io", capacity={"requests": {"memory": "74Gi"}}))
    (a,) = allocate(slices, CLASSES, first, node=NODE)
    allocated.append(with_allocation(first, a))
    for c in hand:
        (got,) = allocate(slices, CLASSES, claim_from(c), node=NODE, allocated=allocated)
        allocated.append(with_allocation(claim_from(c), got))
        (r,) = got["devices"]["results"]
        (want,) = c["status"]["allocation"]["devices"]["results"]
        assert (r["device"], r["consumedCapacity"]) == (want["device"], want["consumedCapacity"])


def test_deploy_sharing_examples_allocate_as_they_say():
    import os

    from tests.conftest import REPO
    from tests.controlplane import claim_from, load_yaml

    docs = {d["metadata"]["name"]: d for d in load_yaml(os.path.join(REPO, "deploy", "example-sharing.yaml"))
            if d["kind"] == "ResourceClaimTemplate"}  # fmt: skip
    slices = shared()
    by_name = devices(slices)
    # the two pods' claims share the first GPU
    small = [claim_from(docs["gpu-share-small"], name=f"infer-{x}") for x in "ab"]
    a, b = allocate(slices, CLASSES, small, node=NODE)
    ra, rb = a["devices"]["results"][0], b["devices"]["results"][0]
    assert ra["device"] == rb["device"] and ra["shareID"] != rb["shareID"]
    assert ra["consumedCapacity"] == {"memory": "10Gi", "compute": "25"}
    assert a["devices"]["config"][0]["opaque"]["parameters"]["kind"] == "GpuConfig"
    (spread,) = allocate(slices, CLASSES, claim_from(docs["gpu-shares-spread"]), node=NODE)
    assert len({r["device"] for r in spread["devices"]["results"]}) == 2
    (pair,) = allocate(slices, CLASSES, claim_from(docs["gpu-and-rdma-share"]), node=NODE)
    root = {r["request"]: by_name[r["device"]]["attributes"]["resource.kubernetes.io/pcieRoot"]["string"]
            for r in pair["devices"]["results"]}  # fmt: skip
    assert root["gpu"] == root["rdma"]
