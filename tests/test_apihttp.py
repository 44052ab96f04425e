"""agent/kubeletplugin/apihttp.py against a local HTTP/1.1 server on 127.0.0.1 (the real API
server is tests/test_claims.py's and test_claim_status*.py's): kept connections the server closed,
rotated token files, a server behind a path, and which configurations go to lightkube's client."""

from __future__ import annotations

import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml
from lightkube import KubeConfig

from agent.kubeletplugin import apihttp

HUGE = 256 << 20  # an answer no claim comes near (MAX_CLAIM_BYTES is 3 MiB)

class Server:
    """Answers 200 with the request's path, or 401 unless the bearer token is ``want``; with
    ``drop`` it closes each connection after its answer without saying so (a server's idle
    timeout that struck while the connection sat in our pool)."""

    def __init__(self):
        self.want: str | None = None
        self.drop = False
        self.seen: list[tuple[str, str | None]] = []
        self.connections = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                owner.connections += 1
                super().setup()

            def _answer(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path == "/huge":
                    return self._huge()
                if self.path == "/trickle":
                    return self._trickle()
                if self.path == "/trickle-head":
                    return self._trickle(head=True)
                auth = self.headers.get("Authorization")
                owner.seen.append((self.path, auth))
                ok = owner.want is None or auth == f"Bearer {owner.want}"
                body = self.path.encode() if ok else b'{"kind":"Status","message":"Unauthorized"}'
                self.send_response(200 if ok else 401)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                self.close_connection = owner.drop

            def _huge(self):
                """HUGE bytes of answer, written until the client goes away."""
                self.send_response(200)
                self.send_header("Content-Length", str(HUGE))
                self.end_headers()
                chunk = b"x" * 65536
                try:
                    for _ in range(HUGE // len(chunk)):
                        self.wfile.write(chunk)
                except OSError:  # the client closed the connection
                    pass
                self.close_connection = True

            def _trickle(self, head: bool = False):
                """A byte at a time, each well within a read timeout, until the client goes away;
                ``head``: the bytes go into a header (for 60 s at most), the body never comes."""
                if head:
                    self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Pad: ")
                else:
                    self.send_response(200)
                    self.send_header("Content-Length", str(HUGE))
                    self.end_headers()
                try:
                    for _ in range(3000 if head else HUGE):
                        self.wfile.write(b"x")
                        self.wfile.flush()
                        time.sleep(0.02)
                except OSError:
                    pass
                self.close_connection = True

            do_GET = do_PATCH = _answer

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_port}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def stop(self):
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.stop()


def config(tmp_path, server_url: str, **user):
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": server_url}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
    }))  # fmt: skip
    return KubeConfig.from_file(path).get()


def test_a_kept_connection_is_reused_and_one_the_server_closed_is_replaced(server, tmp_path):
    t = apihttp.CurlTransport(config(tmp_path, server.url), 5.0, 1000)
    try:
        assert t.request("GET", "/a") == (200, b"/a")
        assert t.request("GET", "/b") == (200, b"/b")
        assert server.connections == 1
        server.drop = True
        assert t.request("PATCH", "/c", b"{}") == (200, b"/c")  # on the kept one: answered, then closed
        assert t.request("GET", "/d") == (200, b"/d")  # the kept one is dead: a new one, once
        assert server.connections == 2
    finally:
        t.close()
    assert [p for p, _ in server.seen] == ["/a", "/b", "/c", "/d"]


def test_a_rotated_token_file_is_read_again_when_the_server_says_401(server, tmp_path):
    token = tmp_path / "token"
    token.write_text("first\n")
    server.want = "first"
    t = apihttp.CurlTransport(config(tmp_path, server.url, tokenFile=str(token)), 5.0, 1000)
    try:
        assert t.request("GET", "/a").status == 200
        token.write_text("second\n")  # the kubelet rotated it
        server.want = "second"
        assert t.request("GET", "/b").status == 200
        assert t.request("GET", "/c").status == 200
        server.want = "third"  # a token the file does not have: the 401 is the answer
        assert t.request("GET", "/d").status == 401
    finally:
        t.close()
    assert server.seen == [("/a", "Bearer first"), ("/b", "Bearer first"), ("/b", "Bearer second"),
                           ("/c", "Bearer second"), ("/d", "Bearer second"), ("/d", "Bearer second")]


@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_a_token_file_that_is_no_regular_file_is_the_requests_error(server, tmp_path, kind):
    """A FIFO in the token file's place held the request's thread (a claim status write) for
    ever; a link to /dev/zero read until memory ran out."""
    token = tmp_path / "token"
    os.mkfifo(token) if kind == "fifo" else os.symlink("/dev/zero", token)
    t = apihttp.CurlTransport(config(tmp_path, server.url, tokenFile=str(token)), 5.0, 1000)
    box = {}

    def call():
        try:
            t.request("GET", "/a")
        except OSError as err:
            box["err"] = err

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(60)
    try:
        assert not thread.is_alive(), "the request still waits on the token file"
        assert "not a regular file" in str(box["err"]) and server.seen == []
    finally:
        t.close()


