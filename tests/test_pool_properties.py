"""Property: every pool the agent can build is one the real kube-apiserver v1.37.2 accepts
(server-side dry-run create of each slice) and one the upstream allocator does not call invalid
(tests/pool_checks.py holds both checks), for inventories of the fixture trees with odd values
written into them, odd MIG layouts of the simulated NVML, and any combination of the settings
that shape slices. Hypothesis draws them, derandomized and bounded; a device that cannot be
published is left out with its reason, never the pool."""

from __future__ import annotations

import contextlib
import os
import re
import shutil

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import tests.simnvml_mig as simmig
from agent.publish.sharing import share_plan
from agent.publish.slices import build_pool, render
from discovery.extra_attributes import ExtraAttributes
from discovery.inventory import scan
from tests.conftest import profile_root, profiles
from tests.controlplane import unique
from tests.inventory_factory import inventory as factory_inventory
from tests.mig_node import MigNode
from tests.pool_checks import DRIVER, allocator_problem, partition_type_problems, pool_problems, server_refusals

PROPERTY = settings(max_examples=100, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
# value files discovery reads, and what odd values they may hold
NUMBERS = st.one_of(st.integers(0, 2**64), st.integers(1, 10**6).map(lambda n: n * 10**9),
                    st.integers(1, 4096).map(lambda n: n << 20), st.sampled_from([1, 10, 100, 1000, 2**63 - 1]))
VALUES = {
    "mem_info_vram_total": NUMBERS, "speed": NUMBERS, "numa_node": st.integers(-2, 2**31),
    "product_name": st.text(min_size=1, max_size=80), "board_name": st.text(min_size=1, max_size=80),
    "label": st.text(min_size=1, max_size=80), "mtu": NUMBERS, "sriov_numvfs": st.integers(0, 300),
}


# the operator's device_attributes (docs/attributes.md): any names, in any domain, up to the API's limits
ATTRIBUTE = st.one_of(st.sampled_from(["model", "rail", f"{DRIVER}/rail", f"{DRIVER}/model", "example.com/rail", "dra.net/numaNode"]),
                      st.from_regex(r"\A[a-z][a-zA-Z0-9_]{0,31}\Z"))
VALUE = st.one_of(st.integers(-2**63, 2**63 - 1), st.booleans(), st.text(min_size=1, max_size=16).filter(lambda t: len(t.encode()) <= 64),
                  st.sampled_from([{"copy": "resource.kubernetes.io/numaNode"}, {"copy": "model"}, {"copy": f"{DRIVER}/type"}]))
RULE = st.fixed_dictionaries({"match": st.lists(st.sampled_from(["kind:gpu", "kind:nic", "pci:*", "interface:*"]), min_size=1, max_size=2),
                              "attributes": st.dictionaries(ATTRIBUTE, VALUE, min_size=1, max_size=16)})
OPERATOR_RULES = st.lists(RULE, max_size=3).map(lambda rules: ExtraAttributes.parse(rules, DRIVER))


@pytest.fixture(scope="module")
def node(apiserver):
    return apiserver.create_node(unique("props"))["metadata"]["name"]


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """A writable copy of every fixture profile and its value files: each example writes its odd
    values and puts the originals back (copying a tree per example would cost seconds)."""
    out = {}
    for p in profiles():
        root = str(tmp_path_factory.mktemp("props") / p)
        shutil.copytree(profile_root(p), root, symlinks=True)
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "sys")) for f in fs
                       if f in VALUES and not os.path.islink(os.path.join(d, f)))
        out[p] = (root, files)
    return out


@contextlib.contextmanager
def written(texts: dict[str, str]):
    """Each file holds its text while the block runs; the originals are put back after."""
    saved = {f: open(f).read() for f in texts}
    try:
        for f, text in texts.items():
            with open(f, "w") as out:
                out.write(text)
        yield
    finally:
        for f, text in saved.items():
            with open(f, "w") as out:
                out.write(text)


