"""The kubelet's claim references and the fetched ResourceClaims, checked before use
(agent/kubeletplugin/claimcheck.py), as a table. The pure checks are called directly; the
running plugin's answers to such input are in tests/test_kubeletplugin.py and, against the real
agent, tests/faults/test_hostile.py (slow)."""

from __future__ import annotations

import copy

import pytest

from agent.kubeletplugin.claimcheck import check_claim, check_ref
from agent.kubeletplugin.types import ClaimRef

UID = "7f1c7a52-0000-4000-8000-000000000001"
REF = ClaimRef("default", "c", UID)


@pytest.mark.parametrize("ref, words", [
    (ClaimRef("default", "c" * 254, UID), "name is 254 characters long (at most 253)"),
    (ClaimRef("default", "a\x00b", UID), "contains a path separator"),
    (ClaimRef("default", "a\\b", UID), "contains a path separator"),
    (ClaimRef("default", "C_1", UID), "name 'C_1' is not a DNS subdomain"),
    (ClaimRef("default", "c", "a_b"), "claim uid 'a_b' is malformed"),
])
def test_a_bad_reference_is_refused(ref, words):
    assert words in (check_ref(ref) or "")


def test_a_good_reference_passes():
    assert check_ref(REF) is None and check_ref(ClaimRef("default", "c" * 253, UID)) is None


def _claim() -> dict:
    return {"metadata": {"namespace": "default", "name": "c", "uid": UID, "annotations": {"a": "b"}},
            "status": {"allocation": {"devices": {"results": []}}}}


def _with(path: tuple, value: object) -> dict:
    claim = copy.deepcopy(_claim())
    node = claim
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return claim


@pytest.mark.parametrize("claim, words", [
    (_with(("metadata", "namespace"), "other"), "its metadata.namespace is 'other', not the requested 'default'"),
    (_with(("metadata", "name"), "d"), "its metadata.name is 'd'"),
    (_with(("metadata", "uid"), UID.replace("1", "2")), "it was replaced"),
    (_with(("metadata", "annotations"), {"a": 1}), "metadata.annotations is not a map of strings"),
    (_with(("metadata", "annotations"), ["a"]), "metadata.annotations is not a map of strings"),
    (_with(("metadata",), "x"), "metadata is not an object"),
    (_with(("status",), ["x"]), "status is not an object"),
    (_with(("status",), {}), "is not allocated"),
    (_with(("status", "allocation"), ["x"]), "status.allocation is not an object"),
    (_with(("status", "allocation", "devices"), ["x"]), "status.allocation.devices is not an object"),
    (_with(("status", "allocation", "devices", "results"), {"a": 1}), "status.allocation.devices.results is not a list"),
    ("x", "is not an object"),
])
def test_a_fetched_claim_not_the_requested_one_or_of_the_wrong_shape_is_refused(claim, words):
    why = check_claim(REF, claim)
    assert why and why.startswith("ResourceClaim default/c") and words in why, why


def test_a_fetched_claim_of_the_request_passes():
    assert check_claim(REF, _claim()) is None
    assert check_claim(REF, _with(("status", "allocation", "devices"), None)) is None  # devices of no driver
