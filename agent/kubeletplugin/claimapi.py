"""The two requests the kubelet plugin makes about a ResourceClaim: GET it at prepare, apply our
``status.devices`` after. The claim stays the JSON the server sent (a dict, what the driver
reads); decoding it into lightkube's models and back cost more CPU than the rest of a prepare.

Connection settings (kubeconfig or the in-cluster service account, TLS, bearer token, timeout)
come from lightkube's configuration, as for every other request of the agent; one pooled HTTP
client serves both requests, so a prepare reuses the status writer's connection.
"""

from __future__ import annotations

import orjson

from agent.apilimits import MAX_CLAIM_BYTES

TIMEOUT = 10.0
# An idle connection is kept this long (httpx's default, 5 s, made most prepares of a node
# whose pods come seconds apart pay a new TLS handshake); client-go keeps its own for 90 s.
KEEPALIVE = 90.0
APPLY = "application/apply-patch+yaml"  # JSON is YAML: the server takes the body as it is


class ApiFailure(Exception):
    """The server answered with an error (``code``), or the answer was unusable (code None)."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code


def _path(namespace: str, name: str) -> str:
    # namespace and name were checked as DNS names (service.check_ref): nothing to escape
    return f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"


class ClaimApi:
    """``client``: a lightkube ``AsyncClient`` whose configuration to use, or None for the
    default one ($KUBECONFIG, ~/.kube/config or the in-cluster service account). The HTTP
    client is made at the first request."""

    def __init__(self, client=None, field_manager: str = "sysdra.io"):
        self._lightkube = client
        self.field_manager = field_manager
        self._http = None

    def _client(self):
        if self._http is None:
            import httpx2
            from lightkube import AsyncClient
            from lightkube.config import client_adapter

            config = (self._lightkube or AsyncClient()).config
            params = client_adapter.ConnectionParams(timeout=httpx2.Timeout(TIMEOUT))
            self._http = httpx2.AsyncClient(**params.httpx_params(config), limits=httpx2.Limits(keepalive_expiry=KEEPALIVE))
        return self._http

    async def get(self, namespace: str, name: str) -> dict:
        resp = await self._client().get(_path(namespace, name), headers={"Accept": "application/json"})
        what = f"ResourceClaim {namespace}/{name}"
        if resp.status_code != 200:
            raise ApiFailure(f"{what}: API error {resp.status_code}: {_reason(resp)}", resp.status_code)
        if len(resp.content) > MAX_CLAIM_BYTES:
            raise ApiFailure(f"{what}: the answer is {len(resp.content)} bytes, more than {MAX_CLAIM_BYTES}")
        try:
            claim = orjson.loads(resp.content)
        except ValueError as err:
            raise ApiFailure(f"{what}: the answer is not JSON: {err}") from err
        if not isinstance(claim, dict):
            raise ApiFailure(f"{what}: the answer is not a JSON object")
        return claim

    async def apply_status(self, body: dict, resource_version: str | None) -> None:
        """Server-side apply of ``body`` (a ResourceClaim with ``status.devices``) on the status
        subresource as our field manager, conditional on ``resource_version`` when given."""
        meta = body["metadata"]
        if resource_version:
            body = {**body, "metadata": {**meta, "resourceVersion": resource_version}}
        resp = await self._client().patch(
            _path(meta["namespace"], meta["name"]) + "/status", content=orjson.dumps(body),
            params={"fieldManager": self.field_manager, "force": "true"},
            headers={"Content-Type": APPLY, "Accept": "application/json"})
        if resp.status_code not in (200, 201):
            raise ApiFailure(f"ResourceClaim {meta['namespace']}/{meta['name']}: API error {resp.status_code}: "
                             f"{_reason(resp)}", resp.status_code)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None


def _reason(resp) -> str:
    """The message of the server's Status object, else the start of the body."""
    try:
        status = orjson.loads(resp.content)
        if isinstance(status, dict) and isinstance(status.get("message"), str):
            return status["message"][:1000]
    except ValueError:
        pass
    return resp.content[:200].decode("utf-8", "replace")
