"""A claim's allocation of any shape is prepared or that claim's ``ClaimFailed``: never
another exception, whatever the types at any level (agent/prepare/allocation.py,
claimconfig.py, shares.py), and counts and sizes are held to the API server's limits
(agent/apilimits.py) before any work per entry."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.apilimits import MAX_ALLOCATION_CONFIGS, MAX_OPAQUE_PARAMETERS_BYTES, MAX_RESULTS
from agent.prepare.allocation import ClaimFailed, our_results
from agent.prepare.claimconfig import config_for, opaque_configs
from agent.prepare.shares import claim_devices
from cdi.claim import build_claim_spec
from tests.inventory_factory import inventory
from tests.test_quantity import within_memory

DRIVER, NODE = "sysdra.io", "node-1"
DEVICES = inventory(2, "gpu").by_name()
GPU = sorted(DEVICES)[0]
SHARE = "11111111-2222-4333-8444-555555555555"
PEAK_BYTES = 4 << 20  # what preparing one small claim may take at its peak, whatever its values


def good_claim() -> dict:
    params = {"apiVersion": "sysdra.io/v1alpha1", "kind": "GpuConfig", "sharing": {"mpsLimits": True}, "env": {"A": "1"}}
    return {
        "metadata": {"uid": "00000000-0000-4000-8000-000000000001", "name": "c", "namespace": "default"},
        "status": {"allocation": {"devices": {
            "results": [
                {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": GPU, "shareID": SHARE,
                 "consumedCapacity": {"memory": "20Gi", "compute": "25"}},
                {"request": "gpu/sub", "driver": DRIVER, "pool": NODE, "device": sorted(DEVICES)[1], "adminAccess": False},
            ],
            "config": [
                {"source": "FromClass", "requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": params}},
                {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": params}},
            ],
        }}},
    }


def prepare_pure(claim: dict) -> dict | None:
    """What prepare computes from the claim alone: results, configs, CDI devices, the spec."""
    _, results = our_results(claim, DRIVER)
    configs = opaque_configs(claim, DRIVER)
    entries = claim_devices([(DEVICES[r.device], r, config_for(configs, r.request, DEVICES[r.device].kind, r.device))
                             for r in results if r.device in DEVICES])
    return build_claim_spec(DRIVER, claim["metadata"]["uid"], entries) if entries else None


def test_the_good_claim_is_prepared():
    spec = prepare_pure(good_claim())
    assert spec is not None and len(spec["devices"]) == 2


def _paths(node: object, here: tuple = ()) -> list[tuple]:
    """Every place in the claim's status a value sits (each dict key, each list index)."""
    out = [here]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, here + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, here + (i,))
    return out


SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                    st.text(max_size=12),
                    st.sampled_from(["1e" + "9" * 62, "1e9999999", "1e5000", "-1", "FromClaim", "GpuConfig",
                                     "sysdra.io/v1alpha1", SHARE, GPU, "", "a" * 300]))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
CLAIM_PATHS = [p for p in _paths(good_claim()["status"]) if p]


def _put(claim: dict, path: tuple, value: object) -> None:
    node = claim["status"]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(CLAIM_PATHS), JSON), min_size=1, max_size=3))
def test_any_value_anywhere_is_prepared_or_the_claims_error(changes):
    claim = good_claim()
    for path, value in changes:
        try:
            _put(claim, path, copy.deepcopy(value))
        except (KeyError, IndexError, TypeError):
            continue  # an earlier change replaced what this path runs through
    try:
        within_memory(PEAK_BYTES, prepare_pure, claim)
    except ClaimFailed as err:
        assert str(err) and len(str(err)) < 1000


@pytest.mark.parametrize("where, value, words", [
    (("allocation", "devices", "config", 1, "opaque", "parameters", "kind"), ["GpuConfig"], "kind (a list)"),
    (("allocation", "devices", "config", 1, "opaque", "parameters", "kind"), {"a": 1}, "kind (an object)"),
    (("allocation", "devices", "config", 0, "source"), ["FromClass"], "source (a list)"),
    (("allocation", "devices", "config", 0, "source"), {"x": 1}, "source (an object)"),
    (("allocation", "devices", "config", 0, "opaque", "parameters", "apiVersion"), ["v"], "apiVersion (a list)"),
    (("allocation", "devices", "config", 0), "x", "config 0 is not an object"),
    (("allocation", "devices", "config", 0, "requests"), "gpu", "config 0: requests is not a list of names"),
    (("allocation", "devices", "config", 0, "requests"), ["gpu", 1], "config 0: requests is not a list of names"),
    (("allocation", "devices"), [], "status.allocation.devices is not an object"),
    (("allocation",), "x", "status.allocation is not an object"),
    (("allocation", "devices", "results", 0, "consumedCapacity", "memory"), "1e" + "9" * 62, "larger than"),
    (("allocation", "devices", "results", 0, "consumedCapacity", "memory"), "1e9999999", "larger than"),
    (("allocation", "devices", "results", 0, "consumedCapacity", "memory"), "-1", "negative"),
    (("allocation", "devices", "results", 0, "pool"), "p" * (1 << 20), "at most 253 characters"),
    (("allocation", "devices", "results", 0, "pool"), "Node_1", "DNS subdomains"),
    (("allocation", "devices", "results", 0, "consumedCapacity", "memory"), ["1"], "not a quantity"),
    (("allocation", "devices", "results", 1, "adminAccess"), "true", "adminAccess 'true' is not a boolean"),
    (("allocation", "devices", "config", 1, "opaque", "parameters", "env"),
     {f"V{i}": "x" * 4000 for i in range(3)}, f"at most {MAX_OPAQUE_PARAMETERS_BYTES}"),
    # runc refuses to start the container ("environment variable value can't contain null")
    (("allocation", "devices", "config", 1, "opaque", "parameters", "env"), {"A": "x\x00y"}, "env.A: Value error, a NUL"),
])
def test_shapes_of_defect_4_and_bad_quantities_are_the_claims_error(where, value, words):
    claim = good_claim()
    _put(claim, where, value)
    with pytest.raises(ClaimFailed) as err:
        prepare_pure(claim)
    assert words in str(err.value) and len(str(err.value)) < 1000, str(err.value)[:1000]


def test_counts_held_to_the_api_servers_limits():
    claim = good_claim()
    devices = claim["status"]["allocation"]["devices"]
    one = devices["results"][0]
    devices["results"] = [{**one, "shareID": f"11111111-2222-4333-8444-{i:012x}"} for i in range(MAX_RESULTS)]
    assert len(prepare_pure(claim)["devices"]) == MAX_RESULTS
    devices["results"].append({**one, "shareID": "11111111-2222-4333-8444-ffffffffffff"})
    with pytest.raises(ClaimFailed, match=f"results is not a list of at most {MAX_RESULTS}"):
        prepare_pure(claim)
    devices["results"].pop()
    devices["config"] = devices["config"][:1] * MAX_ALLOCATION_CONFIGS
    assert prepare_pure(claim) is not None
    devices["config"].append(devices["config"][0])
    with pytest.raises(ClaimFailed, match=f"config is not a list of at most {MAX_ALLOCATION_CONFIGS}"):
        prepare_pure(claim)
