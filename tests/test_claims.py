"""Claim sources: the dir store, and the API (the real kube-apiserver)."""

from __future__ import annotations

import asyncio

import pytest
from lightkube import AsyncClient, KubeConfig

from agent.kubeletplugin import apihttp
from agent.kubeletplugin.claims import ClaimError, DirClaimSource, KubeClaimSource, claim_source
from tests.controlplane import free_port, unique
from tests.kubelet_standin import claim, settings_for, store_claim


def test_dir_source(tmp_path):
    s = settings_for(str(tmp_path))
    c = store_claim(s, claim("c", [("r", "d")]))
    src = claim_source(s)
    assert isinstance(src, DirClaimSource)
    assert src.read_claim("default", "c") == c
    with pytest.raises(ClaimError, match="not found"):
        src.read_claim("default", "nope")


def _plane_claim(plane, name: str, namespace: str) -> dict:
    """A ResourceClaim on the real server; allocation is written as the scheduler does (status)."""
    try:
        plane.create_namespace(namespace)
    except Exception:  # noqa: BLE001 - exists from another test of the session
        pass
    c = plane.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                      "metadata": {"name": name, "namespace": namespace},
                      "spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": "gpu.sysdra.io"}}]}}})
    return c


def test_kube_source_returns_the_servers_json(apiserver):
    """The claim as the real kube-apiserver v1.37.2 sends it, as a dict (no model round trip)."""
    c = _plane_claim(apiserver, unique("c"), "claims-src")
    client = AsyncClient(config=KubeConfig.from_file(apiserver.kubeconfig))
    src = KubeClaimSource(client)

    async def scenario():
        try:
            return await asyncio.to_thread(src.read_claim, "claims-src", c["metadata"]["name"])
        finally:
            src.api.close()

    got = asyncio.run(scenario())
    assert got["metadata"]["uid"] == c["metadata"]["uid"]
    assert got["metadata"]["resourceVersion"] == c["metadata"]["resourceVersion"]
    assert got["spec"] == c["spec"]


def test_kube_source_errors_are_claim_errors(apiserver, tmp_path):
    client = AsyncClient(config=KubeConfig.from_file(apiserver.kubeconfig))
    src = KubeClaimSource(client)

    async def missing():
        try:
            await asyncio.to_thread(src.read_claim, "claims-src", "nope")
        finally:
            src.api.close()

    with pytest.raises(ClaimError, match="ResourceClaim claims-src/nope not found"):
        asyncio.run(missing())
    # nothing listens there: the connection error is the claim's error, not the call's
    bad = apiserver.write_kubeconfig(str(tmp_path / "bad.kubeconfig"), cert=apiserver.admin_cert)
    with open(bad) as f:
        text = f.read().replace(apiserver.url, f"https://127.0.0.1:{free_port()}")
    with open(bad, "w") as f:
        f.write(text)
    refused = KubeClaimSource(AsyncClient(config=KubeConfig.from_file(bad)))
    with pytest.raises(ClaimError, match="default/c: ConnectionRefusedError"):
        refused.read_claim("default", "c")


def test_kube_source_keeps_its_connection_between_pods_seconds_apart(apiserver, monkeypatch):
    """Pods come seconds apart: a prepare after longer than httpx's 5 s default idle time still
    uses the open connection (no new TLS handshake on the pod's path)."""
    c = _plane_claim(apiserver, unique("c"), "claims-src")
    src = KubeClaimSource(AsyncClient(config=KubeConfig.from_file(apiserver.kubeconfig)))
    connects = []
    real = apihttp.StdlibTransport._connect
    monkeypatch.setattr(apihttp.StdlibTransport, "_connect", lambda self: connects.append(1) or real(self))

    async def scenario():
        try:
            for idle in (0, 6):
                await asyncio.sleep(idle)
                assert (await asyncio.to_thread(src.read_claim, "claims-src", c["metadata"]["name"]))["metadata"]["uid"] == c["metadata"]["uid"]
        finally:
            src.api.close()

    asyncio.run(scenario())
    assert len(connects) == 1
