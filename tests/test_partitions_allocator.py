"""GPU partitions under the scheduler's own allocator (tests/peers/allocator, v0.37.2): what
the counters and compatibility groups the agent publishes for the mi300x-partitions and
h100-mig fixtures let it allocate. No allocation here is written by hand."""

from __future__ import annotations

import copy

import pytest

from tests.controlplane import Unschedulable, allocate, with_allocation
from tests.test_allocator import CLASSES, NODE, claim, devices, exactly, picked, published

CPX_GPU, SPX_GPU = "gpu-0000-05-00-0", "gpu-0000-27-00-0"  # CPX/NPS1 and SPX/NPS1 in the fixture
MIG_GPU = "gpu-0000-18-00-0"


def _sel(expr: str) -> list[dict]:
    return [{"cel": {"expression": expr}}]


class Partitions(list):
    """Selectors of partitions and MIG devices: a request for them names the partition class
    (gpu.sysdra.io holds whole GPUs only, deploy/deviceclasses.yaml)."""

    device_class = PARTITION_CLASS = "gpu-partition.sysdra.io"


def whole(gpu: str) -> list[dict]:
    return _sel(f'device.attributes["sysdra.io"].pciAddress == "{gpu_bdf(gpu)}" && '
                f'!has(device.attributes["sysdra.io"].partitionOf)')


def part_of(gpu: str, mode: str | None = None) -> list[dict]:
    expr = f'device.attributes["sysdra.io"].?partitionOf.orValue("") == "{gpu}"'
    if mode:
        compute, memory = mode.split("/")
        expr += (f' && device.attributes["sysdra.io"].computePartition == "{compute}"'
                 f' && device.attributes["sysdra.io"].memoryPartition == "{memory}"')
    return Partitions(_sel(expr))


def gpu_bdf(name: str) -> str:
    return "0000:" + name[9:11] + ":" + name[12:14] + "." + name[15]


def req(name: str, selectors: list[dict], count: int = 1) -> dict:
    return exactly(name, getattr(selectors, "device_class", "gpu.sysdra.io"), selectors=selectors, count=count)


def amd(groups: bool) -> list[dict]:
    return published("mi300x-partitions", partitions=True, compatibility_groups=groups)


@pytest.mark.parametrize("groups", [False, True])
def test_whole_gpu_and_any_of_its_partitions_never_together(groups):
    slices = amd(groups)
    modes = ["CPX/NPS1", "DPX/NPS1", "QPX/NPS1"] if groups else ["CPX/NPS1"]
    for mode in modes:
        with pytest.raises(Unschedulable):  # in one claim
            allocate(slices, CLASSES, claim("both", req("w", whole(CPX_GPU)), req("p", part_of(CPX_GPU, mode))), node=NODE)
        # across claims, whichever comes first
        w = claim("w", req("w", whole(CPX_GPU)))
        (a,) = allocate(slices, CLASSES, w, node=NODE)
        assert picked(a)["w"] == [CPX_GPU]
        p = claim("p", req("p", part_of(CPX_GPU, mode)))
        with pytest.raises(Unschedulable):
            allocate(slices, CLASSES, p, node=NODE, allocated=[with_allocation(w, a)])
        (b,) = allocate(slices, CLASSES, p, node=NODE)
        with pytest.raises(Unschedulable):
            allocate(slices, CLASSES, w, node=NODE, allocated=[with_allocation(p, b)])


def test_mig_instances_without_their_whole_gpu():
    """Without NVML a GPU with MIG instances is in MIG mode, where its whole GPU is no CUDA device:
    only the instances are allocatable (as NVIDIA's own driver publishes such a GPU), never the
    whole GPU, alone or beside them."""
    slices = published("h100-mig", partitions=True)
    names = devices(slices)
    instances = sorted(n for n in names if n.startswith(MIG_GPU + "-mig-"))
    assert instances == [f"{MIG_GPU}-mig-gi1-ci0", f"{MIG_GPU}-mig-gi2-ci0", f"{MIG_GPU}-mig-gi2-ci1", f"{MIG_GPU}-mig-gi9-ci0"]
    assert MIG_GPU not in names
    all_mig = claim("all", req("m", part_of(MIG_GPU), count=4))
    (a,) = allocate(slices, CLASSES, all_mig, node=NODE)
    assert sorted(picked(a)["m"]) == instances  # every instance fits beside the others
    for alone in (False, True):
        with pytest.raises(Unschedulable):
            allocate(slices, CLASSES, claim("w", req("w", whole(MIG_GPU))), node=NODE,
                     allocated=[] if alone else [with_allocation(all_mig, a)])
    with pytest.raises(Unschedulable):
        allocate(slices, CLASSES, claim("both", req("w", whole(MIG_GPU)), req("m", part_of(MIG_GPU))), node=NODE)
    # the GPU without MIG is an ordinary whole GPU
    (c,) = allocate(slices, CLASSES, claim("other", req("g", whole("gpu-0000-3a-00-0"))), node=NODE)
    assert picked(c)["g"] == ["gpu-0000-3a-00-0"]


