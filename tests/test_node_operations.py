"""Optional node operations (KEP-5945, DRAOptionalNodeOperations, alpha): the operator marks a
device kind (``skip_node_operations``), its devices get slices of their own with that
``skipNodeOperations`` list (upstream's rule enforced), prepare ignores allocation results that
skip it, and the agent refuses to change the setting while claims of those devices are prepared.

The rule and the copy into allocation results are checked on the real kube-apiserver v1.37.2 and
the upstream allocator; the refusal on the whole agent (SIGHUP and restart)."""

from __future__ import annotations

import glob
import itertools
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from agent import nodeops
from agent.kubeletplugin.types import ClaimRef
from agent.prepare.allocation import our_results
from agent.publish.slices import build_pool, render
from agent.service.nodeops import refusal, settle
from agent.settings import ConfigError, build_settings
from discovery.models import AttributeValue
from tests.conftest import REPO, profile_root
from tests.controlplane import APIError, Unschedulable, allocate, resource_path, unique
from tests.kubelet_standin import KubeletStandIn, claim, gpu, inventory, store_claim

DRIVER = "sysdra.io"
COMBOS = [list(c) for n in (1, 2, 3) for c in itertools.permutations(nodeops.KNOWN, n)]


def accel(n: int):
    dev = gpu(n)
    return dev.replace(name=dev.name.replace("gpu-", "accelerator-"), kind="accelerator")


# --- the setting -------------------------------------------------------------------------------
def test_the_rule_prepare_only_with_unprepare():
    assert nodeops.rule_problem(["*"]) is None
    assert nodeops.rule_problem(["NodePrepareResources", "NodeUnprepareResources"]) is None
    assert nodeops.rule_problem(["NodeUnprepareResources"]) is None
    assert "only be skipped together" in nodeops.rule_problem(["NodePrepareResources"])
    assert "twice" in nodeops.rule_problem(["*", "*"])
    assert "unknown" in nodeops.rule_problem(["NodeReboot"])
    assert nodeops.rule_problem([]) is not None


def test_settings_refuse_a_bad_rule_and_read_the_environment():
    with pytest.raises(ConfigError, match="skip-node-operations: .*NodePrepareResources may only be skipped"):
        build_settings({"skip_node_operations": {"accelerator": ["NodePrepareResources"]}}, os.devnull, environ={})
    with pytest.raises(ConfigError, match="'tpu' is not a device kind"):
        build_settings({"skip_node_operations": {"tpu": ["*"]}}, os.devnull, environ={})
    s = build_settings({}, os.devnull, environ={"SYSDRA_SKIP_NODE_OPERATIONS": '{accelerator: ["*"]}'})
    assert s.skip_node_operations == {"accelerator": ["*"]}


# --- publishing --------------------------------------------------------------------------------
def test_marked_kinds_get_slices_of_their_own():
    inv = inventory(gpu(0), accel(1), gpu(2), accel(3))
    pool = build_pool(inv, node_name="node-a", driver_name=DRIVER, skip_node_operations={"accelerator": ["*"]})
    assert [([d["name"].split("-")[0] for d in sl["devices"]], sl.get("skipNodeOperations")) for sl in pool.slices] == [
        (["gpu", "gpu"], None), (["accelerator", "accelerator"], ["*"])]
    again = build_pool(inv, node_name="node-a", driver_name=DRIVER, skip_node_operations={"accelerator": ["*"]}, previous=pool)
    assert again.slices == pool.slices
    plain = build_pool(inv, node_name="node-a", driver_name=DRIVER)
    assert len(plain.slices) == 1 and "skipNodeOperations" not in plain.slices[0]


# --- prepare ------------------------------------------------------------------------------------
def test_prepare_ignores_results_that_skip_it_and_never_fails_on_them():
    c = claim("c", [("a", "gpu-0000-1b-00-0"), ("b", "accelerator-0000-1c-00-0"), ("c", "gpu-0000-1d-00-0")])
    results = c["status"]["allocation"]["devices"]["results"]
    results[1]["skipNodeOperations"] = ["*"]
    results[2]["skipNodeOperations"] = ["NodeUnprepareResources", "SomethingNew"]  # prepare still needed; unknown ignored
    _, ours = our_results(c, DRIVER)
    assert [r.device for r in ours] == ["gpu-0000-1b-00-0", "gpu-0000-1d-00-0"]
    results[0]["skipNodeOperations"] = ["NodePrepareResources", "NodeUnprepareResources"]
    results[2]["skipNodeOperations"] = ["*"]
    assert our_results(c, DRIVER)[1] == []
    results[0]["skipNodeOperations"] = "*"
    with pytest.raises(Exception, match="skipNodeOperations is not a list"):
        our_results(c, DRIVER)


