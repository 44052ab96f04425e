"""HTTP/1.1 requests to the API server for the claim requests (claimapi.py), blocking, for worker
threads: the standard library's ``http.client`` over pooled keep-alive connections.

Measured on the real node (issue 43), a claim GET cost 0.86 ms of CPU through httpx's async
stack (httpcore, anyio, h11 on the event loop) and 0.36 ms through ``http.client`` in a worker
thread, the thread hop included; the agent makes two such requests per prepared claim.

The connection settings are lightkube's, from the same configuration as every other request of
the agent (kubeconfig or the in-cluster service account): the server, its CA or
``insecure-skip-tls-verify``, a client certificate (lightkube's ``verify_cluster`` builds the
TLS context), a bearer token or token file (re-read when the server answers 401: the kubelet
rotates service-account tokens). Configurations this does not speak (exec plugins, basic auth,
a proxy for the server's address) go through lightkube's own httpx client instead.
"""

from __future__ import annotations

import http.client
import logging
import threading
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

KEEPALIVE = 90.0  # seconds an idle connection is kept (client-go's idle timeout)
IDLE_KEPT = 4  # connections kept for reuse: the prepares and status writes in flight at once


class Response(NamedTuple):
    status: int
    body: bytes


class StdlibTransport:
    """``request`` from any thread; idle connections are shared through a small pool."""

    def __init__(self, config, timeout: float, max_body: int):
        url = urlsplit(config.cluster.server)
        if url.scheme not in ("https", "http") or not url.hostname:
            raise ValueError(f"API server address {config.cluster.server!r} is not an http(s) URL")
        self.host, self.port = url.hostname, url.port
        self.prefix = url.path.rstrip("/")  # a server behind a path (a proxy's)
        self.timeout, self.max_body = timeout, max_body
        self.context = None
        if url.scheme == "https":
            from lightkube.config.client_adapter import verify_cluster

            self.context = verify_cluster(config.cluster, config.user, config.abs_file, trust_env=False)
        user = config.user
        self.token_file = str(config.abs_file(user.token_file)) if user and user.token_file else None
        self._bearer = f"Bearer {user.token}" if user and user.token and not self.token_file else None
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []
        self._lock = threading.Lock()

    @staticmethod
    def speaks(config) -> bool:
        """Whether this transport can make the configuration's requests (else lightkube's)."""
        user = config.user
        if user is not None and (user.exec or user.username or user.auth_provider):
            return False
        url = urlsplit(config.cluster.server)
        if url.hostname and urllib.request.getproxies_environment().get(url.scheme):
            return bool(urllib.request.proxy_bypass_environment(url.hostname))
        return True

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> Response:
        headers = dict(headers or {})
        reread = False
        if self.token_file is not None:
            if self._bearer is None:
                self._bearer = self._read_token()
                reread = True
        if self._bearer is not None:
            headers["Authorization"] = self._bearer
        resp = self._send(method, self.prefix + path, body, headers)
        if resp.status == 401 and self.token_file is not None and not reread:  # rotated since we read it
            self._bearer = headers["Authorization"] = self._read_token()
            resp = self._send(method, self.prefix + path, body, headers)
        log.debug("HTTP %s %s: %d", method, path, resp.status)  # at debug, as lightkube's httpx logs its requests
        return resp

    def _read_token(self) -> str:
        return "Bearer " + Path(self.token_file).read_text().strip()

    def _send(self, method: str, path: str, body: bytes | None, headers: dict) -> Response:
        conn, reused = self._take()
        try:
            return self._exchange(conn, method, path, body, headers)
        except ConnectionError:  # RemoteDisconnected too
            conn.close()
            if not reused:
                raise
        except BaseException:
            conn.close()
            raise
        # A kept connection the server had closed: once more on a new one. Both of our
        # requests may be repeated (a GET; an apply of the same fields).
        conn = self._connect()
        try:
            return self._exchange(conn, method, path, body, headers)
        except BaseException:
            conn.close()
            raise

    def _exchange(self, conn, method: str, path: str, body: bytes | None, headers: dict) -> Response:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read(self.max_body + 1)  # more than that is refused by the caller
        if resp.will_close or len(data) > self.max_body:
            conn.close()
        else:
            self._give(conn)
        return Response(resp.status, data)

    def _take(self) -> tuple[http.client.HTTPConnection, bool]:
        now = time.monotonic()
        with self._lock:
            while self._idle:
                conn, since = self._idle.pop()
                if now - since < KEEPALIVE:
                    return conn, True
                conn.close()
        return self._connect(), False

    def _give(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < IDLE_KEPT:
                self._idle.append((conn, time.monotonic()))
                return
        conn.close()

    def _connect(self) -> http.client.HTTPConnection:
        if self.context is None:
            return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        return http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout, context=self.context)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()


class HttpxTransport:
    """lightkube's own (httpx) client, for what :class:`StdlibTransport` does not speak."""

    def __init__(self, config, timeout: float, max_body: int):
        import httpx2
        from lightkube.config import client_adapter

        params = client_adapter.ConnectionParams(timeout=httpx2.Timeout(timeout))
        self.client = httpx2.Client(**params.httpx_params(config), limits=httpx2.Limits(keepalive_expiry=KEEPALIVE))

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> Response:
        resp = self.client.request(method, path, content=body, headers=headers)
        return Response(resp.status_code, resp.content)

    def close(self) -> None:
        self.client.close()


def transport(config, timeout: float, max_body: int):
    """The transport for ``config`` (a lightkube ``SingleConfig``)."""
    kind = StdlibTransport if StdlibTransport.speaks(config) else HttpxTransport
    return kind(config, timeout, max_body)
