"""Moving a netdev between network namespaces over rtnetlink: blocking calls, run them in a
worker thread (agent/nri/netdev.py does).

One RTM_NEWLINK with IFLA_NET_NS_FD and IFLA_IFNAME moves a link and renames it in one
kernel operation (the kernel brings it down first), so a link is never seen in the target
namespace under its old name. A netlink socket belongs to the namespace it was created in:
:func:`netlink_in` creates one inside another namespace by switching the calling thread only
(setns affects one thread) and switching back.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import socket
import struct
from collections.abc import Iterator

RTM_NEWLINK, RTM_GETLINK = 16, 18
NLMSG_ERROR = 2
NLM_F_REQUEST, NLM_F_ACK = 0x1, 0x4
IFLA_ADDRESS, IFLA_IFNAME, IFLA_NET_NS_FD = 1, 3, 28
IFF_UP = 0x1
CLONE_NEWNET = 0x40000000
_NLMSG = struct.Struct("=IHHII")
_IFINFO = struct.Struct("=BxHiII")  # family, type, index, flags, change
_RTA = struct.Struct("=HH")

_libc = ctypes.CDLL(None, use_errno=True)


class LinkError(OSError):
    """A kernel refusal (errno set) or a link that is not there."""


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise LinkError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def netlink_in(netns: str) -> Iterator[socket.socket]:
    """A NETLINK_ROUTE socket in the network namespace at ``netns`` (a path)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        target = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(target)
            try:
                sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE)
            finally:
                _setns(own)  # never leave this worker thread in another namespace
        finally:
            os.close(target)
    finally:
        os.close(own)
    with sock:
        sock.settimeout(5.0)
        sock.bind((0, 0))
        yield sock


def _attr(kind: int, value: bytes) -> bytes:
    length = _RTA.size + len(value)
    return _RTA.pack(length, kind) + value + b"\0" * ((4 - length % 4) % 4)


def _request(sock: socket.socket, mtype: int, flags: int, body: bytes) -> bytes:
    msg = _NLMSG.pack(_NLMSG.size + len(body), mtype, NLM_F_REQUEST | flags, 1, 0) + body
    sock.send(msg)
    while True:
        data = sock.recv(65536)
        if len(data) < _NLMSG.size:
            raise LinkError(errno.EIO, "short netlink answer")
        length, rtype, _, seq, _ = _NLMSG.unpack_from(data)
        if seq != 1:
            continue
        if rtype == NLMSG_ERROR:
            (code,) = struct.unpack_from("=i", data, _NLMSG.size)
            if code:
                raise LinkError(-code, os.strerror(-code))
        return data[_NLMSG.size:length]


def link_index(sock: socket.socket, name: str) -> int | None:
    """The index of link ``name`` in the socket's namespace; None when there is none."""
    body = _IFINFO.pack(socket.AF_UNSPEC, 0, 0, 0, 0) + _attr(IFLA_IFNAME, name.encode() + b"\0")
    try:
        answer = _request(sock, RTM_GETLINK, 0, body)
    except LinkError as err:
        if err.errno == errno.ENODEV:
            return None
        raise
    return _IFINFO.unpack_from(answer)[2]


def move(src_netns: str, name: str, dst_netns: str, new_name: str) -> None:
    """Move link ``name`` from ``src_netns`` to ``dst_netns`` as ``new_name``; LinkError
    (ENODEV when ``name`` is not in ``src_netns``, EEXIST when ``new_name`` is taken there)."""
    with netlink_in(src_netns) as sock:
        index = link_index(sock, name)
        if index is None:
            raise LinkError(errno.ENODEV, f"no link {name} in {src_netns}")
        dst = os.open(dst_netns, os.O_RDONLY | os.O_CLOEXEC)
        try:
            body = (_IFINFO.pack(socket.AF_UNSPEC, 0, index, 0, 0) + _attr(IFLA_NET_NS_FD, struct.pack("=I", dst))
                    + _attr(IFLA_IFNAME, new_name.encode() + b"\0"))
            _request(sock, RTM_NEWLINK, NLM_F_ACK, body)
        finally:
            os.close(dst)


def rename(netns: str, name: str, new_name: str) -> None:
    """Rename a link (down: a netdev whose namespace died came back down)."""
    with netlink_in(netns) as sock:
        index = link_index(sock, name)
        if index is None:
            raise LinkError(errno.ENODEV, f"no link {name} in {netns}")
        _request(sock, RTM_NEWLINK, NLM_F_ACK,
                 _IFINFO.pack(socket.AF_UNSPEC, 0, index, 0, 0) + _attr(IFLA_IFNAME, new_name.encode() + b"\0"))


def set_up(netns: str, name: str) -> None:
    with netlink_in(netns) as sock:
        index = link_index(sock, name)
        if index is None:
            raise LinkError(errno.ENODEV, f"no link {name} in {netns}")
        _request(sock, RTM_NEWLINK, NLM_F_ACK, _IFINFO.pack(socket.AF_UNSPEC, 0, index, IFF_UP, IFF_UP))


def has_link(netns: str, name: str) -> bool:
    with netlink_in(netns) as sock:
        return link_index(sock, name) is not None


def hardware_address(netns: str, name: str) -> str | None:
    """Link ``name``'s MAC address (``aa:bb:...``) in ``netns``; None when it has none."""
    with netlink_in(netns) as sock:
        body = _IFINFO.pack(socket.AF_UNSPEC, 0, 0, 0, 0) + _attr(IFLA_IFNAME, name.encode() + b"\0")
        answer = _request(sock, RTM_GETLINK, 0, body)
    off = _IFINFO.size
    while off + _RTA.size <= len(answer):
        length, kind = _RTA.unpack_from(answer, off)
        if length < _RTA.size:
            break
        if kind == IFLA_ADDRESS:
            return ":".join(f"{b:02x}" for b in answer[off + _RTA.size:off + length]) or None
        off += (length + 3) & ~3
    return None
