"""Dynamic MIG under the scheduler's own allocator (tests/peers/allocator, v0.37.2): the H200's
profiles and placements as the agent publishes them (simulated NVML with the real profile
table), allocated by the allocator alone. Overlapping placements never go together, nor the
whole GPU with any MIG device, nor two media-extension instances; every combination NVML
accepts is one the allocator can give, and every one it gives NVML accepts."""

from __future__ import annotations

import pytest

from tests.controlplane import Unschedulable, allocate, with_allocation
from tests.simnvml_mig import placement
from tests.mig_node import GPU, NODE, MigNode, profile, req, whole
from tests.test_allocator import CLASSES, claim, devices


@pytest.fixture
def node(tmp_path):
    return MigNode(str(tmp_path))


def _placement(name: str) -> tuple[str, int]:
    prof, _, start = name[len(GPU) + 5:].rpartition("-")
    return prof, int(start)


def test_every_profile_and_placement_is_a_device_with_its_counters(node):
    slices = node.slices()
    names = devices(slices)
    mig = sorted(n for n in names if n.startswith(GPU + "-mig-"))
    assert len(mig) == 7 + 7 + 4 + 3 + 2 + 1 + 1  # the facts file's placements
    (counters,) = [c for s in slices for c in s["spec"].get("sharedCounters", [])]
    assert counters["name"] == GPU
    assert counters["counters"] == {**{f"memory-slice-{i}": {"value": "1"} for i in range(8)},
                                    "compute-slices": {"value": "7"}, "ofa-engines": {"value": "1"}}
    d = names[f"{GPU}-mig-3g-71gb-4"]
    assert d["attributes"]["migProfile"] == {"string": "3g.71gb"} and d["attributes"]["partitionOf"] == {"string": GPU}
    assert "uuid" not in d["attributes"] and d["attributes"]["model"] == {"string": "NVIDIA H200"}
    assert {k: v["value"] for k, v in d["capacity"].items()} == {
        "memory": "71424Mi", "multiprocessors": "60", "copyEngines": "3", "decoders": "3", "encoders": "0",
        "jpegEngines": "3", "ofaEngines": "0"}
    assert d["consumesCounters"][0]["counters"] == {**{f"memory-slice-{i}": {"value": "1"} for i in (4, 5, 6, 7)},
                                                     "compute-slices": {"value": "3"}}
    w = names[GPU]["consumesCounters"][0]["counters"]
    assert w == counters["counters"]  # the whole GPU takes everything
    assert all(len(x.get("attributes", {})) + len(x.get("capacity", {})) <= 32 for x in names.values())
    import kubernetes_validate

    for s in slices:  # resource.k8s.io/v1 as the 1.37 API server's schema takes it
        kubernetes_validate.validate(s, "1.37", strict=True)


def test_placements_never_overlap(node):
    slices = node.slices()
    # seven 1g.18gb fit, at seven different placements; an eighth does not
    (a,) = allocate(slices, CLASSES, claim("seven", req("m", profile("1g.18gb"), count=7)), node=NODE)
    assert sorted(_placement(n)[1] for n in picked(a)["m"]) == list(range(7))
    with pytest.raises(Unschedulable):
        allocate(slices, CLASSES, claim("eight", req("m", profile("1g.18gb"), count=8)), node=NODE)
    # 4g.71gb takes slices 0-3: then 3g.71gb only fits at 4, and no 2g at 0 or 2
    (b,) = allocate(slices, CLASSES, claim("big", req("m", profile("4g.71gb")), req("n", profile("3g.71gb"))), node=NODE)
    assert picked(b) == {"m": [f"{GPU}-mig-4g-71gb-0"], "n": [f"{GPU}-mig-3g-71gb-4"]}
    with pytest.raises(Unschedulable):
        allocate(slices, CLASSES, claim("c", req("m", profile("2g.35gb"), count=3)), node=NODE,
                 allocated=[with_allocation(claim("big", req("m", profile("4g.71gb")), req("n", profile("3g.71gb"))), b)])
    # two media-extension instances never (one OFA)
    with pytest.raises(Unschedulable):
        allocate(slices, CLASSES, claim("me", req("m", profile("1g.18gb+me"), count=2)), node=NODE)


def test_whole_gpu_never_beside_a_mig_device(node):
    slices = node.slices()
    with pytest.raises(Unschedulable):
        allocate(slices, CLASSES, claim("both", req("w", whole()), req("m", profile("1g.18gb"))), node=NODE)
    m = claim("m", req("m", profile("1g.18gb")))
    (a,) = allocate(slices, CLASSES, m, node=NODE)
    with pytest.raises(Unschedulable):
        allocate(slices, CLASSES, claim("w", req("w", whole())), node=NODE, allocated=[with_allocation(m, a)])
    w = claim("w", req("w", whole()))
    (b,) = allocate(slices, CLASSES, w, node=NODE)
    assert picked(b)["w"] == [GPU]
    for prof in ("1g.18gb", "1g.35gb", "7g.141gb", "1g.18gb+me"):
        with pytest.raises(Unschedulable):
            allocate(slices, CLASSES, claim("p", req("m", profile(prof))), node=NODE, allocated=[with_allocation(w, b)])


def test_a_tainted_gpu_taints_every_placement(node):
    """--taint-unhealthy: no MIG device is created on a GPU that raised XID 79."""
    taint = {"key": "sysdra.io/unhealthy", "value": "xid-79", "effect": "NoSchedule"}
    slices = node.slices(taints={GPU: [taint]})
    mig = [d for n, d in devices(slices).items() if n.startswith(GPU + "-mig-")]
    assert len(mig) == 25 and all(d["taints"] == [taint] for d in mig)
    with pytest.raises(Unschedulable):
        allocate(slices, CLASSES, claim("m", req("m", profile("1g.18gb"))), node=NODE)
    tolerating = req("m", profile("1g.18gb"))
    tolerating["exactly"]["tolerations"] = [{"key": taint["key"], "operator": "Exists"}]
    (a,) = allocate(slices, CLASSES, claim("m", tolerating), node=NODE)
    assert _placement(picked(a)["m"][0])[0] == "1g-18gb"


def test_what_the_allocator_gives_nvml_creates(node):
    """Claims one after another until the GPU is full: each allocation's placements are created
    on the simulated NVML (which refuses overlaps as the real one does) without a refusal."""
    nv = node.sim
    h = nv.nvmlDeviceGetHandleByPciBusId("0000:00:06.0")
    (gpu,) = [d for d in node.inv.devices if d.kind == "gpu"]
    profiles = gpu.gpu.partitioning.profiles
    prepared = []
    for i, prof in enumerate(["2g.35gb", "1g.18gb+me", "1g.35gb", "1g.18gb", "1g.18gb"]):
        c = claim(f"c{i}", req("m", profile(prof)))
        (a,) = allocate(node.slices(), CLASSES, c, node=NODE, allocated=prepared)
        (name,) = picked(a)["m"]
        p = next(p for p in profiles if p.name == prof)
        start = _placement(name)[1]
        nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, p.id, placement(start, dict(p.placements)[start]))
        prepared.append(with_allocation(c, a))
    with pytest.raises(Unschedulable):  # the GPU is full: 2 + 1 + 1 + 1 + 1 compute slices and slice 7 via 1g.35gb
        allocate(node.slices(), CLASSES, claim("more", req("m", profile("1g.18gb"), count=2)), node=NODE, allocated=prepared)
    assert len(nv.instances()) == 5


def picked(allocation: dict) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for r in allocation["devices"]["results"]:
        assert r["pool"] == NODE
        out.setdefault(r["request"], []).append(r["device"])
    return out
