"""Claim sources: dir store and the API (lightkube AsyncClient, faked)."""

from __future__ import annotations

import asyncio

import pytest
from lightkube.resources.resource_v1 import ResourceClaim

from agent.kubeletplugin.claims import ClaimError, DirClaimSource, KubeClaimSource, claim_source
from tests.kubelet_standin import claim, settings_for, store_claim


def test_dir_source(tmp_path):
    s = settings_for(str(tmp_path))
    c = store_claim(s, claim("c", [("r", "d")]))
    src = claim_source(s)
    assert isinstance(src, DirClaimSource)
    assert asyncio.run(src.get_claim("default", "c")) == c
    with pytest.raises(ClaimError, match="not found"):
        asyncio.run(src.get_claim("default", "nope"))


class FakeClient:
    def __init__(self, obj=None, err=None):
        self.obj, self.err, self.calls = obj, err, []

    async def get(self, res, name, namespace):
        self.calls.append((res, name, namespace))
        if self.err:
            raise self.err
        return self.obj


def test_kube_source_returns_api_json():
    c = claim("c", [("r", "d")], share_ids={"d": "s-1"})
    fake = FakeClient(ResourceClaim.from_dict(c))
    got = asyncio.run(KubeClaimSource(fake).get_claim("default", "c"))
    assert fake.calls == [(ResourceClaim, "c", "default")]
    assert got["metadata"]["uid"] == c["metadata"]["uid"]
    assert got["status"]["allocation"]["devices"]["results"][0]["shareID"] == "s-1"


def test_kube_source_errors_are_claim_errors():
    with pytest.raises(ClaimError, match="default/c: ConnectionError: refused"):
        asyncio.run(KubeClaimSource(FakeClient(err=ConnectionError("refused"))).get_claim("default", "c"))
