"""``partition_type_attribute`` (publish/partitiontype.py) against the real peers: the partition
summary kube-controller-manager v1.37.2 computes for a ResourcePoolStatusRequest
(resourcepoolstatusrequest controller, gate DRAResourcePoolStatus) counts every partition of the
fixture nodes, with no ``PartitionCostMismatch`` (two devices of one type consuming differently,
the counter set's name included); and a kube-apiserver with DRAPartitionableDevicesType off, which
drops the slices' ``partitionTypeAttribute``, does not make the agent rewrite its pool at every sync."""

from __future__ import annotations

import asyncio
import logging
import subprocess
from collections import Counter

import httpx2
import pytest
from lightkube import AsyncClient, KubeConfig

from agent.publish.kubestore import KubeStore
from agent.publish.reconcile import RECHECK_DROPPED, Reconciler
from agent.publish.slices import build_pool, render
from discovery.inventory import scan
from tests.conftest import profile_root
from tests.controlplane import FEATURE_GATES, ControlPlane, free_port, peer, unique, wait_until
from tests.mig_node import MigNode
from tests.test_mig_static import layout
from tests.pool_checks import DRIVER

REQUESTS = "/apis/resource.k8s.io/v1alpha3/resourcepoolstatusrequests"
ATTRIBUTE = f"{DRIVER}/partitionType"


@pytest.fixture(scope="module")
def pool_status(apiserver, tmp_path_factory):
    """kube-controller-manager running only the resourcepoolstatusrequest controller."""
    port, kubeconfig = free_port(), apiserver.kubeconfig
    gates = ",".join(f"{k}={str(v).lower()}" for k, v in sorted(apiserver.gates.items()))
    proc = apiserver._spawn("kube-controller-manager-pools", [
        peer("kube-controller-manager"), f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}", "--leader-elect=false", "--bind-address=127.0.0.1",
        f"--secure-port={port}", "--controllers=resourcepoolstatusrequest-controller", f"--feature-gates={gates}",
    ])  # fmt: skip
    wait_until(lambda: httpx2.get(f"https://127.0.0.1:{port}/healthz", verify=False, timeout=2).status_code == 200, 60,
               what="kube-controller-manager", proc=proc, tail=lambda: apiserver.log_tail("kube-controller-manager-pools"))
    yield proc
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


def summary(plane, node: str) -> dict:
    """The node's pool as the controller reports it."""
    name = unique("status")
    plane.request("POST", REQUESTS, body={"apiVersion": "resource.k8s.io/v1alpha3", "kind": "ResourcePoolStatusRequest",
                                          "metadata": {"name": name}, "spec": {"driver": DRIVER, "poolName": node}})
    try:
        status = wait_until(lambda: plane.request("GET", f"{REQUESTS}/{name}").json().get("status"), 60, what="pool status")
    finally:
        plane.request("DELETE", f"{REQUESTS}/{name}")
    assert status["conditions"][0]["status"] == "True", status
    (pool,) = status["pools"]
    return pool


def published(plane, inv, **options) -> tuple[str, list[dict]]:
    node = plane.create_node(unique("ptype"))["metadata"]["name"]
    pool = build_pool(inv, node_name=node, driver_name=DRIVER, partitions=True, partition_type_attribute=True, **options)
    sent = render(pool, driver_name=DRIVER, node_name=node, generation=1)
    for obj in sent:
        plane.create(obj)
    return node, sent


def _inventory(case: str, tmp_path):
    if case == "dynamic-mig":
        return MigNode(str(tmp_path)).inv
    if case == "static-mig":  # the operator's 1g.18gb and two compute instances of a 3g.71gb, with NVML
        layout(node := MigNode(str(tmp_path), nvidia_mig="static"))
        return node.inv
    return scan(profile_root(case))


@pytest.mark.parametrize("case,options", [("mi300x-partitions", {}), ("mi300x-partitions", {"compatibility_groups": True}),
                                          ("h100-mig", {}), ("sriov-nic", {"pf_vf_exclusive": True}), ("dynamic-mig", {}),
                                          ("static-mig", {})])
def test_the_partition_summary_counts_every_partition_of_a_type(apiserver, pool_status, tmp_path, case, options):
    node, sent = published(apiserver, _inventory(case, tmp_path), **options)
    consuming = [d for o in sent for d in o["spec"].get("devices", []) if d.get("consumesCounters")]
    assert consuming and all(o["spec"].get("partitionTypeAttribute") == ATTRIBUTE
                             for o in sent if any(d.get("consumesCounters") for d in o["spec"].get("devices", [])))
    pool = summary(apiserver, node)
    assert "validationError" not in pool, pool["validationError"]
    want = Counter(d["attributes"]["partitionType"]["string"] for d in consuming)
    got = {p["type"]: p["total"] for p in pool["partitionSummary"]}
    assert got == dict(want) and all(p["allocatable"] == p["total"] for p in pool["partitionSummary"])