def test_two_modes_never_share_a_gpu_with_compatibility_groups():
    slices = amd(True)
    for first, second in (("DPX/NPS1", "CPX/NPS1"), ("CPX/NPS1", "QPX/NPS1"), ("QPX/NPS1", "DPX/NPS1")):
        a_claim = claim("a", req("a", part_of(SPX_GPU, first)))
        (a,) = allocate(slices, CLASSES, a_claim, node=NODE)
        b_claim = claim("b", req("b", part_of(SPX_GPU, second)))
        with pytest.raises(Unschedulable):  # counters alone would let these fit (1/2 + 1/8)
            allocate(slices, CLASSES, b_claim, node=NODE, allocated=[with_allocation(a_claim, a)])
        with pytest.raises(Unschedulable):
            allocate(slices, CLASSES, claim("ab", req("a", part_of(SPX_GPU, first)), req("b", part_of(SPX_GPU, second))), node=NODE)
        # the same mode does share the GPU, and the other mode still fits on the other GPU
        (c,) = allocate(slices, CLASSES, claim("c", req("c", part_of(SPX_GPU, first))), node=NODE,
                        allocated=[with_allocation(a_claim, a)])
        assert picked(c)["c"] != picked(a)["a"]
        allocate(slices, CLASSES, claim("d", req("d", part_of(CPX_GPU, second))), node=NODE, allocated=[with_allocation(a_claim, a)])


def test_any_mode_across_claims_picks_one_mode_per_gpu():
    """"Some partition of this GPU", claim after claim: the first claim's mode holds the GPU
    (first fit: the first mode listed, DPX) until its partitions are used up."""
    slices = amd(True)
    got: list[str] = []
    allocated: list[dict] = []
    for i in range(9):
        c = claim(f"any{i}", req("p", part_of(SPX_GPU)))
        try:
            (a,) = allocate(slices, CLASSES, c, node=NODE, allocated=allocated)
        except Unschedulable:
            break
        allocated.append(with_allocation(c, a))
        got += picked(a)["p"]
    assert sorted(got) == [f"{SPX_GPU}-dpx-nps1-0", f"{SPX_GPU}-dpx-nps1-1"], got


def test_a_request_by_compute_units_gets_a_partition_that_big():
    """AMD's counts as AMD's driver publishes them (KFD simd_count / simd_per_cu): an MI300X has
    304 CUs, a mode's partition its share. At least 100 CUs: a DPX partition (152), never a
    QPX (76) or CPX (38) one; the allocator reads the capacity."""
    slices = amd(True)
    caps = {name: d.get("capacity", {}) for name, d in devices(slices).items()}
    assert caps[SPX_GPU]["computeUnits"] == {"value": "304"} and caps[SPX_GPU]["simdUnits"] == {"value": "1216"}
    assert caps[CPX_GPU]["computeUnits"] == {"value": "304"}  # the sum over its eight partitions' KFD nodes
    assert caps[f"{CPX_GPU}-cpx-nps1-0"]["computeUnits"] == {"value": "38"}
    assert caps[f"{SPX_GPU}-qpx-nps1-3"]["simdUnits"] == {"value": "304"}
    def at_least(cus: int) -> Partitions:
        return Partitions(part_of(SPX_GPU) + _sel(f'device.capacity["sysdra.io"].computeUnits.compareTo(quantity("{cus}")) >= 0'))

    (a,) = allocate(slices, CLASSES, claim("big", req("p", at_least(100))), node=NODE)
    assert [caps[n]["computeUnits"]["value"] for n in picked(a)["p"]] == ["152"], picked(a)
    with pytest.raises(Unschedulable):  # no partition has more than the whole GPU
        allocate(slices, CLASSES, claim("huge", req("p", at_least(305))), node=NODE)


@pytest.mark.parametrize("groups", [False, True])
def test_as_many_partitions_of_a_mode_fit_as_counters_allow(groups):
    slices = amd(groups)
    fits = {"CPX/NPS1": 8}
    if groups:
        fits.update({"DPX/NPS1": 2, "QPX/NPS1": 4})
    for mode, n in fits.items():
        (a,) = allocate(slices, CLASSES, claim("n", req("p", part_of(CPX_GPU, mode), count=n)), node=NODE)
        assert len(set(picked(a)["p"])) == n
        with pytest.raises(Unschedulable):
            allocate(slices, CLASSES, claim("n1", req("p", part_of(CPX_GPU, mode), count=n + 1)), node=NODE)
        # one at a time, across claims, the same
        allocated: list[dict] = []
        for i in range(n):
            c = claim(f"one{i}", req("p", part_of(CPX_GPU, mode)))
            (b,) = allocate(slices, CLASSES, c, node=NODE, allocated=allocated)
            allocated.append(with_allocation(c, b))
        with pytest.raises(Unschedulable):
            allocate(slices, CLASSES, claim("extra", req("p", part_of(CPX_GPU, mode))), node=NODE, allocated=allocated)


@pytest.mark.parametrize("profile,gpu,groups", [("h100-mig", MIG_GPU, False), ("mi300x-partitions", CPX_GPU, False),
                                                ("mi300x-partitions", CPX_GPU, True)])
