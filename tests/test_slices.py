"""Slice building: naming, chunking, per-device validation, API-schema validity."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest

from agent.publish import slices
from agent.publish.validation import device_problems, parse_quantity, qualified_name_problem
from agent.settings import Settings
from discovery.models import AttributeValue, Inventory
from discovery.gpuways import whole_unusable
from tests.conftest import profile_root, profiles
from tests.inventory_factory import device, inventory, sriov_inventory

DRIVER, NODE = "sysdra.io", "node-a"
SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def build(inv, **kw):
    kw.setdefault("list_attributes", True)
    return slices.build_pool(inv, node_name=NODE, driver_name=DRIVER, **kw)


def rendered(pool, generation=1, uid="1234-uid"):
    return slices.render(pool, driver_name=DRIVER, node_name=NODE, generation=generation, node_uid=uid, full_name=True)


def assert_api_valid(objs):
    for obj in objs:
        kubernetes_validate.validate(obj, "1.37", strict=True)
        assert len(obj["metadata"]["name"]) <= 63 and SUBDOMAIN.match(obj["metadata"]["name"])


# --- naming -------------------------------------------------------------------------------
def test_generate_name_width_follows_slice_count():
    assert slices.generate_name(0, 1, DRIVER, NODE) == "00000-sysdra.io-node-a-"
    assert slices.generate_name(0x1a, 0x20, DRIVER, NODE) == "0001a-sysdra.io-node-a-"
    assert slices.generate_name(3, 0x100001, DRIVER, NODE).startswith("000003-")


def test_parse_index_rejects_foreign_and_out_of_range_names():
    assert slices.parse_index("00002-sysdra.io-node-a-xyz12", 3) == 2
    assert slices.parse_index("00003-sysdra.io-node-a-xyz12", 3) is None  # out of range
    assert slices.parse_index("0002-sysdra.io-node-a-xyz12", 3) is None  # wrong width
    assert slices.parse_index("node-a-sysdra.io-abcde", 3) is None  # random (pre-index) names
    assert slices.parse_index("0000g-x", 3) is None


def test_offline_names_deterministic_and_like_generate_name():
    long_node = "n" * 200
    a = slices.offline_name(slices.generate_name(0, 1, DRIVER, long_node))
    assert a == slices.offline_name(slices.generate_name(0, 1, DRIVER, long_node))
    assert len(a) == 63 and a.startswith("00000-sysdra.io-nnn")
    assert slices.offline_name("00000-x-") != slices.offline_name("00001-x-")


def test_names_sort_in_pool_order():
    pool = build(inventory(400))
    names = [s["metadata"]["name"] for s in rendered(pool)]
    assert names == sorted(names)


# --- chunking -----------------------------------------------------------------------------
def test_chunks_of_128_plain_devices():
    pool = build(inventory(300))
    assert [len(s["devices"]) for s in pool.slices] == [128, 128, 44]


def test_chunks_of_64_when_list_attributes():
    inv = inventory(150, attributes={"resource.kubernetes.io/numaNode": AttributeValue(ints=(0, 1))})
    assert [len(s["devices"]) for s in build(inv).slices] == [64, 64, 22]


def test_advanced_device_closes_a_large_plain_chunk():
    devs = list(inventory(100).devices) + [device(200, attributes={"numas": AttributeValue(ints=(0,))})]
    pool = build(Inventory(root="/", devices=tuple(devs)))
    assert [len(s["devices"]) for s in pool.slices] == [100, 1]


def test_plain_devices_after_a_full_advanced_chunk_get_128_again():
    """The limit of 64 belongs to a slice holding an advanced device; the next slice, all plain,
    holds 128 again (no more slices than the API server needs)."""
    numa = {"numas": AttributeValue(ints=(0,))}
    devs = [device(i, attributes=numa) for i in range(64)] + [device(i) for i in range(64, 164)]
    pool = build(Inventory(root="/", devices=tuple(devs)))
    assert [len(s["devices"]) for s in pool.slices] == [64, 100]


def test_empty_inventory_publishes_one_empty_slice():
    pool = build(Inventory(root="/"))
    assert pool.slices == ({"devices": []},)
    assert_api_valid(rendered(pool))


def test_render_sets_pool_node_owner():
    objs = rendered(build(inventory(130)), generation=7)
    for obj in objs:
        spec = obj["spec"]
        assert spec["pool"] == {"name": NODE, "generation": 7, "resourceSliceCount": 2}
        assert spec["nodeName"] == NODE and spec["driver"] == DRIVER
        assert obj["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "1234-uid", "controller": True}
        ]
    no_uid = slices.render(build(inventory(1)), driver_name=DRIVER, node_name=NODE, generation=1)
    assert "ownerReferences" not in no_uid[0]["metadata"] and no_uid[0]["metadata"]["generateName"].endswith("-node-a-")


# --- per-device validation ----------------------------------------------------------------
BAD_DEVICES = {
    "name": dict(name="GPU_0"),
    "attribute name": dict(attributes={"bad-name": AttributeValue(string="x")}),
    "domain": dict(attributes={"Not_A.Domain/x": AttributeValue(string="x")}),
    "two slashes": dict(attributes={"a.io/b/c": AttributeValue(string="x")}),
    "long id": dict(attributes={"x" * 33: AttributeValue(int_=1)}),
    "string length": dict(attributes={"s": AttributeValue(string="é" * 33)}),  # 66 bytes
    "version": dict(attributes={"v": AttributeValue(version="1.2")}),
    "too many entries": dict(attributes={f"a{i}": AttributeValue(int_=i) for i in range(30)}),
    "too many values": dict(attributes={"l": AttributeValue(ints=tuple(range(47)))}),
    "quantity": dict(capacity={"memory": "12 GiB"}),
    "duplicate with domain": dict(attributes={"x": AttributeValue(int_=1), "sysdra.io/x": AttributeValue(int_=2)}),
}


@pytest.mark.parametrize("case", sorted(BAD_DEVICES))
def test_bad_device_left_out_others_kept(case):
    good = inventory(3).devices
    bad = device(50, **BAD_DEVICES[case])
    pool = build(Inventory(root="/", devices=(good[0], bad, *good[1:])))
    assert [d["name"] for d in pool.slices[0]["devices"]] == [d.name for d in good]
    assert [name for name, _ in pool.rejected] == [bad.name]
    assert_api_valid(rendered(pool))


@pytest.mark.parametrize("case", sorted(BAD_DEVICES))
def test_a_bad_value_shared_by_devices_rejects_each_of_them(case):
    """A bad value that several devices share (discovery shares value objects) keeps every
    one of them out."""
    good = inventory(2).devices
    shared = BAD_DEVICES[case]
    bad = [device(50 + i, **shared) for i in range(3)]  # the very same value objects
    pool = build(Inventory(root="/", devices=(bad[0], good[0], bad[1], good[1], bad[2])))
    assert [d["name"] for d in pool.slices[0]["devices"]] == [d.name for d in good]
    assert [name for name, _ in pool.rejected] == [d.name for d in bad]


def test_limits_exactly_at_the_edge_are_accepted():
    # 3 standard attributes from the factory + 28 + 1 capacity = 32 entries
    dev = device(1, attributes={f"a{i}": AttributeValue(int_=i) for i in range(28)}, capacity={"memory": "80Gi"})
    assert device_problems(dev.to_api(), DRIVER, list_attributes=True) == []
    # 3 scalars + 45 list values = 48 values, 64-byte strings
    dev = device(1, attributes={"l": AttributeValue(strings=tuple("x" * 64 for _ in range(45)))})
    assert device_problems(dev.to_api(), DRIVER, list_attributes=True) == []
    dev = device(1, attributes={"l": AttributeValue(strings=tuple("x" * 64 for _ in range(46)))})
    assert device_problems(dev.to_api(), DRIVER, list_attributes=True) == ["49 attribute values, at most 48"]


def test_list_attribute_rejected_when_lists_are_off():
    dev = device(1, attributes={"l": AttributeValue(ints=(1,))})
    assert build(Inventory(root="/", devices=(dev,)), list_attributes=False).rejected


def test_duplicate_device_names_in_pool():
    a, b = device(1, name="gpu-x"), device(2, name="gpu-x")
    pool = build(Inventory(root="/", devices=(a, b)))
    assert len(pool.slices[0]["devices"]) == 1 and pool.rejected[0][0] == "gpu-x"


@pytest.mark.parametrize("text,value", [("1", 1), ("1Gi", 2**30), ("500m", 0.5), ("1e3", 1000), ("1.5k", 1500), (".5", 0.5)])
def test_quantity_parse(text, value):
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "1 Gi", "Gi", "1GB", "1.2.3", "0x10"])
def test_quantity_rejects(text):
    with pytest.raises(ValueError):
        parse_quantity(text)


def test_qualified_names():
    assert qualified_name_problem("resource.kubernetes.io/pciBusID") is None
    assert qualified_name_problem("_x9") is None
    assert qualified_name_problem("9x") and qualified_name_problem("a/") and qualified_name_problem("/x")


# --- SR-IOV -------------------------------------------------------------------------------
def test_vfs_are_devices_with_their_pf_bdf():
    pool = build(sriov_inventory(pfs=1, vfs=2))
    devs = pool.slices[0]["devices"]
    assert len(devs) == 3
    assert devs[1]["attributes"]["pfPciAddress"] == {"string": "0000:00:00.0"}
    assert "consumesCounters" not in devs[1]


def test_pf_attribute_added_when_discovery_lacks_it():
    inv = sriov_inventory(pfs=1, vfs=1)
    vf = inv.devices[1]
    attrs = {k: v for k, v in vf.attributes.items() if k != "pfPciAddress"}
    inv = Inventory(root="/", devices=(inv.devices[0], vf.replace(attributes=attrs)))
    assert build(inv).slices[0]["devices"][1]["attributes"][slices.PF_ATTRIBUTE] == {"string": "0000:00:00.0"}


def test_pf_vf_exclusive_counters():
    pool = build(sriov_inventory(pfs=10, vfs=4), pf_vf_exclusive=True)
    counter_slices = [s for s in pool.slices if "sharedCounters" in s]
    assert [len(s["sharedCounters"]) for s in counter_slices] == [8, 2]  # <= 8 counter sets per slice
    device_slices = [s for s in pool.slices if "devices" in s]
    assert all("sharedCounters" not in s for s in device_slices)
    devs = [d for s in device_slices for d in s["devices"]]
    assert len(devs) == 50 and all(len(s["devices"]) <= 64 for s in device_slices)
    pf, vf = devs[0], devs[1]
    assert pf["consumesCounters"] == [{"counterSet": "pf-0000-00-00-0", "counters": {"functions": {"value": "4"}}}]
    assert vf["consumesCounters"] == [{"counterSet": "pf-0000-00-00-0", "counters": {"functions": {"value": "1"}}}]
    assert {"name": "pf-0000-00-00-0", "counters": {"functions": {"value": "4"}}} in counter_slices[0]["sharedCounters"]
    assert_api_valid(rendered(pool))


# --- API schema on every fixture profile --------------------------------------------------
@pytest.mark.parametrize("profile", profiles() or ["<none>"])
@pytest.mark.parametrize("list_attributes", [False, True])
@pytest.mark.parametrize("exclusive", [False, True])
def test_fixture_profiles_validate_strictly(profile, list_attributes, exclusive):
    if profile == "<none>":
        pytest.skip("no fixture profiles yet")
    from discovery.inventory import scan

    inv = scan(profile_root(profile), list_attributes=list_attributes)
    pool = build(inv, list_attributes=list_attributes, pf_vf_exclusive=exclusive)
    assert pool.rejected == (), pool.rejected  # discovery should never produce an invalid device
    objs = rendered(pool)
    assert_api_valid(objs)
    # every device, but a whole GPU in MIG mode (h100-mig's first: its MIG devices, with --partitions)
    in_mig_mode = [d.name for d in inv.devices if whole_unusable(d)]
    assert in_mig_mode == (["gpu-0000-18-00-0"] if profile == "h100-mig" else [])
    assert sum(len(s.get("devices", [])) for s in pool.slices) == len(inv.devices) - len(in_mig_mode)


def test_a_whole_gpu_in_mig_mode_is_never_published():
    """Without NVML, a GPU whose MIG instances procfs lists is in MIG mode: CUDA sees no device
    on its whole GPU, so it is left out (not rejected: it is no invalid device), with or without
    --partitions; its MIG instances are published with --partitions; the GPU beside it is whole."""
    from discovery.inventory import scan

    inv = scan(profile_root("h100-mig"))
    for partitions in (False, True):
        pool = build(inv, partitions=partitions)
        names = [d["name"] for s in pool.slices for d in s.get("devices", [])]
        assert "gpu-0000-18-00-0" not in names and "gpu-0000-3a-00-0" in names and pool.rejected == ()
        assert len([n for n in names if n.startswith("gpu-0000-18-00-0-mig-")]) == (4 if partitions else 0)


def test_slices_list_is_a_kubernetes_list():
    settings = Settings(node_name=NODE, cluster="dir:/tmp/x")
    out = slices.slices_list(inventory(3), settings)
    assert out["apiVersion"] == "v1" and out["kind"] == "List" and len(out["items"]) == 1
    kubernetes_validate.validate(out["items"][0], "1.37", strict=True)


# --- sticky placement (agent.publish.slices.chunk_devices with previous) and the fast encoder ---------

def _plain(n: int, start: int = 0) -> list[dict]:
    return [{"name": f"dev-{i:05d}"} for i in range(start, start + n)]


def test_sticky_removal_changes_one_slice():
    from agent.publish.slices import chunk_devices

    devices = _plain(300)
    before = chunk_devices(devices)
    assert [len(c) for c in before] == [128, 128, 44]
    after = chunk_devices(devices[:10] + devices[11:], before)  # dev-00010 removed
    assert sum(a != b for a, b in zip(before, after)) == 1 and len(after) == 3
    assert chunk_devices(devices[:10] + devices[11:]) != after  # a fresh split shifts every later slice


def test_sticky_addition_fills_first_hole_then_appends():
    from agent.publish.slices import chunk_devices

    devices = _plain(300)
    before = chunk_devices(devices)
    without = [d for d in devices if d["name"] != "dev-00005"]
    holed = chunk_devices(without, before)
    new = {"name": "dev-99999"}
    after = chunk_devices(without + [new], holed)
    assert new in after[0] and after[1:] == holed[1:]
    full = chunk_devices(devices + _plain(100, 1000), before)
    assert full[:2] == before[:2] and len(full[2]) == 128 and len(full) == 4


def test_sticky_respects_advanced_limit_and_compacts():
    from agent.publish.slices import MAX_DEVICES_ADVANCED, chunk_devices

    devices = _plain(128)
    before = chunk_devices(devices)
    tainted = [dict(d, taints=[{"key": "k", "effect": "NoSchedule"}]) if i == 0 else d for i, d in enumerate(devices)]
    after = chunk_devices(tainted, before)
    assert len(after[0]) == MAX_DEVICES_ADVANCED and sum(map(len, after)) == 128
    # holes everywhere: many slices, few devices -> split afresh
    spread = chunk_devices(_plain(1280), None)
    few = [spread[i][0] for i in range(len(spread))]
    assert chunk_devices(few, spread) == chunk_devices(few)


def test_sticky_pool_through_build_pool(tmp_path):
    from agent.publish.slices import build_pool
    from discovery.inventory import scan
    from tests.conftest import profile_root

    inv = scan(profile_root("sriov-nic"))
    cache: dict = {}
    pool = build_pool(inv, node_name="n", driver_name="sysdra.io", cache=cache)
    again = build_pool(inv, node_name="n", driver_name="sysdra.io", cache=cache, previous=pool)
    assert again == pool == build_pool(inv, node_name="n", driver_name="sysdra.io")


def test_cached_entries_follow_the_settings_and_taints():
    """The entry cache (kept by the daemon across builds) is no reason to publish what the
    settings now forbid: after the list-attributes fallback a device with a list attribute is
    left out, and a device's new taint is published."""
    inv = inventory(2, attributes={"numas": AttributeValue(ints=(0, 1))})
    cache: dict = {}
    assert [d["name"] for d in build(inv, cache=cache).slices[0]["devices"]] == [d.name for d in inv.devices]
    taint = {"key": "sysdra.io/unhealthy", "value": "xid-79", "effect": "NoSchedule"}
    tainted = build(inv, cache=cache, taints={inv.devices[0].name: [taint]})
    assert [d.get("taints") for d in tainted.slices[0]["devices"]] == [[taint], None]
    off = build(inv, cache=cache, list_attributes=False)
    assert off.slices == ({"devices": []},) and [name for name, _ in off.rejected] == [d.name for d in inv.devices]