@pytest.fixture(scope="module")
def without_type(tmp_path_factory):
    """A server like the session's with DRAPartitionableDevicesType at its 1.37 default (off)."""
    plane = ControlPlane(dir=str(tmp_path_factory.mktemp("notype")),
                         gates={**FEATURE_GATES, "DRAPartitionableDevicesType": False}).start()
    yield plane
    plane.stop()


async def _syncs(plane, node: str, pool) -> list[int]:
    client = AsyncClient(config=KubeConfig.from_file(plane.kubeconfig), field_manager=DRIVER)
    reconciler = Reconciler(KubeStore(client, node_name=node, driver_name=DRIVER), node_name=node, driver_name=DRIVER)
    try:
        return [(await reconciler.sync(pool)).writes for _ in range(3)]
    finally:
        await client.close()


@pytest.mark.parametrize("gate", [True, False])
def test_a_server_that_drops_the_field_does_not_make_the_pool_rewrite_itself(apiserver, without_type, gate, caplog):
    caplog.set_level(logging.WARNING, logger="sysdra.publish")
    plane = apiserver if gate else without_type
    node = plane.create_node(unique("ptdrop"))["metadata"]["name"]
    inv = scan(profile_root("sriov-nic"))
    pool = build_pool(inv, node_name=node, driver_name=DRIVER, pf_vf_exclusive=True, partition_type_attribute=True)
    writes = asyncio.run(asyncio.wait_for(_syncs(plane, node, pool), 60))
    assert writes == [len(pool.slices), 0, 0]
    stored = plane.list("ResourceSlice", fields={"spec.nodeName": node, "spec.driver": DRIVER})
    declared = [o["spec"].get("partitionTypeAttribute") for o in stored if o["spec"].get("devices")]
    assert declared == [ATTRIBUTE if gate else None]
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    if gate:
        assert not dropped, dropped
    else:  # once, naming the field and its gate
        assert len(dropped) == 1 and "spec.partitionTypeAttribute" in dropped[0] and "DRAPartitionableDevicesType" in dropped[0], dropped
    assert all("partitionType" in d["attributes"] for o in stored for d in o["spec"].get("devices", []) if d.get("consumesCounters"))


def test_the_setting_reaches_the_pool_by_flag_and_environment_and_is_off_by_default():
    from tests.test_cmd_scan import _from_run, _scan_slices

    def declared(slices):
        return [o["spec"].get("partitionTypeAttribute") for o in slices if o["spec"].get("devices")]

    assert declared(_from_run("mi300x-partitions", "--partitions")) == [None]
    by_flag = _from_run("mi300x-partitions", "--partitions", "--partition-type-attribute")
    assert declared(by_flag) == [ATTRIBUTE]
    by_env = _scan_slices("--root", profile_root("mi300x-partitions"), "--partitions",
                          env={"SYSDRA_PARTITION_TYPE_ATTRIBUTE": "true"})
    assert by_env == by_flag


def test_slices_stored_without_the_field_get_it_once_the_server_keeps_it(apiserver):
    """Slices the server stored while its gate was off (the same devices, their partitionType
    included) are rewritten with the field by the agent's next start, once the gate is on:
    compared without it, the pool never got its partition summary."""
    meta = apiserver.create_node(unique("ptlater"))["metadata"]
    node = meta["name"]
    pool = build_pool(scan(profile_root("sriov-nic")), node_name=node, driver_name=DRIVER, pf_vf_exclusive=True,
                      partition_type_attribute=True)
    for obj in render(pool, driver_name=DRIVER, node_name=node, generation=1, node_uid=meta["uid"]):
        obj["spec"].pop("partitionTypeAttribute", None)
        apiserver.create(obj)
    writes = asyncio.run(asyncio.wait_for(_syncs(apiserver, node, pool), 60))
    assert writes[0] >= 1 and writes[1:] == [0, 0]
    stored = apiserver.list("ResourceSlice", fields={"spec.nodeName": node, "spec.driver": DRIVER})
    assert [o["spec"].get("partitionTypeAttribute") for o in stored if o["spec"].get("devices")] == [ATTRIBUTE]


@pytest.mark.parametrize("name", ["partitionType", f"{DRIVER}/partitionType"])
def test_an_operators_own_partition_type_gives_way_to_the_agents(apiserver, name):
    """The operator's device_attributes name partitionType (bare or in the driver's domain): the
    partitions carry the agent's value, once, and their slice still names it."""
    from discovery.extra_attributes import ExtraAttributes
    from tests.test_pool_properties import assert_publishable

    rules = ExtraAttributes.parse([{"match": ["kind:gpu"], "attributes": {name: 7}}], DRIVER)
    inv = scan(profile_root("mi300x-partitions"), extra_attributes=rules)
    node = apiserver.create_node(unique("ptop"))["metadata"]["name"]
    pool = build_pool(inv, node_name=node, driver_name=DRIVER, partitions=True, compatibility_groups=True,
                      partition_type_attribute=True)
    assert not pool.rejected, pool.rejected
    sent = assert_publishable(apiserver, node, pool)
    consuming = [d for o in sent for d in o["spec"].get("devices", []) if d.get("consumesCounters")]
    assert consuming and all(d["attributes"]["partitionType"]["string"].startswith("gpu-") for d in consuming)
    assert all(f"{DRIVER}/partitionType" not in d["attributes"] for d in consuming)
    assert all(o["spec"].get("partitionTypeAttribute") == ATTRIBUTE for o in sent if o["spec"].get("devices"))


