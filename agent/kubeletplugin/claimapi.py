"""The two requests the kubelet plugin makes about a ResourceClaim: GET it at prepare, apply our
``status.devices`` after. The claim stays the JSON the server sent (a dict, what the driver
reads); decoding it into lightkube's models and back cost more CPU than the rest of a prepare.

Connection settings (kubeconfig or the in-cluster service account, TLS, bearer token, timeout)
come from lightkube's configuration, as for every other request of the agent. The requests are
blocking (``apihttp``), made in the threads that need them: a prepare's worker thread reads, the
status writer's threads apply; the claim reads and the status writes share pooled keep-alive
connections. ``apihttp`` (libcurl and its own TLS library, ~8 MB of the process) is loaded when
a ``ClaimApi`` is made: an agent with an offline cluster directory makes none.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING
from urllib.parse import urlencode

import orjson

from agent.apilimits import MAX_CLAIM_BYTES

if TYPE_CHECKING:
    from agent.kubeletplugin import apihttp

TIMEOUT = 10.0
APPLY = "application/apply-patch+yaml"  # JSON is YAML: the server takes the body as it is


class ApiFailure(Exception):
    """The server answered with an error (``code``), or the answer was unusable (code None)."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code


def _path(namespace: str, name: str) -> str:
    # namespace and name were checked as DNS names (claimcheck.check_ref): nothing to escape
    return f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"


class ClaimApi:
    """``client``: a lightkube ``AsyncClient`` whose configuration to use, or None for the
    default one ($KUBECONFIG, ~/.kube/config or the in-cluster service account). The
    connection is made at the first request."""

    def __init__(self, client=None, field_manager: str = "sysdra.io"):
        self._lightkube = client
        self.field_manager = field_manager
        from agent.kubeletplugin import apihttp

        self._make_transport = apihttp.transport
        self._transport = None
        self._made = threading.Lock()  # the first requests, in several threads, make one transport

    def _send(self, method: str, path: str, body: bytes | None, headers: dict | None) -> apihttp.Response:
        transport = self._transport
        if transport is None:  # in the thread: reading the configuration touches files
            with self._made:
                if self._transport is None:
                    from lightkube import AsyncClient

                    config = (self._lightkube or AsyncClient()).config
                    self._transport = self._make_transport(config, TIMEOUT, MAX_CLAIM_BYTES)
                transport = self._transport
        return transport.request(method, path, body, headers)

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> apihttp.Response:
        """Another request on the same connection settings and pool (the MPS daemon pods')."""
        return self._send(method, path, body, headers or {})

    def read(self, namespace: str, name: str) -> dict:
        """GET the claim, as the JSON object the server sent."""
        resp = self._send("GET", _path(namespace, name), None, {"Accept": "application/json"})
        what = f"ResourceClaim {namespace}/{name}"
        if resp.status != 200:
            raise ApiFailure(f"{what}: API error {resp.status}: {_reason(resp.body)}", resp.status)
        if len(resp.body) > MAX_CLAIM_BYTES:
            raise ApiFailure(f"{what}: the answer is more than {MAX_CLAIM_BYTES} bytes")
        try:
            claim = orjson.loads(resp.body)
        except ValueError as err:
            raise ApiFailure(f"{what}: the answer is not JSON: {err}") from err
        if not isinstance(claim, dict):
            raise ApiFailure(f"{what}: the answer is not a JSON object")
        return claim

    def apply_status(self, body: dict, resource_version: str | None) -> None:
        """Server-side apply of ``body`` (a ResourceClaim with ``status.devices``) on the status
        subresource as our field manager, conditional on ``resource_version`` when given."""
        meta = body["metadata"]
        if resource_version:
            body = {**body, "metadata": {**meta, "resourceVersion": resource_version}}
        query = urlencode({"fieldManager": self.field_manager, "force": "true"})
        resp = self._send("PATCH", f"{_path(meta['namespace'], meta['name'])}/status?{query}",
                          orjson.dumps(body), {"Content-Type": APPLY, "Accept": "application/json"})
        if resp.status not in (200, 201):
            raise ApiFailure(f"ResourceClaim {meta['namespace']}/{meta['name']}: API error {resp.status}: "
                             f"{_reason(resp.body)}", resp.status)

    def close(self) -> None:
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.close()


def _reason(body: bytes) -> str:
    """The message of the server's Status object, else the start of the body."""
    try:
        status = orjson.loads(body)
        if isinstance(status, dict) and isinstance(status.get("message"), str):
            return status["message"][:1000]
    except ValueError:
        pass
    return body[:200].decode("utf-8", "replace")
