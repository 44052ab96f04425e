"""ttrpc over NRI's multiplexed connection, on asyncio streams.

NRI runs two ttrpc connections over one socket so that both sides can call each other: a
multiplexer frame is ``conn id`` and ``length`` (big-endian uint32 each) and that many bytes
of the connection's byte stream. On conn 1 the runtime calls the plugin's service; on conn 2
the plugin calls the runtime's. Each connection carries ttrpc messages: a 10-byte header
(data length and stream id, big-endian uint32; message type; flags) and the data, a
``Request`` or ``Response`` envelope (agent/protos/ttrpc_wire.proto). Only unary calls are
used by NRI: one request, one response per stream. Clients use odd stream ids.

:class:`Endpoint` is one side: it serves some connections and calls on others, so the same
class is the plugin here and the runtime in tests.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from google.protobuf.message import DecodeError, Message

from agent.protos import ttrpc_wire_pb2 as wire

log = logging.getLogger(__name__)

MUX_HEADER = struct.Struct(">II")
MSG_HEADER = struct.Struct(">IIBB")
MAX_DATA = 4 << 20  # ttrpc's limit on one message's data
MAX_FRAME = MSG_HEADER.size + MAX_DATA  # the multiplexer's limit on one frame's payload
# the longest frame written: the Go side reads its multiplexed connection through ttrpc's 4096-byte
# bufio.Reader, and the mux fails a Read into a shorter buffer than the frame (ENOMEM), which closes
# the connection; Go's own ttrpc writes at most 4096 bytes before its first flush
MUX_CHUNK = 4096
PLUGIN_CONN = 1  # the plugin serves, the runtime calls
RUNTIME_CONN = 2  # the runtime serves, the plugin calls
REQUEST, RESPONSE, DATA = 1, 2, 3
# gRPC status codes carried in Response.status
UNKNOWN, DEADLINE_EXCEEDED, UNIMPLEMENTED, UNAVAILABLE = 2, 4, 12, 14

Handler = Callable[[bytes], Awaitable[Message]]


class ProtocolError(Exception):
    """The peer broke the framing or the ttrpc rules: the connection is dropped."""


class Refusal(Exception):
    """A handler's refusal of a request (a pod that cannot get its netdevs): the caller's
    error, logged without a traceback."""


class CallError(Exception):
    """A call answered with a non-OK status."""

    def __init__(self, code: int, message: str):
        super().__init__(f"status {code}: {message}")
        self.code = code


@dataclass
class _Conn:
    """One multiplexed connection: its unparsed bytes and, when this side calls on it,
    the calls waiting for answers."""
    buffer: bytearray
    waiting: dict[int, asyncio.Future]
    next_stream: int = 1


class Endpoint:
    """One side of a multiplexed NRI connection over (reader, writer).

    ``services`` maps (conn id, "service/method") to a handler taking the request's bytes and
    returning the answer message. :meth:`serve` reads until the peer goes away; :meth:`call`
    sends a request on a connection and waits for its response.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 services: dict[tuple[int, str], Handler]):
        self._reader, self._writer = reader, writer
        self._services = services
        self._conns: dict[int, _Conn] = {}
        self._tasks: set[asyncio.Task] = set()
        self._closed: asyncio.Future = asyncio.get_running_loop().create_future()

    def _conn(self, cid: int) -> _Conn:
        if cid not in (PLUGIN_CONN, RUNTIME_CONN):  # each buffers up to a frame: only NRI's two are kept
            raise ProtocolError(f"conn {cid}: NRI has connections {PLUGIN_CONN} and {RUNTIME_CONN} only")
        if (conn := self._conns.get(cid)) is None:
            conn = self._conns[cid] = _Conn(bytearray(), {})
        return conn

    # --- writing -------------------------------------------------------------
    def _send(self, cid: int, stream: int, kind: int, data: bytes) -> None:
        if len(data) > MAX_DATA:
            raise ProtocolError(f"message of {len(data)} bytes, maximum is {MAX_DATA}")
        msg = MSG_HEADER.pack(len(data), stream, kind, 0) + data
        # frames of MUX_CHUNK at most, in one write: frames of concurrent calls never interleave
        self._writer.write(b"".join(MUX_HEADER.pack(cid, len(msg[i:i + MUX_CHUNK])) + msg[i:i + MUX_CHUNK]
                                    for i in range(0, len(msg), MUX_CHUNK)))

    async def call(self, cid: int, service: str, method: str, request: Message,
                   answer: type[Message], timeout: float = 10.0) -> Message:
        """Call ``service/method`` on connection ``cid``; the decoded answer, or CallError."""
        if self._closed.done():
            raise ConnectionError("NRI connection closed")
        conn = self._conn(cid)
        stream, conn.next_stream = conn.next_stream, conn.next_stream + 2
        future = asyncio.get_running_loop().create_future()
        conn.waiting[stream] = future
        env = wire.Request(service=service, method=method, payload=request.SerializeToString(),
                           timeout_nano=int(timeout * 1e9))
        try:
            self._send(cid, stream, REQUEST, env.SerializeToString())
            await self._writer.drain()
            response: wire.Response = await asyncio.wait_for(future, timeout)
        finally:
            conn.waiting.pop(stream, None)
        if response.status.code != 0:
            raise CallError(response.status.code, response.status.message)
        out = answer()
        out.ParseFromString(response.payload)
        return out

    # --- reading -------------------------------------------------------------
    async def serve(self) -> None:
        """Read frames until the peer closes (returns) or breaks the protocol (raises)."""
        try:
            while True:
                try:
                    head = await self._reader.readexactly(MUX_HEADER.size)
                except asyncio.IncompleteReadError:
                    return
                cid, size = MUX_HEADER.unpack(head)
                if size > MAX_FRAME:
                    raise ProtocolError(f"conn {cid}: frame of {size} bytes, maximum is {MAX_FRAME}")
                try:
                    payload = await self._reader.readexactly(size)
                except asyncio.IncompleteReadError:
                    return
                self._feed(cid, payload)
        finally:
            self.close()

    def _feed(self, cid: int, payload: bytes) -> None:
        conn = self._conn(cid)
        conn.buffer += payload
        while len(conn.buffer) >= MSG_HEADER.size:
            length, stream, kind, _flags = MSG_HEADER.unpack_from(conn.buffer)
            if length > MAX_DATA:
                raise ProtocolError(f"conn {cid}: message of {length} bytes, maximum is {MAX_DATA}")
            end = MSG_HEADER.size + length
            if len(conn.buffer) < end:
                return
            data = bytes(conn.buffer[MSG_HEADER.size:end])
            del conn.buffer[:end]
            self._message(cid, conn, stream, kind, data)

    def _message(self, cid: int, conn: _Conn, stream: int, kind: int, data: bytes) -> None:
        if kind == RESPONSE:
            future = conn.waiting.get(stream)
            if future is None or future.done():
                log.debug("NRI: answer for unknown stream %d on conn %d dropped", stream, cid)
                return
            try:
                future.set_result(_parse(wire.Response, data))
            except ProtocolError as err:
                future.set_exception(err)
        elif kind == REQUEST:
            task = asyncio.get_running_loop().create_task(self._answer(cid, stream, data))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:  # stream data belongs to streaming calls, which NRI does not make
            raise ProtocolError(f"conn {cid}: unexpected message type {kind}")

    async def _answer(self, cid: int, stream: int, data: bytes) -> None:
        response = wire.Response()
        try:
            request = _parse(wire.Request, data)
            name = f"{request.service}/{request.method}"
            handler = self._services.get((cid, name))
            if handler is None:
                response.status.code, response.status.message = UNIMPLEMENTED, f"{name} not served"
            else:
                timeout = request.timeout_nano / 1e9 if request.timeout_nano > 0 else None
                async with asyncio.timeout(timeout):  # the handler runs in this task (wait_for made another per request)
                    answer = await handler(request.payload)
                response.payload = answer.SerializeToString()
        except TimeoutError:
            response.status.code, response.status.message = DEADLINE_EXCEEDED, "timed out"
        except Exception as err:  # the handler's failure is the caller's error, not ours
            log.warning("NRI: %s", err, exc_info=not isinstance(err, (Refusal, ValueError, OSError, ProtocolError)))
            response.status.code, response.status.message = UNKNOWN, str(err) or type(err).__name__
        if self._closed.done():
            return
        self._send(cid, stream, RESPONSE, response.SerializeToString())
        try:
            await self._writer.drain()
        except ConnectionError:
            self.close()

    def close(self) -> None:
        """Drop the connection: waiting calls fail, running handlers are cancelled."""
        if self._closed.done():
            return
        self._closed.set_result(None)
        for conn in self._conns.values():
            for future in conn.waiting.values():
                if not future.done():
                    future.set_exception(ConnectionError("NRI connection closed"))
        for task in list(self._tasks):
            task.cancel()
        self._writer.close()

    async def closed(self) -> None:
        await asyncio.shield(self._closed)


def _parse(kind: type[Message], data: bytes) -> Message:
    msg = kind()
    try:
        msg.ParseFromString(data)
    except DecodeError as err:
        raise ProtocolError(f"bad {kind.__name__}: {err}") from None
    return msg
