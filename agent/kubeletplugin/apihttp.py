"""HTTP/1.1 requests to the API server for the claim requests (claimapi.py), blocking, for worker
threads: libcurl (pycurl) easy handles, pooled, each keeping its keep-alive connection.

Measured on the real node (issue 43), a claim GET cost 0.86 ms of CPU through httpx's async
stack (httpcore, anyio, h11 on the event loop), 0.42-0.49 ms through ``http.client`` in a worker
thread and 0.27-0.29 ms through libcurl (one request every 10 ms, a thread's CPU; ``http.client``
parses each answer's headers with the ``email`` package in Python); the agent makes two such
requests per prepared claim.

The connection settings are lightkube's, from the same configuration as every other request of
the agent (kubeconfig or the in-cluster service account): the server, its CA or
``insecure-skip-tls-verify``, a client certificate, a bearer token or token file (re-read when
the server answers 401: the kubelet rotates service-account tokens). Configurations this does
not speak (exec plugins, basic auth, a proxy for the server's address) go through lightkube's
own httpx client instead.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
import urllib.request
from typing import NamedTuple
from urllib.parse import urlsplit

import pycurl

from agent.fsutil import read_bounded

log = logging.getLogger(__name__)

KEEPALIVE = 90  # seconds an idle connection is kept (client-go's idle timeout; libcurl drops older ones)
MAX_TOKEN_BYTES = 1 << 20  # a projected token is a few KiB
IDLE_KEPT = 4  # handles (each with its connection) kept for reuse: the prepares and status writes in flight at once

# libcurl's failures as the OSError subclasses the callers name in their errors
_ERRORS = {pycurl.E_COULDNT_CONNECT: ConnectionRefusedError, pycurl.E_OPERATION_TIMEDOUT: TimeoutError,
           pycurl.E_GOT_NOTHING: ConnectionResetError, pycurl.E_SEND_ERROR: ConnectionResetError,
           pycurl.E_RECV_ERROR: ConnectionResetError, pycurl.E_SSL_CONNECT_ERROR: ConnectionError,
           pycurl.E_PEER_FAILED_VERIFICATION: ConnectionError}


class Response(NamedTuple):
    status: int
    body: bytes


class _Body:
    """Collects an answer up to ``limit`` bytes; libcurl stops the transfer after that."""

    def __init__(self, limit: int):
        self.parts: list[bytes] = []
        self.size, self.limit = 0, limit

    def write(self, data: bytes) -> int | None:
        self.parts.append(data)
        self.size += len(data)
        return 0 if self.size > self.limit else None  # 0: libcurl aborts (E_WRITE_ERROR)


class CurlTransport:
    """``request`` from any thread; idle handles (and their connections) are shared through a
    small pool. ``connects`` counts the connections made (tests, diagnosis)."""

    def __init__(self, config, timeout: float, max_body: int):
        url = urlsplit(config.cluster.server)
        if url.scheme not in ("https", "http") or not url.hostname:
            raise ValueError(f"API server address {config.cluster.server!r} is not an http(s) URL")
        self.base = config.cluster.server.rstrip("/")  # a server behind a path (a proxy's) keeps it
        self.timeout, self.max_body = timeout, max_body
        self._tls = _tls_options(config) if url.scheme == "https" else []
        user = config.user
        self.token_file = str(config.abs_file(user.token_file)) if user and user.token_file else None
        self._bearer = f"Bearer {user.token}" if user and user.token and not self.token_file else None
        self._idle: list[pycurl.Curl] = []
        self._lock = threading.Lock()
        self.connects = 0

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
        resp = self._send(method, path, body, headers)
        if resp.status == 401 and self.token_file is not None and not reread:  # rotated since we read it
            self._bearer = headers["Authorization"] = self._read_token()
            resp = self._send(method, path, body, headers)
        log.debug("HTTP %s %s: %d", method, path, resp.status)  # at debug, as lightkube's httpx logs its requests
        return resp

    def _read_token(self) -> str:
        """The token file, read again after a rotation: a FIFO or a link to /dev/zero in its
        place is refused (fsutil.FileRefused, an OSError: the request's error), never waited on."""
        return "Bearer " + read_bounded(self.token_file, MAX_TOKEN_BYTES).decode(errors="replace").strip()

    def _send(self, method: str, path: str, body: bytes | None, headers: dict) -> Response:
        """One exchange. libcurl checks a kept connection before it reuses it and repeats a
        request once on a new one when the server had closed the kept one (both of our
        requests may be repeated: a GET, an apply of the same fields)."""
        c = self._take()
        answer = _Body(self.max_body)
        c.setopt(pycurl.URL, self.base + path)
        if body is None:
            c.setopt(pycurl.HTTPGET, 1)
            c.unsetopt(pycurl.CUSTOMREQUEST)
            if method != "GET":
                c.setopt(pycurl.CUSTOMREQUEST, method)
        else:
            c.setopt(pycurl.CUSTOMREQUEST, method)
            c.setopt(pycurl.POSTFIELDS, body)
        # "Expect:": no wait for a 100 Continue before a body (the API server does not send one)
        c.setopt(pycurl.HTTPHEADER, [f"{k}: {v}" for k, v in headers.items()] + ["Expect:"])
        c.setopt(pycurl.WRITEFUNCTION, answer.write)
        try:
            c.perform()
        except pycurl.error as err:
            code, message = err.args
            status = c.getinfo(pycurl.RESPONSE_CODE)
            c.close()  # with its connection: the rest of the answer is still on it
            if code == pycurl.E_WRITE_ERROR and answer.size > self.max_body:
                return Response(status, b"".join(answer.parts))  # more than the limit: the caller refuses it
            raise _ERRORS.get(code, OSError)(f"{message} (libcurl error {code})") from None
        except BaseException:
            c.close()
            raise
        status = c.getinfo(pycurl.RESPONSE_CODE)
        self._give(c, c.getinfo(pycurl.NUM_CONNECTS))
        return Response(status, b"".join(answer.parts))

    def _take(self) -> pycurl.Curl:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        c = pycurl.Curl()
        c.setopt(pycurl.NOSIGNAL, 1)  # worker threads: no SIGALRM for timeouts
        # one request at a time per handle: HTTP/2's framing costs more CPU a request (measured)
        c.setopt(pycurl.HTTP_VERSION, pycurl.CURL_HTTP_VERSION_1_1)
        c.setopt(pycurl.TIMEOUT_MS, int(self.timeout * 1000))
        c.setopt(pycurl.MAXAGE_CONN, KEEPALIVE)
        c.setopt(pycurl.TCP_KEEPALIVE, 1)
        c.setopt(pycurl.PROXY, "")  # speaks() sent proxied servers to httpx: never an environment proxy here
        for option, value in self._tls:
            c.setopt(option, value)
        return c

    def _give(self, c: pycurl.Curl, connects: int) -> None:
        with self._lock:
            self.connects += connects
            if len(self._idle) < IDLE_KEPT:
                self._idle.append(c)
                return
        c.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()


def _tls_options(config) -> list[tuple[int, object]]:
    """lightkube's TLS settings as libcurl options: the cluster's CA (file or data; else the
    CAs httpx trusts, unless ``insecure-skip-tls-verify``) and the user's client certificate."""
    cluster, user = config.cluster, config.user
    out: list[tuple[int, object]] = []
    if cluster.certificate_auth:
        out.append((pycurl.CAINFO, str(config.abs_file(cluster.certificate_auth))))
    elif cluster.certificate_auth_data:
        out.append((pycurl.CAINFO_BLOB, base64.b64decode(cluster.certificate_auth_data)))
    elif cluster.insecure:
        out += [(pycurl.SSL_VERIFYPEER, 0), (pycurl.SSL_VERIFYHOST, 0)]
    else:
        import certifi

        out.append((pycurl.CAINFO, certifi.where()))
    if user is not None:
        for path, data, file_option, blob_option in ((user.client_cert, user.client_cert_data, pycurl.SSLCERT, pycurl.SSLCERT_BLOB),
                                                     (user.client_key, user.client_key_data, pycurl.SSLKEY, pycurl.SSLKEY_BLOB)):
            if path:
                out.append((file_option, str(config.abs_file(path))))
            elif data:
                out.append((blob_option, base64.b64decode(data)))
    return out


class HttpxTransport:
    """lightkube's own (httpx) client, for what :class:`CurlTransport` does not speak."""

    def __init__(self, config, timeout: float, max_body: int):
        import httpx2
        from lightkube.config import client_adapter

        params = client_adapter.ConnectionParams(timeout=httpx2.Timeout(timeout))
        self.client = httpx2.Client(**params.httpx_params(config), limits=httpx2.Limits(keepalive_expiry=KEEPALIVE))
        for t in [self.client._transport, *self.client._mounts.values()]:  # (proxies from the environment)
            if t is not None:  # every socket's reads and writes within the request's deadline
                t._pool._network_backend = _DeadlineBackend(t._pool._network_backend)
        self.timeout, self.max_body = timeout, max_body

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> Response:
        """As :meth:`CurlTransport.request`: an answer is read up to just past ``max_body`` (the
        caller refuses it), never whole into memory, its connection then closed; ``timeout`` is
        the whole request's, connection and head included (httpx's is each read's: a server
        trickling its answer never ends one)."""
        import httpx2

        _deadline.at = time.monotonic() + self.timeout
        try:
            with self.client.stream(method, path, content=body, headers=headers) as resp:
                parts, size = [], 0
                for chunk in resp.iter_bytes():
                    parts.append(chunk)
                    size += len(chunk)
                    if size > self.max_body:
                        break
                return Response(resp.status_code, b"".join(parts))
        except httpx2.TimeoutException as err:
            raise TimeoutError(f"{method} {path}: no answer within {self.timeout:g} s ({err})") from None
        finally:
            _deadline.at = None

    def close(self) -> None:
        self.client.close()


_deadline = threading.local()  # .at: the monotonic time the calling thread's request must end by


def _left(timeout: float | None) -> float | None:
    """``timeout`` (one read's or write's) cut to what is left of the thread's request."""
    at = getattr(_deadline, "at", None)
    if at is None:
        return timeout
    left = at - time.monotonic()
    if left <= 0:
        import httpcore2

        raise httpcore2.ReadTimeout("the request's deadline has passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream:
    """An httpcore network stream whose every read and write waits at most until the deadline."""

    def __init__(self, stream):
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _left(timeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _left(timeout))

    def start_tls(self, ssl_context, server_hostname=None, timeout=None):
        return _DeadlineStream(self._stream.start_tls(ssl_context, server_hostname, _left(timeout)))

    def close(self) -> None:
        self._stream.close()

    def get_extra_info(self, info: str):
        return self._stream.get_extra_info(info)


class _DeadlineBackend:
    """httpcore's network backend, its streams held to the calling thread's deadline."""

    def __init__(self, backend):
        self._backend = backend

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        return _DeadlineStream(self._backend.connect_tcp(host, port, _left(timeout), local_address, socket_options))

    def connect_unix_socket(self, path, timeout=None, socket_options=None):
        return _DeadlineStream(self._backend.connect_unix_socket(path, _left(timeout), socket_options))

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


def transport(config, timeout: float, max_body: int):
    """The transport for ``config`` (a lightkube ``SingleConfig``)."""
    kind = CurlTransport if CurlTransport.speaks(config) else HttpxTransport
    return kind(config, timeout, max_body)
