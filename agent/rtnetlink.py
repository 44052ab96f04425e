"""A route netlink (rtnetlink) listener read on the event loop: the kernel's link and route
announcements (what ``ip monitor`` shows), which any process may receive. Each reader parses the
datagrams it gets; a socket overrun (lost messages) is reported as ``None``.

A netlink socket belongs to the network namespace it was made in, and hears that namespace's
links and routes: ``socket_in`` makes one inside another namespace, ``host_events_socket`` the
one the host's events are heard on (the DaemonSet's agent is in its pod's namespace)."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import socket
import struct
from typing import Callable, Iterator

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)

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

    def start(self, sock: socket.socket | None = None) -> None:
        """Listen on ``sock`` (an unbound NETLINK_ROUTE socket, e.g. another namespace's from
        ``socket_in``), or on a new one of this process's namespace."""
        self._loop = asyncio.get_running_loop()
        if sock is None:
            sock = _netlink(socket.NETLINK_ROUTE)
        sock.setblocking(False)
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


def _netlink(protocol: int) -> socket.socket:
    return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, protocol)


def init_netns(root: str) -> str:
    """The path of the network namespace of the init under ``root``: the host's."""
    return os.path.join(root, "proc", "1", "ns", "net")


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _same_file(a: int, b: int) -> bool:
    sa, sb = os.fstat(a), os.fstat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def socket_in(netns: str, protocol: int = socket.NETLINK_ROUTE) -> socket.socket:
    """An unbound netlink socket of ``protocol`` in the network namespace at ``netns`` (a path).
    Blocking: it switches the calling thread alone (setns affects one thread) and back, so call
    it in a worker thread. The caller's own namespace needs no switch, and no right to enter one."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        target = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if _same_file(own, target):
                return _netlink(protocol)
            _setns(target)
            try:
                return _netlink(protocol)
            finally:
                _setns(own)  # never leave this thread in another namespace
        finally:
            os.close(target)
    finally:
        os.close(own)


def host_events_socket(root: str, kernel: bool) -> socket.socket | None:
    """An unbound NETLINK_ROUTE socket in the host's network namespace, for an agent reading the
    host at ``root``; None where the host's events cannot be heard. On ``/`` the agent's own
    namespace is the host's (systemd; a container given the host's network). Under another root
    whose ``sys`` is the kernel's (``kernel``: the DaemonSet's ``/host``) the host's is its
    init's, which this process opens with CAP_SYS_PTRACE and enters with CAP_SYS_ADMIN (OSError
    without). A fixture tree has no kernel of its own. Blocking (procfs, setns): a worker thread."""
    if os.path.realpath(root) == "/":
        return _netlink(socket.NETLINK_ROUTE)
    init = init_netns(root)
    if not kernel or not os.path.lexists(init):
        return None
    return socket_in(init)


async def listen_on_host(listener_start: Callable[[socket.socket], None], root: str, kernel: bool, what: str) -> bool:
    """``listener_start(sock)`` with the host's events socket (made in a worker thread); False,
    logged, where there is none or it cannot be made."""
    try:
        sock = await asyncio.to_thread(host_events_socket, root, kernel)
    except OSError as err:
        log.warning("no kernel %s events (%s): %s", what, err.strerror or err, _WITHOUT[what])
        return False
    if sock is None:
        return False
    try:
        listener_start(sock)
    except OSError as err:
        sock.close()
        log.warning("no kernel %s events (%s): %s", what, err.strerror or err, _WITHOUT[what])
        return False
    return True


_WITHOUT = {"link": "NIC links are checked every health interval",
            "route": "a new default route's NIC is seen at the next resync",
            "address": "which NICs the host uses (their taint) is read again at the next scan"}
