"""A route netlink (rtnetlink) listener read on the event loop: the kernel's link and route
announcements (what ``ip monitor`` shows), which any process may receive. Each reader parses the
datagrams it gets; a socket overrun (lost messages) is reported as ``None``."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import struct
from typing import Callable, Iterator

log = logging.getLogger(__name__)

_NLMSG = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid


def align(n: int) -> int:
    return (n + 3) & ~3


def messages(data: bytes) -> Iterator[tuple[int, memoryview]]:
    """(type, body) of each netlink message in one datagram; a malformed one ends the walk."""
    view = memoryview(data)
    off = 0
    while off + _NLMSG.size <= len(data):
        length, mtype, _, _, _ = _NLMSG.unpack_from(data, off)
        if length < _NLMSG.size or off + length > len(data):
            return
        yield mtype, view[off + _NLMSG.size:off + length]
        off += align(length)


class Listener:
    """Calls ``on_batch(datagrams)`` on the event loop for what one wake-up read; ``datagrams`` is
    None when the kernel dropped messages, so the reader assumes anything changed."""

    def __init__(self, groups: int, on_batch: Callable[[list[bytes] | None], None], what: str):
        self.groups, self.on_batch, self.what = groups, on_batch, what
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
                             socket.NETLINK_ROUTE)
        try:
            sock.bind((0, self.groups))
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._loop.add_reader(sock.fileno(), self._readable)

    def stop(self) -> None:
        if self._sock is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None

    def _readable(self) -> None:
        batch: list[bytes] | None = []
        while self._sock is not None:
            try:
                data = self._sock.recv(65536)
            except BlockingIOError:
                break
            except OSError as err:
                if err.errno != errno.ENOBUFS:
                    log.warning("%s: %s", self.what, err)
                    break
                batch = None  # overrun: some messages were lost
                continue
            if batch is not None:
                batch.append(data)
        if batch is None or batch:
            self.on_batch(batch)
