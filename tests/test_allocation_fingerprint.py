"""A prepared claim prepared again (the kubelet does so when it restarts) is answered as prepared
while its allocation is the same as far as prepare acts on it (agent/prepare/planner.py,
``same_allocation``): a field the API server adds or defaults after an upgrade is not another
allocation, whose re-prepare would undo the running claim's host changes and do them again.
Entries written before the fingerprint covered only those fields stay accepted."""

from __future__ import annotations

import copy
import hashlib
import json
import os

import pytest

from agent.prepare import cdifiles
from agent.prepare.checkpoint import Checkpoint
from tests.kubelet_standin import claim
from tests.test_checkpoint import make_env, new_driver

GPU = "gpu-0000-1b-00-0"


def prepared(tmp_path):
    s, state = make_env(tmp_path)
    d = new_driver(s, state)
    c = claim("c", [("gpu", GPU)])
    uid = c["metadata"]["uid"]
    assert d.prepare_claims([c])[uid].error is None
    return s, d, c, uid


def marked(s, uid) -> str:
    """The claim's spec file, its times set to the epoch: a rewrite shows as a time of now."""
    path = cdifiles.claim_spec_path(s.cdi_dir, s.driver_name, uid)
    os.utime(path, (0, 0))
    return path


def rewritten(path) -> bool:
    return os.stat(path).st_mtime != 0


def results(c) -> list[dict]:
    return c["status"]["allocation"]["devices"]["results"]


@pytest.mark.parametrize("added", [
    {"futureField": {"mode": "x"}},  # a field a later API version adds to every result
    {"tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}]},  # one this agent does not act on
    {"adminAccess": False, "skipNodeOperations": []},  # explicit defaults where the field was absent
])
def test_a_result_with_fields_prepare_does_not_act_on_is_the_same_allocation(tmp_path, added):
    s, d, c, uid = prepared(tmp_path)
    spec = marked(s, uid)
    again = copy.deepcopy(c)
    results(again)[0].update(added)
    res = d.prepare_claims([again])[uid]
    assert res.error is None and [x.device for x in res.devices] == [GPU]
    assert not rewritten(spec)  # answered from the entry: nothing undone and made again


def test_another_device_is_another_allocation(tmp_path):
    s, d, c, uid = prepared(tmp_path)
    spec = marked(s, uid)
    moved = copy.deepcopy(c)
    results(moved)[0]["device"] = "gpu-0000-1c-00-0"
    res = d.prepare_claims([moved])[uid]
    assert res.error is None and [x.device for x in res.devices] == ["gpu-0000-1c-00-0"]
    assert rewritten(spec)  # the earlier prepare undone, the claim prepared anew


def test_an_entry_holding_the_hash_of_the_raw_results_is_still_the_same_allocation(tmp_path):
    s, d, c, uid = prepared(tmp_path)
    cp = Checkpoint.load(d.checkpoint_path, move_corrupt=False)
    legacy = "sha256:" + hashlib.sha256(json.dumps(results(c), sort_keys=True).encode()).hexdigest()
    assert cp.claims[uid]["allocation"] != legacy  # written in the new form
    cp.claims[uid]["allocation"] = legacy  # as the sysdra before it wrote it
    cp.save(changed=[uid])
    d = new_driver(s, {"inv": d.inventory()})
    spec = marked(s, uid)
    res = d.prepare_claims([c])[uid]
    assert res.error is None and not rewritten(spec)
