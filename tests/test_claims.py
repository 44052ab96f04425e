"""Claim sources: the dir store, and the API (the real kube-apiserver)."""

from __future__ import annotations

import asyncio
import base64
import datetime
import json

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
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


def test_kube_source_keeps_its_connection_between_pods_seconds_apart(apiserver):
    """Pods come seconds apart: a prepare after longer than httpx's 5 s default idle time still
    uses the open connection (no new TLS handshake on the pod's path)."""
    c = _plane_claim(apiserver, unique("c"), "claims-src")
    src = KubeClaimSource(AsyncClient(config=KubeConfig.from_file(apiserver.kubeconfig)))
    transports = []

    async def scenario():
        try:
            for idle in (0, 6):
                await asyncio.sleep(idle)
                assert (await asyncio.to_thread(src.read_claim, "claims-src", c["metadata"]["name"]))["metadata"]["uid"] == c["metadata"]["uid"]
                transports.append(src.api._transport)
        finally:
            src.api.close()

    asyncio.run(scenario())
    assert isinstance(transports[0], apihttp.CurlTransport) and transports[0] is transports[1]
    assert transports[0].connects == 1


def test_kube_source_speaks_tls_settings_given_inline(apiserver, tmp_path):
    """A kubeconfig with the CA, client certificate and key inline (base64 data, as `kind` and
    most installers write them) reaches the real server; a CA that did not sign its certificate
    is the claim's error, never a request sent unverified."""
    def data(path: str) -> str:
        with open(path, "rb") as f:
            return base64.b64encode(f.read()).decode()

    def kubeconfig(name: str, ca: str) -> str:
        with open(apiserver.kubeconfig) as f:
            config = json.load(f)
        cluster, user = config["clusters"][0]["cluster"], config["users"][0]["user"]
        cluster["certificate-authority-data"] = ca
        del cluster["certificate-authority"]
        user["client-certificate-data"] = data(user.pop("client-certificate"))
        user["client-key-data"] = data(user.pop("client-key"))
        path = tmp_path / name
        path.write_text(json.dumps(config))
        return str(path)

    c = _plane_claim(apiserver, unique("c"), "claims-src")
    src = KubeClaimSource(AsyncClient(config=KubeConfig.from_file(kubeconfig("inline", data(apiserver.ca_path)))))
    try:
        assert src.read_claim("claims-src", c["metadata"]["name"])["metadata"]["uid"] == c["metadata"]["uid"]
    finally:
        src.api.close()
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "another CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    other = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
             .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(key, hashes.SHA256()))
    pem = base64.b64encode(other.public_bytes(serialization.Encoding.PEM)).decode()
    wrong = KubeClaimSource(AsyncClient(config=KubeConfig.from_file(kubeconfig("wrong-ca", pem))))
    try:
        with pytest.raises(ClaimError, match="certificate"):
            wrong.read_claim("claims-src", c["metadata"]["name"])
    finally:
        wrong.api.close()
