"""A small fault-injecting HTTPS proxy in front of the real kube-apiserver, for the failures a
real server does not produce on demand: 5xx bursts, slow responses, dropped watch streams,
connection resets, answers that stall, trickle or end mid-body, huge answers. Everything else
is passed through byte for byte.

The proxy terminates TLS with a certificate from the control plane's CA (so clients trust it
like the server) and opens a fresh TLS connection to the server per request, forwarding the
request unchanged (``Authorization`` included: use bearer tokens through the proxy; a client
certificate ends at the proxy). Each connection carries one request (``Connection: close``).

    proxy = FaultProxy(plane).start()
    proxy.fail_next(3, 503, method="PUT")     # the next 3 PUTs get a 503 Status
    proxy.delay(0.2)                          # every response waits 0.2 s first
    proxy.delay(30, path="/resourceslices")   # only these wait
    proxy.drop_watches()                      # cut every open watch stream now
    proxy.reset_next(2)                       # the next 2 requests: connection reset, no response
    proxy.answer_next(1, b"{garbled\\n", watch=True)  # the next watch: a 200 whose stream is these bytes
    proxy.answer_next(1, b"{", truncated=True)  # a chunk that promises more than it carries, then EOF
    proxy.flood_next(1, 10**8, path=...)      # a 200 streaming 10^8 bytes of garbage (``flooded``: how many went out)
    proxy.stall_next(1, after=100, method="GET")  # the server's answer: its head and 100 body bytes, then silence
    proxy.cut_next(1, after=100)              # ... then the connection closed (the rest never comes)
    proxy.stall_watches()                     # open watch streams forward nothing more (kept open)
    proxy.trickle(0.05)                       # answers' bodies forwarded a byte at a time, 0.05 s apart
    proxy.release()                           # close what is stalled
    proxy.clear()                             # drop the faults not taken yet
    proxy.url, proxy.write_kubeconfig(path, token=...)
"""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass
class _Fault:
    remaining: int
    status: int
    method: str | None
    path: str | None
    watch: bool | None = None
    body: bytes | None = None  # a 200 carrying these bytes (chunked, as a watch's stream) instead of a Status
    kind: str = "answer"  # or "truncated", "flood", "stall", "cut" (the last two on the server's answer)
    after: int = 0  # body bytes forwarded before a stall or a cut; the bytes of garbage a flood sends

    def matches(self, method: str, target: str) -> bool:
        return ((self.method is None or self.method == method) and (self.path is None or self.path in target)
                and (self.watch is None or self.watch == _is_watch(target)))


def _gone(writer: asyncio.StreamWriter) -> bool:
    """Whether the client closed its connection. asyncio's TLS transport says so only once we
    close it (writes after the client's close are dropped, as fast as they are made); the TCP
    transport below it says so at once."""
    below = getattr(getattr(writer.transport, "_ssl_protocol", None), "_transport", None)
    return writer.is_closing() or (below is not None and below.is_closing())


def _is_watch(target: str) -> bool:
    return "watch=true" in target or "watch=1" in target