# --- changing the setting ----------------------------------------------------------------------
def test_a_change_is_refused_while_claims_of_those_kinds_are_prepared(tmp_path):
    claims = {"u1": {"state": "PrepareCompleted", "namespace": "ml", "name": "infer",
                     "devices": [{"device": "accelerator-0000-1c-00-0"}, {"device": "gpu-0000-1b-00-0"}]}}  # fmt: skip
    why = refusal({}, {"accelerator": ["*"]}, claims)
    assert "accelerator not changed" in why and "ml/infer (accelerator-0000-1c-00-0)" in why
    assert refusal({}, {"fpga": ["*"]}, claims) is None  # no prepared claim holds an FPGA
    assert refusal({"accelerator": ["*"]}, {"accelerator": ["*"]}, claims) is None
    assert refusal({"gpu": ["*"]}, {}, claims) is not None  # switching back is a change too
    plugin_dir = str(tmp_path)
    assert settle({"accelerator": ["*"]}, plugin_dir, applied={}) == {"accelerator": ["*"]}  # nothing prepared
    assert json.load(open(tmp_path / "skip-node-operations.json")) == {"accelerator": ["*"]}


def _agent(tmp_path, config: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYSDRA_")}
    cmd = [sys.executable, "-m", "agent", "run", "--config", config, "--root", profile_root("server-2s-gpu-nic"),
           "--node-name", "node-a", "--cluster", f"dir:{tmp_path / 'cluster'}", "--kubelet-dir", str(tmp_path / "kubelet"),
           "--cdi-dir", str(tmp_path / "cdi"), "--metrics-address", ""]  # fmt: skip
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _skips(tmp_path) -> dict[str, list[str] | None]:
    out = {}
    for path in glob.glob(str(tmp_path / "cluster" / "resourceslices" / "*.json")):
        spec = json.load(open(path))["spec"]
        for d in spec.get("devices", []):
            out[d["name"]] = spec.get("skipNodeOperations")
    return out


def _wait(what, predicate, proc, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, f"{what} not within {timeout}s"
        time.sleep(0.1)
    return value


def _stop(proc) -> str:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    return err


def test_the_agent_refuses_to_change_the_setting_while_such_claims_are_prepared(tmp_path):
    """SIGHUP and restart: the NIC rule stays while a NIC claim is prepared, then follows the config."""
    import asyncio

    config = tmp_path / "config.yaml"
    config.write_text("skip_node_operations: {}\n")
    nics = lambda skips: {k: v for k, v in skips.items() if k.startswith("nic-")}  # noqa: E731
    proc = _agent(tmp_path, str(config))
    try:
        _wait("slices", lambda: len(_skips(tmp_path)) == 12, proc)
        assert set(_skips(tmp_path).values()) == {None}
        s = build_settings({"kubelet_dir": str(tmp_path / "kubelet"), "cluster": f"dir:{tmp_path / 'cluster'}",
                            "node_name": "node-a"}, os.devnull, environ={})  # fmt: skip
        c = store_claim(s, claim("infer", [("nic", "nic-0000-1a-00-0")], pool="node-a"))

        async def kubelet(call):
            k = KubeletStandIn(s.registry_dir)
            await k.register()
            return (await getattr(k, call)(c)).claims[c["metadata"]["uid"]].error

        _wait("registration socket", lambda: os.path.exists(tmp_path / "kubelet/plugins_registry/sysdra.io-reg.sock"), proc)
        assert asyncio.run(kubelet("prepare")) == ""
        config.write_text("skip_node_operations: {nic: ['*']}\n")
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.5)
        assert set(nics(_skips(tmp_path)).values()) == {None}  # refused
    finally:
        err = _stop(proc)
    assert "skip_node_operations of nic not changed: prepared claims hold such devices" in err
    assert "default/infer (nic-0000-1a-00-0)" in err

    proc = _agent(tmp_path, str(config))  # restart with the new config: still refused
    try:
        _wait("registration socket", lambda: os.path.exists(tmp_path / "kubelet/plugins_registry/sysdra.io-reg.sock"), proc)
        time.sleep(1.0)
        assert set(nics(_skips(tmp_path)).values()) == {None}
        assert asyncio.run(kubelet("unprepare")) == ""
        proc.send_signal(signal.SIGHUP)  # nothing holds a NIC any more: applied
        _wait("the NIC rule", lambda: all(v == ["*"] for v in nics(_skips(tmp_path)).values()), proc)
        assert {v for k, v in _skips(tmp_path).items() if k.startswith("gpu-")} == {None}
    finally:
        err = _stop(proc)
    assert "skip_node_operations of nic not changed" in err and "SIGHUP: applied skip_node_operations" in err


# --- the real server and allocator ------------------------------------------------------------------
def test_our_rule_is_the_servers(apiserver):
    node = apiserver.create_node(unique("skip"))["metadata"]["name"]
    verdicts = {}
    for i, ops in enumerate(COMBOS):
        body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{node}-{i}"},
                "spec": {"driver": DRIVER, "nodeName": node, "pool": {"name": f"{node}-{i}", "generation": 1, "resourceSliceCount": 1},
                         "skipNodeOperations": ops, "devices": [{"name": "d"}]}}  # fmt: skip
        try:
            stored = apiserver.create(body)
            assert stored["spec"]["skipNodeOperations"] == ops  # the gate is on: not dropped
            verdicts[tuple(ops)] = (True, nodeops.rule_problem(ops) is None)
        except APIError as err:
            assert err.status == 422, err
            verdicts[tuple(ops)] = (False, nodeops.rule_problem(ops) is None)
    assert {k: v for k, v in verdicts.items() if v[0] != v[1]} == {}
    assert (False, False) == verdicts[("NodePrepareResources",)]