def test_a_server_behind_a_path_gets_the_path_and_a_static_token(server, tmp_path):
    t = apihttp.CurlTransport(config(tmp_path, server.url + "/k8s/clusters/one/", token="static"), 5.0, 1000)
    try:
        assert t.request("GET", "/apis/x") == (200, b"/k8s/clusters/one/apis/x")
    finally:
        t.close()
    assert server.seen == [("/k8s/clusters/one/apis/x", "Bearer static")]


def test_an_answer_over_the_limit_is_cut_and_its_connection_closed(server, tmp_path):
    t = apihttp.CurlTransport(config(tmp_path, server.url), 5.0, 4)
    try:
        assert t.request("GET", "/long") == (200, b"/long")  # the caller refuses more than 4 bytes
        assert t.request("GET", "/s") == (200, b"/s")
    finally:
        t.close()
    assert server.connections == 2


@pytest.mark.parametrize("kind", [apihttp.CurlTransport, apihttp.HttpxTransport])
def test_a_huge_answer_is_read_only_past_the_limit(server, tmp_path, kind):
    """Either transport stops reading an answer once it is over the limit (the caller refuses it):
    lightkube's client read all of it into memory, as long as the server kept sending (a node
    whose API server goes through an HTTPS proxy, or a kubeconfig with an exec plugin)."""
    t = kind(config(tmp_path, server.url, token="static"), 5.0, 1000)
    try:
        status, body = t.request("GET", "/huge")
    finally:
        t.close()
    assert status == 200 and 1000 < len(body) <= 1000 + (1 << 20)


@pytest.mark.parametrize("kind", [apihttp.CurlTransport, apihttp.HttpxTransport])
def test_an_answer_trickling_in_ends_at_the_timeout(server, tmp_path, kind):
    """The timeout is the whole request's, as libcurl's: with lightkube's client it was each read's,
    and a server sending a byte now and then held the prepare's thread until the size limit (3 MiB: days)."""
    t = kind(config(tmp_path, server.url, token="static"), 0.5, 200)  # 200 bytes: 4 s of trickle
    try:
        with pytest.raises(TimeoutError):
            t.request("GET", "/trickle")
    finally:
        t.close()


@pytest.mark.parametrize("kind", [apihttp.CurlTransport, apihttp.HttpxTransport])
def test_an_answer_whose_head_trickles_in_ends_at_the_timeout(server, tmp_path, kind):
    """The status line and headers count too: through lightkube's client (an exec plugin, an
    HTTPS proxy) only the body was held to the timeout, and a head trickling in (up to h11's
    16 KiB, a byte per read timeout: 45 hours) held the prepare's thread as long."""
    t = kind(config(tmp_path, server.url, token="static"), 0.5, 200)
    raised: list[BaseException] = []

    def request():
        try:
            t.request("GET", "/trickle-head")
        except BaseException as err:  # noqa: BLE001 - what the caller would get
            raised.append(err)

    thread = threading.Thread(target=request, daemon=True)
    thread.start()
    thread.join(30)  # (the server gives up after 60 s: a thread still waiting is the failure)
    t.close()
    assert not thread.is_alive() and isinstance(raised[0], TimeoutError), raised


def test_configurations_it_does_not_speak_go_to_lightkubes_client(tmp_path, monkeypatch):
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    plain = config(tmp_path, "https://127.0.0.1:6443", token="t")
    assert apihttp.CurlTransport.speaks(plain)
    exec_user = config(tmp_path, "https://127.0.0.1:6443", exec={"apiVersion": "client.authentication.k8s.io/v1",
                                                                 "command": "true"})
    assert not apihttp.CurlTransport.speaks(exec_user)
    assert isinstance(apihttp.transport(exec_user, 5.0, 1000), apihttp.HttpxTransport)
    monkeypatch.setenv("https_proxy", "http://127.0.0.1:3128")
    assert not apihttp.CurlTransport.speaks(plain)  # through the proxy, as httpx would go
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    assert apihttp.CurlTransport.speaks(plain)


def test_lightkubes_client_makes_the_same_requests(server, tmp_path):
    t = apihttp.HttpxTransport(config(tmp_path, server.url, token="static"), 5.0, 1000)
    try:
        assert t.request("PATCH", "/a?x=1", b"{}", {"Content-Type": "application/json"}) == (200, b"/a?x=1")
    finally:
        t.close()
    assert server.seen == [("/a?x=1", "Bearer static")]