def options(draw) -> dict:
    kinds = draw(st.lists(st.sampled_from(["gpu", "nic"]), unique=True))
    partitions = draw(st.booleans())
    skip = draw(st.lists(st.sampled_from(["gpu", "nic", "accelerator", "fpga"]), unique=True, max_size=2))
    return {
        "list_attributes": draw(st.booleans()), "pf_vf_exclusive": draw(st.booleans()), "partitions": partitions,
        "compatibility_groups": partitions and draw(st.booleans()), "share": share_plan(tuple(kinds), None),
        "skip_node_operations": {k: ["*"] for k in skip}, "partition_type_attribute": draw(st.booleans()),
    }


def assert_publishable(plane, node: str, pool) -> list[dict]:
    sent = render(pool, driver_name=DRIVER, node_name=node, generation=1)
    assert not (refused := server_refusals(plane, sent)), refused
    assert not (problems := pool_problems(sent)), problems
    assert (problem := allocator_problem(sent, node)) is None, problem
    assert not (problems := partition_type_problems(sent)), problems
    return sent


def taints_for(draw, names: list[str]) -> dict:
    picked = draw(st.lists(st.sampled_from(names), unique=True, max_size=4)) if names else []
    return {n: [{"key": "sysdra.io/unhealthy", "value": "xid-79", "effect": "NoSchedule"}] for n in picked}


@PROPERTY
@given(data=st.data())
def test_fixture_trees_with_odd_values_publish_what_the_server_accepts(apiserver, node, trees, data):
    profile = data.draw(st.sampled_from(sorted(trees)))
    root, files = trees[profile]
    picks = data.draw(st.lists(st.sampled_from(files), unique=True, max_size=6)) if files else []
    with written({f: f"{data.draw(VALUES[os.path.basename(f)])}\n" for f in picks}):
        opts = options(data.draw)
        inv = scan(root, list_attributes=opts["list_attributes"], extra_attributes=data.draw(OPERATOR_RULES))
    pool = build_pool(inv, node_name=node, driver_name=DRIVER, **opts, taints=taints_for(data.draw, [d.name for d in inv.devices]))
    sent = assert_publishable(apiserver, node, pool)
    # sharing, taints, PF/VF counters, node operations shape a device's entry: they never cost one
    plain = build_pool(inv, node_name=node, driver_name=DRIVER, list_attributes=opts["list_attributes"],
                       partitions=opts["partitions"], compatibility_groups=opts["compatibility_groups"])
    assert published(render(plain, driver_name=DRIVER, node_name=node, generation=1)) <= published(sent), pool.rejected


def published(slices: list[dict]) -> set[str]:
    return {d["name"] for o in slices for d in o["spec"].get("devices", [])}


def test_a_gpu_whose_memory_is_a_decimal_size_keeps_its_partitions(apiserver, node, trees):
    """An AMD GPU's VRAM of 192000000000 bytes is "192G": its partitions' memory share is
    counted from it (the pool was not built at all: a ValueError out of the publisher)."""
    root, files = trees["mi300x-partitions"]
    with written({f: "192000000000\n" for f in files if f.endswith("mem_info_vram_total")}):
        inv = scan(root, list_attributes=True)
    pool = build_pool(inv, node_name=node, driver_name=DRIVER, list_attributes=True, partitions=True)
    assert not pool.rejected, pool.rejected
    sent = assert_publishable(apiserver, node, pool)
    sets = [s for o in sent for s in o["spec"].get("sharedCounters", [])]
    assert sets and all(s["counters"]["memory"] == {"value": "192G"} for s in sets)


# an odd profile table: each profile's placements drawn (repeated starts, overlaps, up to 16 slices)
PLACEMENTS = st.lists(st.integers(1, 8).flatmap(lambda size: st.tuples(st.integers(0, 16 - size), st.just(size))),
                      min_size=1, max_size=8)