def test_the_allocator_copies_the_rule_and_prepare_follows_it(apiserver, tmp_path):
    from agent.kubeletplugin.claims import DirClaimSource
    from agent.prepare.driver import Driver
    from tests.kubelet_standin import settings_for

    node = apiserver.create_node(unique("skip"))
    name = node["metadata"]["name"]
    path = resource_path("Node", None, name) + "/status"
    node = apiserver.request("PATCH", path, body={"status": {"declaredFeatures": ["DRAOptionalNodeOperations"]}},
                             content_type="application/merge-patch+json").json()  # fmt: skip
    devices = [d.replace(attributes={"type": AttributeValue(string=d.kind)}) for d in (gpu(0), accel(1))]
    inv = inventory(*devices)
    pool = build_pool(inv, node_name=name, driver_name=DRIVER, skip_node_operations={"accelerator": ["*"]})
    slices = [apiserver.create(sl) for sl in render(pool, driver_name=DRIVER, node_name=name, generation=1, full_name=True)]
    classes = [{"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": k},
                "spec": {"selectors": [{"cel": {"expression": f'device.attributes["sysdra.io"].type == "{k}"'}}]}}
               for k in ("gpu", "accelerator")]  # fmt: skip
    c = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "mixed", "namespace": "default",
         "uid": "5f0e2c3a-8d55-4a57-9d3c-1a1b2c3d4e5f"},
         "spec": {"devices": {"requests": [{"name": "g", "exactly": {"deviceClassName": "gpu"}},
                                           {"name": "a", "exactly": {"deviceClassName": "accelerator"}}]}}}  # fmt: skip
    (allocation,) = allocate(slices, classes, c, node=node)
    by_request = {r["request"]: r for r in allocation["devices"]["results"]}
    assert by_request["a"]["skipNodeOperations"] == ["*"] and "skipNodeOperations" not in by_request["g"]
    bare = dict(node, status={k: v for k, v in node["status"].items() if k != "declaredFeatures"})
    with pytest.raises(Unschedulable):  # a node that does not declare the feature gets none of these devices
        allocate(slices, classes, c, node=bare)

    s = settings_for(str(tmp_path), node_name=name)
    c["status"] = {"allocation": allocation}
    store_claim(s, c)
    result = Driver(s, lambda: inv).prepare_claims([DirClaimSource(s.cluster_dir).read_claim("default", "mixed")])
    (res,) = result.values()
    assert res.error is None and [d.device for d in res.devices] == [by_request["g"]["device"]]
    assert [e["device"] for e in res.status] == [by_request["g"]["device"]]
    assert Driver(s, lambda: inv).unprepare_claims([ClaimRef("default", "mixed", c["metadata"]["uid"])]) == {c["metadata"]["uid"]: None}