def test_a_device_without_room_for_its_type_is_published_in_a_slice_apart(apiserver, pool_status):
    """A VF at the API's 32 attributes with none of the least needed ones to leave out: it is
    published without partitionType (the server refused a slice whose VF then had 33, or lacked
    the attribute the slice named), in a slice of its own naming no attribute; the others' slice
    names it, and the pool's summary counts them. Before, their shared slice named none: the
    summary left every device of the node out."""
    from discovery.models import AttributeValue, Inventory
    from tests import inventory_factory as factory
    from tests.test_pool_properties import assert_publishable, published

    base = factory.sriov_inventory(pfs=2, vfs=2)
    full = {f"extra{i}": AttributeValue(int_=i) for i in range(32 - 4)}  # the factory's VF has 4 attributes
    devices = [d.replace(attributes={**d.attributes, **full}) if d.name.endswith("-2") else d for d in base.devices]
    inv = Inventory(root="/", devices=tuple(devices))
    node = apiserver.create_node(unique("ptfull"))["metadata"]["name"]
    pool = build_pool(inv, node_name=node, driver_name=DRIVER, pf_vf_exclusive=True, partition_type_attribute=True)
    assert not pool.rejected, pool.rejected
    sent = assert_publishable(apiserver, node, pool)
    assert published(sent) == {d.name for d in inv.devices}
    full_vfs = [d for o in sent for d in o["spec"].get("devices", []) if d["name"].endswith("-2")]
    assert full_vfs and all("partitionType" not in d["attributes"] for d in full_vfs)
    declared = [(o["spec"].get("partitionTypeAttribute"), len(o["spec"]["devices"])) for o in sent if o["spec"].get("devices")]
    assert declared == [(ATTRIBUTE, len(inv.devices) - len(full_vfs)), (None, len(full_vfs))]
    typed = Counter(d["attributes"]["partitionType"]["string"] for o in sent for d in o["spec"].get("devices", [])
                    if "partitionType" in d["attributes"])
    for obj in sent:
        apiserver.create(obj)
    pool = summary(apiserver, node)
    assert "validationError" not in pool and {p["type"]: p["total"] for p in pool["partitionSummary"]} == dict(typed)


def test_the_field_is_offered_again_once_the_server_keeps_it_without_a_restart(apiserver, without_type):
    """The gate turned on (the API server restarted with it) while the agent runs: the field its
    writes had seen dropped is offered again in a dry run now and then (``RECHECK_DROPPED``), and
    the pool gets it. Before, compared without it, the pool never got it until the agent restarted."""
    node = unique("ptturned")
    without_type.create_node(node)
    uid = apiserver.create_node(node)["metadata"]["uid"]
    pool = build_pool(scan(profile_root("sriov-nic")), node_name=node, driver_name=DRIVER, pf_vf_exclusive=True,
                      partition_type_attribute=True)
    for obj in render(pool, driver_name=DRIVER, node_name=node, generation=1, node_uid=uid):
        obj["spec"].pop("partitionTypeAttribute", None)  # as the server stored them with its gate off
        apiserver.create(obj)
    now = [0.0]

    async def main():
        off, on = (AsyncClient(config=KubeConfig.from_file(p.kubeconfig), field_manager=DRIVER) for p in (without_type, apiserver))
        reconciler = Reconciler(KubeStore(off, node_name=node, driver_name=DRIVER), node_name=node, driver_name=DRIVER)
        reconciler.clock = lambda: now[0]
        try:
            first = [(await reconciler.sync(pool)).writes for _ in range(2)]  # learned as dropped
            reconciler.store, reconciler.node_uid = KubeStore(on, node_name=node, driver_name=DRIVER), uid
            soon = (await reconciler.sync(pool)).writes  # not offered again at every sync
            now[0] += RECHECK_DROPPED
            return first, soon, [(await reconciler.sync(pool)).writes for _ in range(2)]
        finally:
            await off.close()
            await on.close()
    first, soon, later = asyncio.run(asyncio.wait_for(main(), 60))
    assert first == [len(pool.slices), 0] and soon == 0 and later[0] >= 1 and later[1] == 0
    stored = apiserver.list("ResourceSlice", fields={"spec.nodeName": node, "spec.driver": DRIVER})
    assert [o["spec"].get("partitionTypeAttribute") for o in stored if o["spec"].get("devices")] == [ATTRIBUTE]