@PROPERTY
@given(data=st.data())
def test_odd_mig_layouts_publish_what_the_server_accepts(apiserver, node, tmp_path_factory, monkeypatch, data):
    rows = [row[:12] + (data.draw(PLACEMENTS),) for row in simmig.H200_PROFILES]
    monkeypatch.setattr(simmig, "H200_PROFILES", rows)
    monkeypatch.setattr(simmig, "_BY_ID", {row[1]: row for row in rows})
    mig = MigNode(str(tmp_path_factory.mktemp("mig")))
    opts = options(data.draw)
    inv = scan(mig.root, list_attributes=opts["list_attributes"], nvml=mig.nvml)
    names = [d.name for d in inv.devices] + [f"{d.name}-mig-1g-18gb-0" for d in inv.devices if d.kind == "gpu"]
    pool = build_pool(inv, node_name=node, driver_name=DRIVER, **opts, taints=taints_for(data.draw, names))
    sent = assert_publishable(apiserver, node, pool)
    if opts["partitions"]:  # every placement NVML named once is published once
        want = {f"{d.name}-mig-{row[2][4:].replace('.', '-').replace('+', '-')}-{start}"
                for d in inv.devices if d.kind == "gpu" for row in rows for start, _ in row[12]}
        assert want <= published(sent) | {n for n, _ in pool.rejected}


def test_a_shared_nic_linked_at_100_mbps_stays_in_the_pool_without_bandwidth(apiserver, node, trees):
    """Its bandwidth of 100M is less than the policy's 100M share plus one step: the server refuses
    that capacity, so it is left out there, not the NIC (it was left out of the pool whole)."""
    root, files = trees["workstation-deep-bridges"]
    with written({f: "100\n" for f in files if f.endswith("/speed")}):
        inv = scan(root)
    pool = build_pool(inv, node_name=node, driver_name=DRIVER, share=share_plan(("nic",), None))
    assert not pool.rejected, pool.rejected
    nics = [d for o in assert_publishable(apiserver, node, pool) for d in o["spec"]["devices"] if d["name"].startswith("nic-")]
    assert nics and all(set(d["capacity"]) == {"slots"} and d["allowMultipleAllocations"] for d in nics)


@pytest.mark.parametrize("xccs", [3, 9, 100000, 2**63])
def test_an_odd_xcc_count_of_a_kfd_node_costs_only_the_count(apiserver, node, trees, xccs):
    """One KFD node's ``num_xcc`` past any GPU's: the GPU's XCC count is unknown (a problem of the
    device), its partitions as without it. They were one per XCC: 100,027 devices in 1,564 slices
    for 100000, and with 2**63 the agent never finished building its pool."""
    root, _ = trees["mi300x-partitions"]
    kfd = os.path.join(root, "sys/devices/virtual/kfd/kfd/topology/nodes/3/properties")
    want = published(render(build_pool(scan(root, list_attributes=True), node_name=node, driver_name=DRIVER,
                                       list_attributes=True, partitions=True, compatibility_groups=True),
                            driver_name=DRIVER, node_name=node, generation=1))
    with written({kfd: re.sub(r"(?m)^num_xcc .*$", f"num_xcc {xccs}", open(kfd).read())}):
        inv = scan(root, list_attributes=True)
    assert any(p.what == "partitions" and "XCC" in p.reason for d in inv.devices for p in d.problems)
    pool = build_pool(inv, node_name=node, driver_name=DRIVER, list_attributes=True, partitions=True, compatibility_groups=True)
    assert published(assert_publishable(apiserver, node, pool)) == want


