"""The agent's CDI specs read back damaged (agent/prepare/cdifiles.py, claimfiles.py): recovery
reads every prepared claim's specs; a damaged one is rewritten, never an exception that stops
the agent's start."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from agent.prepare import cdifiles
from agent.prepare.driver import Driver
from agent.prepare.metadata import layout
from cdi.spec import SpecError
from tests.kubelet_standin import DRIVER, claim
from tests.test_metadata import NIC0, env, prepared
from tests.test_records_damaged import damaged


@pytest.fixture
def node(tmp_path):
    """A prepared claim with metadata: its claim spec and its request's metadata spec."""
    s, state = env(tmp_path)
    c = claim("c", [("net", NIC0)])
    prepared(s, state, c)
    uid = c["metadata"]["uid"]
    return s, state, {"claim": cdifiles.claim_spec_path(s.cdi_dir, DRIVER, uid),
                      "metadata": layout.spec_path(s.cdi_dir, DRIVER, uid, "net")}


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("which", ["claim", "metadata"])
def test_a_spec_nested_too_deep_is_rewritten_at_start(node, which):
    s, state, paths = node
    _write(paths[which], b"[" * 100000)
    with pytest.raises(SpecError, match="nested too deep"):
        cdifiles.read_spec(paths[which])
    Driver(s, lambda: state["inv"]).recover()  # raised RecursionError: the agent did not start
    assert cdifiles.read_spec(paths[which])["devices"]


@pytest.mark.parametrize("which", ["claim", "metadata"])
def test_a_spec_of_another_json_type_where_a_list_is_is_rewritten_at_start(node, which):
    """Recovery raised TypeError from the validator (no agent start)."""
    import json

    s, state, paths = node
    with open(paths[which]) as f:
        spec = json.load(f)
    spec["devices"][0]["containerEdits"]["deviceNodes"] = 5
    _write(paths[which], json.dumps(spec).encode())
    with pytest.raises(SpecError, match="deviceNodes: must be a list"):
        cdifiles.read_spec(paths[which])
    Driver(s, lambda: state["inv"]).recover()
    assert isinstance(cdifiles.read_spec(paths[which])["devices"][0]["containerEdits"].get("deviceNodes", []), list)


@settings(max_examples=60, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), which=st.sampled_from(["claim", "metadata"]))
def test_any_damage_to_a_spec_leaves_a_valid_one_after_recovery(node, data, which):
    s, state, paths = node
    with open(paths[which], "rb") as f:
        valid = f.read()
    _write(paths[which], data.draw(damaged(valid)))
    try:
        cdifiles.read_spec(paths[which])
    except SpecError:  # the one error a reader sees
        pass
    Driver(s, lambda: state["inv"]).recover()
    cdifiles.read_spec(paths[which])
    _write(paths[which], valid)


# --- NVIDIA's own CDI specs (nvidia_cdi_spec: another program's files, agent/prepare/nvidia.py) -----
@pytest.mark.parametrize("bad", [{"devices": 5}, {"devices": [{"name": "9", "containerEdits": {"deviceNodes": 5}}]}])
def test_a_malformed_nvidia_spec_is_skipped_and_the_gpu_found_in_the_good_one(tmp_path, bad):
    """The runtime ignores a spec it cannot read: one that the agent iterated as it is (an
    integer for a list) failed every NVIDIA claim with an internal error."""
    import json

    from tests.test_nvidia_driver import copy_profile, prepare_gpu

    root = copy_profile(tmp_path, "server-2s-gpu-nic")
    os.makedirs(os.path.join(root, "etc/cdi"))
    good = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
            "devices": [{"name": "2", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia2"}]}}]}
    for name, spec in (("a-bad.json", {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", **bad}), ("b-good.json", good)):
        with open(os.path.join(root, "etc/cdi", name), "w") as f:
            json.dump(spec, f)
    res, _, _ = prepare_gpu(tmp_path, root, "gpu-0000-18-00-0", nvidia_cdi_spec=True)  # /dev/nvidia2
    assert res.error is None, res.error
    assert res.devices[0].cdi_ids[1] == "nvidia.com/gpu=2"


# --- a directory where one of our spec files should be -------------------------------------------
GHOST = "0a0a0a0a-0000-4000-8000-000000000000"


def test_a_directory_at_a_prepared_claims_spec_costs_only_that_claim(node, caplog):
    """Recovery raised WriteError (no agent start, every claim of the node without service),
    its unprepare IsADirectoryError (retried by the kubelet for ever)."""
    from agent.kubeletplugin.types import ClaimRef

    s, state, paths = node
    other = claim("other", [("r", "gpu-0000-1b-00-0")])
    assert Driver(s, lambda: state["inv"]).prepare_claims([other])[other["metadata"]["uid"]].error is None
    other_spec = cdifiles.claim_spec_path(s.cdi_dir, DRIVER, other["metadata"]["uid"])
    os.unlink(paths["claim"])
    os.mkdir(paths["claim"])
    os.unlink(other_spec)  # lost: rebuilt by the same recovery
    d = Driver(s, lambda: state["inv"])
    d.recover()
    assert cdifiles.read_spec(other_spec)["devices"] and "cannot rewrite its CDI spec" in caplog.text
    uid = os.path.basename(paths["claim"]).removeprefix(cdifiles.claim_spec_prefix(DRIVER)).removesuffix(".json")
    assert d.unprepare_claims([ClaimRef("default", "c", uid)]) == {uid: None}
    assert os.path.isdir(paths["claim"])  # not ours to remove: said


@pytest.mark.parametrize("name", [f"k8s.{DRIVER}-claim_{GHOST}.json", f"{DRIVER}_metadata_{GHOST}_r.json"])
def test_a_directory_under_an_orphan_specs_name_is_left_and_said(node, name, caplog):
    s, state, paths = node
    os.mkdir(os.path.join(s.cdi_dir, name))
    Driver(s, lambda: state["inv"]).recover()  # raised IsADirectoryError: no agent start
    assert os.path.isdir(os.path.join(s.cdi_dir, name)) and "not removed" in caplog.text
    assert cdifiles.read_spec(paths["claim"])


def test_a_valid_spec_that_is_not_the_one_written_is_written_again(node, caplog):
    """A flipped byte that keeps the file valid (/dev/nvidia2 -> /dev/nvidia3: one bit) gave the
    claim's containers another device: recovery took any spec that parses."""
    import json

    s, state, paths = node
    with open(paths["claim"]) as f:
        written = json.load(f)
    altered = json.loads(json.dumps(written).replace('"SYSDRA_DEVICES=nic-0000-40-00-0"', '"SYSDRA_DEVICES=nic-0000-41-00-0"'))
    assert altered != written
    with open(paths["claim"], "w") as f:
        json.dump(altered, f)
    Driver(s, lambda: state["inv"]).recover()
    assert cdifiles.read_spec(paths["claim"]) == written and "differs from the one recorded" in caplog.text