class FaultProxy:
    def __init__(self, plane):
        self.plane = plane
        self.upstream = urlsplit(plane.url)
        self.url = ""
        self._faults: list[_Fault] = []
        self._resets = 0
        self._delay = 0.0
        self._delay_path: str | None = None
        self._watches: set[asyncio.StreamWriter] = set()
        self._lock = threading.Lock()
        self.requests: list[tuple[str, str]] = []  # (method, target) seen, in order
        self.injected = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._trickle = 0.0
        self._stalled: set[asyncio.StreamWriter] = set()  # held open, forwarding nothing, until release()
        self.flooded = 0  # garbage bytes a flood wrote before its client went away

    # -- control (thread-safe; call from the test)
    def fail_next(self, n: int, status: int = 500, *, method: str | None = None, path: str | None = None,
                  watch: bool | None = None) -> None:
        """The next ``n`` matching requests get ``status``; ``watch=False`` spares watch
        requests (a list), ``watch=True`` takes only them."""
        with self._lock:
            self._faults.append(_Fault(n, status, method, path, watch))

    def answer_next(self, n: int, body: bytes, *, path: str | None = None, watch: bool | None = None,
                    truncated: bool = False) -> None:
        """The next ``n`` matching requests get a 200 whose (chunked) body is ``body``: what no
        kube-apiserver writes (a truncated event, wrong types), as a broken proxy or server might;
        ``truncated``: the chunk's size says more than ``body`` and the connection ends there."""
        with self._lock:
            self._faults.append(_Fault(n, 200, None, path, watch, body, "truncated" if truncated else "answer"))

    def flood_next(self, n: int, size: int, *, method: str | None = None, path: str | None = None,
                   watch: bool | None = None) -> None:
        """The next ``n`` matching requests get a 200 streaming ``size`` bytes of garbage."""
        with self._lock:
            self._faults.append(_Fault(n, 200, method, path, watch, None, "flood", size))

    def stall_next(self, n: int, *, after: int = 0, method: str | None = None, path: str | None = None,
                   watch: bool | None = None) -> None:
        """The next ``n`` matching requests go to the server; of its answer, the head and ``after``
        bytes of the body come back, then nothing (the connection kept open until release())."""
        with self._lock:
            self._faults.append(_Fault(n, 200, method, path, watch, None, "stall", after))

    def cut_next(self, n: int, *, after: int = 0, method: str | None = None, path: str | None = None,
                 watch: bool | None = None) -> None:
        """As stall_next, but the connection is closed after ``after`` body bytes."""
        with self._lock:
            self._faults.append(_Fault(n, 200, method, path, watch, None, "cut", after))

    def clear(self) -> None:
        """Faults armed and not yet taken are dropped (what is stalled stays: release())."""
        with self._lock:
            self._faults.clear()

    def stall_watches(self) -> int:
        """The open watch streams forward nothing more, kept open until release()."""
        writers = list(self._watches)
        self._stalled.update(writers)
        return len(writers)

    def trickle(self, seconds: float) -> None:
        """The bodies of the server's answers come back a byte at a time, ``seconds`` apart (0: at once)."""
        self._trickle = seconds

    def release(self) -> None:
        """Close every stalled connection."""
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self._release(), self._loop).result(10)

    async def _release(self) -> None:
        stalled, self._stalled = list(self._stalled), set()
        for w in stalled:
            w.transport.abort()

    def reset_next(self, n: int) -> None:
        with self._lock:
            self._resets += n

    def delay(self, seconds: float, *, path: str | None = None) -> None:
        """Every response (or only those whose target contains ``path``) waits ``seconds`` first."""
        self._delay, self._delay_path = seconds, path

    def drop_watches(self) -> int:
        """Close every open watch stream (client side gets EOF mid-stream)."""
        assert self._loop is not None
        fut = asyncio.run_coroutine_threadsafe(self._drop(), self._loop)
        return fut.result(10)

    async def _drop(self) -> int:
        writers = list(self._watches)
        for w in writers:
            w.transport.abort()
        return len(writers)

    def open_watches(self) -> int:
        return len(self._watches)

    def write_kubeconfig(self, path: str, **kw) -> str:
        """A kubeconfig pointing at the proxy (use ``token=``: client certificates end here)."""
        return self.plane.write_kubeconfig(path, server=self.url, **kw)

    # -- lifecycle
    def start(self) -> "FaultProxy":
        cert, key = self.plane._pki.issue("faultproxy", "fault-proxy", server=True)
        self._server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._server_tls.load_cert_chain(cert, key)
        self._upstream_tls = ssl.create_default_context(cafile=self.plane.ca_path)
        ready = threading.Event()

        def run():
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)

            async def serve():
                self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self._server_tls)
                self.url = f"https://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
                ready.set()
                async with self._server:
                    await self._server.serve_forever()

            try:
                self._loop.run_until_complete(serve())
            except asyncio.CancelledError:
                pass

        self._thread = threading.Thread(target=run, name="fault-proxy", daemon=True)
        self._thread.start()
        assert ready.wait(10), "fault proxy did not start"
        return self

    def stop(self) -> None:
        if self._loop is None:
            return

        async def shutdown():
            await self._drop()
            await self._release()
            self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._thread.join(10)
        self._loop = None

    # -- the proxy
    def _take_fault(self, method: str, target: str) -> _Fault | str | None:
        with self._lock:
            if self._resets:
                self._resets -= 1
                return "reset"
            for f in self._faults:
                if f.remaining and f.matches(method, target):
                    f.remaining -= 1
                    return f
        return None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_writer = None
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            headers = [ln for ln in lines[1:] if ln]
            length = next((int(h.split(":", 1)[1]) for h in headers if h.lower().startswith("content-length:")), 0)
            body = await reader.readexactly(length) if length else b""
            self.requests.append((method, target))
            fault = self._take_fault(method, target)
            if self._delay and (self._delay_path is None or self._delay_path in target):
                await asyncio.sleep(self._delay)
            if fault == "reset":
                self.injected += 1
                writer.transport.abort()
                return
            if fault is not None:
                self.injected += 1
            if fault is not None and fault.kind not in ("stall", "cut"):
                await self._answer(writer, fault)
                return
            kept = [h for h in headers if h.split(":", 1)[0].strip().lower() not in ("connection", "host", "keep-alive")]
            kept += [f"Host: {self.upstream.netloc}", "Connection: close"]
            up_reader, upstream_writer = await asyncio.open_connection(self.upstream.hostname, self.upstream.port,
                                                                       ssl=self._upstream_tls)  # fmt: skip
            upstream_writer.write(f"{method} {target} HTTP/1.1\r\n".encode() + "\r\n".join(kept).encode("latin-1") + b"\r\n\r\n" + body)
            await upstream_writer.drain()
            resp_head = await up_reader.readuntil(b"\r\n\r\n")
            resp_lines = [ln for ln in resp_head.decode("latin-1").split("\r\n") if ln]
            resp_lines = [resp_lines[0]] + [h for h in resp_lines[1:] if h.split(":", 1)[0].strip().lower() != "connection"]
            writer.write("\r\n".join(resp_lines + ["Connection: close"]).encode("latin-1") + b"\r\n\r\n")
            if _is_watch(target):
                self._watches.add(writer)
            try:
                await self._forward(up_reader, writer, fault)
            finally:
                self._watches.discard(writer)
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError, OSError, ValueError):
            pass
        finally:
            for w in (upstream_writer, writer):
                if w is not None:
                    try:
                        w.close()
                    except Exception:  # noqa: BLE001 - already gone
                        pass

    async def _forward(self, up_reader: asyncio.StreamReader, writer: asyncio.StreamWriter, fault) -> None:
        """The server's answer body to the client, as the faults say."""
        budget = fault.after if fault is not None else -1  # body bytes until the stall or cut
        while budget != 0 and writer not in self._stalled and (chunk := await up_reader.read(65536)):
            if writer in self._stalled:
                break
            if budget > 0:
                chunk, budget = chunk[:budget], max(0, budget - len(chunk))
            await self._write(writer, chunk)
        if fault is not None and budget == 0:
            if fault.kind == "cut":
                writer.transport.abort()
                return
            self._stalled.add(writer)
        while writer in self._stalled:  # silent, until release() or stop() aborts it
            await asyncio.sleep(0.05)

    async def _write(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        if not self._trickle:
            writer.write(data)
            await writer.drain()
            return
        for i in range(len(data)):
            writer.write(data[i:i + 1])
            await writer.drain()
            await asyncio.sleep(self._trickle)

    async def _answer(self, writer: asyncio.StreamWriter, fault: _Fault) -> None:
        if fault.body is None and fault.kind == "answer":
            await self._status(writer, fault.status)
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
                     b"Connection: close\r\n\r\n")
        if fault.kind == "flood":
            garbage, self.flooded = b"x" * 65536, 0
            while self.flooded < fault.after and not _gone(writer):  # (the count: the last flood's)
                writer.write(b"%x\r\n" % len(garbage) + garbage + b"\r\n")
                await writer.drain()
                self.flooded += len(garbage)
        elif fault.kind == "truncated":
            writer.write(b"%x\r\n" % (len(fault.body) + 100) + fault.body)
            await writer.drain()
            return  # (the connection is closed by the caller)
        else:
            writer.write(b"%x\r\n" % len(fault.body) + fault.body + b"\r\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    @staticmethod
    async def _status(writer: asyncio.StreamWriter, code: int) -> None:
        body = json.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                           "message": f"injected by the fault proxy: {code}", "reason": "InternalError", "code": code}).encode()  # fmt: skip
        writer.write(f"HTTP/1.1 {code} Injected\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                     f"Connection: close\r\n\r\n".encode() + body)  # fmt: skip
        await writer.drain()
