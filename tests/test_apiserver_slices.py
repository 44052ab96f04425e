"""What the agent publishes, against the real kube-apiserver v1.37.2 (tests/controlplane.py):
every fixture profile's slices pass the server's own validation, owned by a real Node, and
come back as sent: no field is dropped (a disabled gate drops fields silently)."""

from __future__ import annotations

import copy

import pytest

from agent.publish.sharing import share_plan
from agent.publish.slices import build_pool, render
from discovery.inventory import scan
from tests.conftest import profile_root, profiles
from tests.controlplane import APIError, unique

DRIVER = "sysdra.io"
VARIANTS = {
    "plain": {"list_attributes": False},
    "list-attributes": {"list_attributes": True},
    "pf-vf-exclusive": {"list_attributes": True, "pf_vf_exclusive": True},
    "partitions": {"list_attributes": True, "pf_vf_exclusive": True, "partitions": True},
    "compatibility-groups": {"list_attributes": True, "partitions": True, "compatibility_groups": True},
    "share": {"share": share_plan(("gpu", "nic"), None)},  # consumable capacity, docs/sharing.md
}


def agent_slices(profile: str, node: dict, **kw) -> list[dict]:
    inv = scan(profile_root(profile), list_attributes=kw.get("list_attributes", False))
    pool = build_pool(inv, node_name=node["metadata"]["name"], driver_name=DRIVER, **kw)
    assert not pool.rejected, pool.rejected  # fixture devices are all publishable
    return render(pool, driver_name=DRIVER, node_name=node["metadata"]["name"], generation=1, node_uid=node["metadata"]["uid"])


def without_server_fields(spec: dict) -> dict:
    """The spec as sent: drop what the server adds by defaulting (taint timeAdded)."""
    spec = copy.deepcopy(spec)
    for dev in spec.get("devices", []):
        for taint in dev.get("taints", []):
            taint.pop("timeAdded", None)
    return spec


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("profile", profiles())
def test_every_profile_is_accepted_and_stored_unchanged(apiserver, profile, variant):
    node = apiserver.create_node(unique("slices"))
    name = node["metadata"]["name"]
    sent = agent_slices(profile, node, **VARIANTS[variant])
    stored = [apiserver.create(obj) for obj in sent]
    for want, got in zip(sent, stored):
        assert got["metadata"]["name"].startswith(want["metadata"]["generateName"])
        assert got["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Node", "name": name,
                                                       "uid": node["metadata"]["uid"], "controller": True}]  # fmt: skip
        assert without_server_fields(got["spec"]) == want["spec"]
    listed = apiserver.list("ResourceSlice", fields={"spec.nodeName": name, "spec.driver": DRIVER})
    assert sorted(o["metadata"]["name"] for o in listed) == sorted(o["metadata"]["name"] for o in stored)
    apiserver.delete("Node", name)


def test_the_server_runs_with_every_dra_gate_the_agent_relies_on(apiserver):
    from tests.controlplane import FEATURE_GATES

    enabled = apiserver.feature_gates()
    for gate in [*FEATURE_GATES, "DRAAdminAccess", "DRAPrioritizedList", "DRAResourceClaimDeviceStatus",
                 "DRAExtendedResource", "NodeDeclaredFeatures"]:  # the last five: GA and locked on in 1.37
        assert enabled.get(gate) is True, gate
    assert apiserver.request("GET", "/version").json()["gitVersion"] == "v1.37.2"


def test_taints_get_time_added_by_the_server(apiserver):
    node = apiserver.create_node(unique("taints"))
    inv = scan(profile_root("vm-numa-none"))
    gpu = next(d.name for d in inv.devices if d.name.startswith("gpu-"))
    pool = build_pool(inv, node_name=node["metadata"]["name"], driver_name=DRIVER,
                      taints={gpu: [{"key": "sysdra.io/unhealthy", "value": "true", "effect": "NoSchedule"}]})  # fmt: skip
    (obj,) = render(pool, driver_name=DRIVER, node_name=node["metadata"]["name"], generation=1)
    stored = apiserver.create(obj)
    (taint,) = next(d for d in stored["spec"]["devices"] if d["name"] == gpu)["taints"]
    assert taint["timeAdded"] and taint["effect"] == "NoSchedule"


def test_counters_and_devices_never_share_a_slice_on_the_server_either(apiserver):
    node = apiserver.create_node(unique("counters"))
    objs = agent_slices("sriov-nic", node, list_attributes=True, pf_vf_exclusive=True)
    counters = next(o for o in objs if "sharedCounters" in o["spec"])
    devices = next(o for o in objs if "devices" in o["spec"])
    both = copy.deepcopy(counters)
    both["spec"]["devices"] = devices["spec"]["devices"][:1]
    with pytest.raises(APIError) as err:
        apiserver.create(both)
    assert err.value.status == 422


@pytest.fixture
def without_list_attributes(older_apiserver):
    """A server with DRAListTypeAttributes at its 1.37 default (off): the session's older_apiserver."""
    return older_apiserver


def test_list_attributes_cost_the_whole_slice_on_a_server_without_the_gate(without_list_attributes):
    """Why --list-attributes must follow the cluster: with DRAListTypeAttributes off, v1.37.2
    drops the list value and then rejects the attribute left empty, so the whole slice (every
    device in it) is refused, not just the list attribute."""
    plane = without_list_attributes
    node = plane.create_node(unique("nolists"))
    sent = agent_slices("server-2s-gpu-nic", node, list_attributes=True)[0]
    assert any("ints" in v for d in sent["spec"]["devices"] for v in d.get("attributes", {}).values())
    with pytest.raises(APIError) as err:
        plane.create(sent)
    assert err.value.status == 422 and "attributes[resource.kubernetes.io/numaNode]" in str(err.value)
    # what the agent publishes without --list-attributes is stored unchanged there
    plain = agent_slices("server-2s-gpu-nic", node, list_attributes=False)[0]
    assert without_server_fields(plane.create(plain)["spec"]) == plain["spec"]