def test_a_tainted_gpu_taints_its_partitions(profile, gpu, groups):
    """--taint-unhealthy: an unhealthy GPU's MIG instances and CPX partitions are not scheduled either."""
    taint = {"key": "sysdra.io/unhealthy", "value": "xid-79", "effect": "NoSchedule"}
    slices = published(profile, partitions=True, compatibility_groups=groups, taints={gpu: [taint]})
    names = devices(slices)
    parts = [n for n, d in names.items() if d["attributes"].get("partitionOf") == {"string": gpu}]
    whole = [gpu] if profile != "h100-mig" else []  # a GPU in MIG mode: its MIG devices only
    assert len(parts) >= 4 and all(names[n]["taints"] == [taint] for n in [*whole, *parts])
    assert not [n for n, d in names.items() if d.get("taints") and n not in whole and n not in parts]
    with pytest.raises(Unschedulable):
        allocate(slices, CLASSES, claim("p", req("p", part_of(gpu))), node=NODE)
    tolerating = exactly("p", "gpu-partition.sysdra.io", selectors=part_of(gpu), tolerations=[{"key": taint["key"], "operator": "Exists"}])
    (a,) = allocate(slices, CLASSES, claim("p", tolerating), node=NODE)
    assert picked(a)["p"][0] in parts


@pytest.mark.parametrize("groups", [False, True])
def test_no_mode_of_another_memory_mode_is_published(groups):
    """Both GPUs run NPS1 and list NPS4 as available, where QPX and CPX run; amdgpu applies a memory
    mode only at a driver reload, so no claim can get a partition of NPS4 (tests/test_partitions_nps.py)."""
    slices = amd(groups)
    assert not [n for n in devices(slices) if "-nps4-" in n]
    for gpu in (CPX_GPU, SPX_GPU):
        for mode in ("QPX/NPS4", "CPX/NPS4"):
            with pytest.raises(Unschedulable):
                allocate(slices, CLASSES, claim("p", req("p", part_of(gpu, mode))), node=NODE)


def test_without_groups_only_what_counters_keep_correct_is_published():
    names = devices(amd(False))
    cpx = [n for n in names if n.startswith(CPX_GPU + "-")]
    assert sorted(cpx) == sorted(f"{CPX_GPU}-cpx-nps1-{i}" for i in range(8))  # the current mode only
    assert not [n for n in names if n.startswith(SPX_GPU + "-")]  # SPX: the whole GPU is its only way
    assert not any(cc.get("compatibilityGroups") for d in names.values() for cc in d.get("consumesCounters", []))


def test_grouped_devices_need_the_gate():
    """Why --compatibility-groups must follow the cluster's gate: an allocator without it skips
    every device that names a group (here: all partitions and whole GPUs of the pool)."""
    slices = amd(True)
    with pytest.raises(Unschedulable):
        allocate(slices, CLASSES, claim("p", req("p", part_of(CPX_GPU, "CPX/NPS1"))), node=NODE,
                 features={"CompatibilityGroups": False})
    allocate(slices, CLASSES, claim("p", req("p", part_of(CPX_GPU, "CPX/NPS1"))), node=NODE)


def _with_nics(slices: list[dict]) -> list[dict]:
    """``slices`` plus the NICs of another fixture node in one more slice of the same pool, as the
    agent publishes a node with partitioned GPUs and NICs (one pool per node)."""
    (nics,) = copy.deepcopy(published("server-2s-gpu-nic"))
    nics["spec"]["devices"] = [d for d in nics["spec"]["devices"] if d["name"].startswith("nic-")]
    nics["metadata"]["name"] = f"{len(slices):05d}-nics"
    out = copy.deepcopy(slices) + [nics]
    for s in out:
        s["spec"]["pool"]["resourceSliceCount"] = len(out)
    return out


@pytest.mark.parametrize("groups", [False, True])
def test_without_the_gate_grouped_slices_leave_the_whole_pool_unallocatable(groups):
    """docs/partitions.md: an allocator without DRADeviceCompatibilityGroups ignores the slices
    that name a group and counts the node's pool incomplete, so a NIC in it is not allocated
    either; with the gate (or without groups) the NIC is."""
    slices = _with_nics(amd(groups))
    nic = claim("n", exactly("n", "nic.sysdra.io"))
    allocate(slices, CLASSES, nic, node=NODE)
    if groups:
        with pytest.raises(Unschedulable):
            allocate(slices, CLASSES, nic, node=NODE, features={"CompatibilityGroups": False})
    else:
        allocate(slices, CLASSES, nic, node=NODE, features={"CompatibilityGroups": False})


def test_the_partition_demo_hands_out_what_the_allocator_picks(tmp_path):
    """fixtures/simkernel/demo.py (make demo-partitions) stands in for the scheduler."""
    from fixtures.simkernel import demo
    from tests.controlplane import claim_from

    hand = demo.make_claim(str(tmp_path))
    (allocation,) = allocate(amd(True), CLASSES, claim_from(hand), node=NODE)
    assert picked(allocation) == {"gpu": [demo.PARTITION]}