def test_the_whole_partitionable_gpu_stays_within_32_attributes_and_capacities():
    """With --partitions the whole AMD GPU gets computePartition and memoryPartition on top of its
    own attributes. A GPU holding 32 attributes and capacities already (the operator's
    device_attributes fill it up to the API's limit) went out with 34, unchecked: kube-apiserver
    refuses the whole slice, every device of it, and the publisher retries it for ever. It leaves out
    what a partition leaves out first (docs/partitions.md), and every device published passes."""
    from discovery.extra_attributes import ExtraAttributes
    from discovery.inventory import scan

    extra = ExtraAttributes.parse([{"match": ["kind:gpu"], "attributes": {f"site{i}": "x" for i in range(14)}}])
    inv = scan(profile_root("mi300x-partitions"), list_attributes=False, extra_attributes=extra)
    gpu = next(d for d in inv.devices if d.name == "gpu-0000-05-00-0")
    assert len(gpu.attributes) + len(gpu.capacity) == 32
    pool = build(inv, list_attributes=False, partitions=True)
    published = {d["name"]: d for s in pool.slices for d in s.get("devices", [])}
    for name, d in published.items():
        assert device_problems(d, DRIVER, False) == [], name
    whole = published["gpu-0000-05-00-0"]  # still published, as the docs say, with its mode
    assert whole["attributes"]["computePartition"] == {"string": "SPX"}
    assert whole["attributes"]["memoryPartition"] == {"string": "NPS1"}
    assert pool.rejected == ()
