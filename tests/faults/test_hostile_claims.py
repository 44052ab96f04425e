"""Hostile claims against the running agent (issue 42, defects 1, 4 and 6 and the results
count): quantities beyond the API server's bounds, config shapes no API server writes, a
share whose capacities would set one variable twice, more results than a claim can hold.
Each is that claim's clear error (or a clean spec), the other claims of the same call are
prepared, and the agent keeps answering."""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import pytest

from agent.apilimits import MAX_RESULTS
from agent.prepare.cdifiles import claim_spec_path
from tests.faults.harness import DRIVER, Node, run
from tests.faults.test_hostile import errors_of

pytestmark = pytest.mark.slow
GOOD = "00000000-0000-4000-8000-00000000600d"


def share_id(i: int) -> str:
    return f"11111111-2222-4333-8444-{i:012x}"


def write(node: Node, name: str, uid: str, results: list[dict], config: list[dict] | None = None) -> tuple[str, str, str]:
    """A claim file in the offline store with these results and configs -> its reference."""
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": name, "namespace": "default", "uid": uid},
             "status": {"allocation": {"devices": {"results": results, "config": config or []}}}}
    d = os.path.join(node.cluster, "resourceclaims", "default")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name + ".json"), "w") as f:
        json.dump(claim, f)
    return "default", name, uid


def result(node: Node, device: str, share: str | None = None, consumed: dict | None = None) -> dict:
    out = {"request": "r", "driver": DRIVER, "pool": node.name, "device": device}
    if share:
        out.update(shareID=share, consumedCapacity=consumed or {})
    return out


def gpus(node: Node) -> list[str]:
    return [d for d in node.devices() if d.startswith("gpu-")]


def _good(node: Node) -> tuple[str, str, str]:
    return write(node, "good", GOOD, [result(node, gpus(node)[-1])])


QUANTITIES = {
    "'1e' and 62 nines (64 characters)": "1e" + "9" * 62,
    "1e9999999": "1e9999999",
    "1e5000": "1e5000",
    "9Ei (above the largest int64)": "9Ei",
}


def test_quantities_beyond_the_api_servers_bounds(node, faults):
    good = _good(node)
    for i, (what, q) in enumerate(QUANTITIES.items()):
        uid = f"00000000-0000-4000-8000-0000000001{i:02d}"
        bad = write(node, f"q{i}", uid, [result(node, gpus(node)[0], share_id(1), {"compute": q, "memory": "1Gi"})])
        t0 = time.monotonic()
        errs = errors_of(run(node.prepare(bad, good), timeout=60))
        took = time.monotonic() - t0
        assert "consumedCapacity compute" in errs[uid] and "larger than" in errs[uid], (what, errs[uid])
        assert errs[GOOD] == "", errs[GOOD]
        assert not errors_of(run(node.unprepare(good)))[GOOD]
        faults.add("Hostile input", f"claim: a share consuming compute {what}", 1,
                   f"per-claim error ('larger than'); the other claim of the call prepared; call answered in {took * 1000:.0f} ms")
    assert node.proc.poll() is None


CONFIGS = {
    "opaque.parameters.kind as a list": ({"kind": ["GpuConfig"]}, "FromClaim", "kind (a list)"),
    "opaque.parameters.kind as an object": ({"kind": {"GpuConfig": 1}}, "FromClaim", "kind (an object)"),
    "config[].source as a list": ({}, ["FromClaim"], "source (a list)"),
}


def test_config_shapes_fail_only_their_claim(node, faults):
    refs, words = [_good(node)], {}
    for i, (what, (params, source, expected)) in enumerate(CONFIGS.items()):
        uid = f"00000000-0000-4000-8000-0000000002{i:02d}"
        parameters = {"apiVersion": "sysdra.io/v1alpha1", "kind": "GpuConfig", **params}
        config = [{"source": source, "opaque": {"driver": DRIVER, "parameters": parameters}}]
        refs.append(write(node, f"cfg{i}", uid, [result(node, gpus(node)[i])], config))
        words[uid] = (what, expected)
    errs = errors_of(run(node.prepare(*refs), timeout=60))
    assert errs[GOOD] == "", errs[GOOD]
    for uid, (what, expected) in words.items():
        assert expected in errs[uid] and "internal error" not in errs[uid], (what, errs[uid])
        faults.add("Hostile input", f"claim: {what}", 1, f"per-claim error ('{expected}'); the other claims of the call prepared")
    assert node.proc.poll() is None


def test_share_env_sets_no_variable_twice(node, faults):
    uid = "00000000-0000-4000-8000-000000000300"
    consumed = {"memory": "20Gi", "example.com/memory": "40Gi", "compute": "25"}
    ref = write(node, "env", uid, [result(node, gpus(node)[0], share_id(1), consumed)])
    assert errors_of(run(node.prepare(ref)))[uid] == ""
    with open(claim_spec_path(node.cdi_dir, DRIVER, uid)) as f:
        spec = json.load(f)
    common = [e.split("=", 1)[0] for e in spec["containerEdits"]["env"]]
    (dev,) = spec["devices"]
    env = [e.split("=", 1) for e in dev["containerEdits"]["env"]]
    assert [n for n, c in Counter(common + [n for n, _ in env]).items() if c > 1] == []
    values = dict(env)
    assert values["SYSDRA_SHARE_MEMORY"] == "20Gi" and values["SYSDRA_SHARE_EXAMPLE_COM_MEMORY"] == "40Gi"
    assert not errors_of(run(node.unprepare(ref)))[uid]
    faults.add("Hostile input", "claim: a share consuming memory and example.com/memory", 1,
               "CDI spec sets each variable once (SYSDRA_SHARE_MEMORY, SYSDRA_SHARE_EXAMPLE_COM_MEMORY)")


def test_more_results_than_a_claim_holds(node, faults):
    gpu = gpus(node)[0]
    uid = "00000000-0000-4000-8000-000000000400"
    shares = [result(node, gpu, share_id(i), {"memory": "1Gi"}) for i in range(MAX_RESULTS + 1)]
    ref = write(node, "many", uid, shares)
    err = errors_of(run(node.prepare(ref, _good(node)), timeout=60))
    assert f"at most {MAX_RESULTS}" in err[uid] and err[GOOD] == "", err
    assert not os.path.exists(claim_spec_path(node.cdi_dir, DRIVER, uid))
    ref = write(node, "many", uid, shares[:MAX_RESULTS])
    assert errors_of(run(node.prepare(ref)))[uid] == ""
    with open(claim_spec_path(node.cdi_dir, DRIVER, uid)) as f:
        assert len(json.load(f)["devices"]) == MAX_RESULTS
    faults.add("Hostile input", f"claim: {MAX_RESULTS + 1} results, one more than the API server allows", 1,
               f"per-claim error ('at most {MAX_RESULTS}', the API server's limit); {MAX_RESULTS} are prepared")