def test_an_operators_attribute_in_the_drivers_domain_never_costs_the_device(apiserver, node, tmp_path):
    """``sysdra.io/model`` is the GPU's own ``model`` to the API and to CEL: the device's own wins,
    as over an operator's ``model`` (every GPU was left out: "appears twice")."""
    from agent.service import scanning
    from tests.kubelet_standin import settings_for

    rules = [{"match": "kind:gpu", "attributes": {f"{DRIVER}/model": "x", f"{DRIVER}/rail": 1,
                                                 f"{DRIVER}/copied": {"copy": f"{DRIVER}/model"}}}]
    settings = settings_for(str(tmp_path), root=profile_root("server-2s-gpu-nic"), nvml=False, device_attributes=rules)
    inv = scanning.default_scan(settings)
    pool = build_pool(inv, node_name=node, driver_name=DRIVER)
    assert not pool.rejected, pool.rejected
    gpus = [d for o in assert_publishable(apiserver, node, pool) for d in o["spec"]["devices"] if d["name"].startswith("gpu-")]
    model = {d.name: d.attributes["model"].to_api() for d in inv.devices if d.kind == "gpu"}
    for gpu in gpus:
        assert gpu["attributes"]["model"] == gpu["attributes"]["copied"] == model[gpu["name"]]
        assert gpu["attributes"]["rail"] == {"int": 1} and not any(k.startswith(f"{DRIVER}/") for k in gpu["attributes"])


@pytest.mark.parametrize("profile", ["server-2s-gpu-nic", "sriov-nic"])
def test_a_device_the_operators_attributes_fill_keeps_its_place_when_shared(apiserver, node, profile):
    """The operator's attributes take every device to the API's 32 attributes and capacities; a
    share's capacities, a VF's PF address then leave out the
    device's least needed attributes (its subsystem IDs first), not the device ("33 attributes
    and capacities, at most 32": every GPU and NIC of the node was left out)."""
    fill = [{"match": ["pci:*"], "attributes": {f"extra{r}x{i}": i for i in range(16)}} for r in range(2)]
    inv = scan(profile_root(profile), list_attributes=True, extra_attributes=ExtraAttributes.parse(fill, DRIVER))
    assert all(len(d.attributes) + len(d.capacity) == 32 for d in inv.devices)
    plain = build_pool(inv, node_name=node, driver_name=DRIVER, list_attributes=True, partitions=True)
    shaped = build_pool(inv, node_name=node, driver_name=DRIVER, list_attributes=True, partitions=True, pf_vf_exclusive=True,
                        compatibility_groups=True, share=share_plan(("gpu", "nic"), None), partition_type_attribute=True)
    assert not shaped.rejected, shaped.rejected
    sent = assert_publishable(apiserver, node, shaped)
    # and the partition type takes its place in the 32 too: every slice with counters names it
    assert all(o["spec"].get("partitionTypeAttribute") for o in sent if any(d.get("consumesCounters") for d in o["spec"].get("devices", [])))
    assert published(render(plain, driver_name=DRIVER, node_name=node, generation=1)) <= published(sent)


# DNS labels of any length (the ends alphanumeric), and subdomains of them up to 253 characters
LABEL = st.integers(1, 63).flatmap(lambda n: st.text("a9-", min_size=n, max_size=n)).map(lambda t: "z" + t[1:-1] + "0" if len(t) > 1 else "z")
SUBDOMAIN = st.lists(LABEL, min_size=1, max_size=8).map(lambda labels: ".".join(labels)[:253].rstrip(".-"))


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(node_name=SUBDOMAIN, driver=SUBDOMAIN.filter(lambda n: len(n) <= 63))
@example(node_name=".".join(["n" * 63] * 3) + ".n", driver=DRIVER)  # 194 characters: 253 and more with the rest
@example(node_name="n" * 41 + ".node", driver=DRIVER)  # a dot as the 58th character of the prefix
def test_slices_of_any_node_and_driver_name_are_named_as_the_server_takes_them(apiserver, node_name, driver):
    """A Node may be named by any DNS subdomain of up to 253 characters: the slices' generateName
    (index, driver, node) is cut to what the server keeps of it (a node name of 240 characters
    had every slice refused: "metadata.generateName: ... must be no more than 253 characters")."""
    pool = build_pool(factory_inventory(3), node_name=node_name, driver_name=driver)
    assert not (refused := server_refusals(apiserver, render(pool, driver_name=driver, node_name=node_name, generation=1))), refused
