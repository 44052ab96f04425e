"""RDMA devices and network namespaces: the kernel's RDMA netns mode and moving an RDMA device
into a pod's namespace over RDMA netlink (what ``rdma dev set <dev> netns <ns>`` sends).

In **shared** mode (ib_core's default) every RDMA device is visible in every network namespace:
a pod reaches it through its character devices alone (``/dev/infiniband/uverbsN``, already in the
claim's CDI spec), and nothing moves. In **exclusive** mode an RDMA device belongs to one network
namespace: it must move with its netdev, or the pod sees a netdev without its RDMA device. The mode
is ib_core's ``netns_mode`` parameter (``Y``/``1`` shared, ``N``/``0`` exclusive), read under the
root, so fixture trees decide it too; no ib_core (no file) means no RDMA devices at all.

The move is one RDMA_NLDEV_CMD_SET on a NETLINK_RDMA socket with the device's index
(RDMA_NLDEV_ATTR_DEV_INDEX, from a RDMA_NLDEV_CMD_GET dump) and the target namespace's file
descriptor (RDMA_NLDEV_NET_NS_FD). When a namespace dies the kernel gives its RDMA devices back
to the host's, as it does with physical netdevs.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
from typing import Literal

from agent.prepare.rtnl import LinkError, netlink_in_protocol
from discovery.sysfs import AttrError, HostFS

log = logging.getLogger(__name__)
NETLINK_RDMA = 20
RDMA_NL_NLDEV = 5
RDMA_NLDEV_CMD_GET, RDMA_NLDEV_CMD_SET = 1, 2
RDMA_NLDEV_ATTR_DEV_INDEX, RDMA_NLDEV_ATTR_DEV_NAME, RDMA_NLDEV_NET_NS_FD = 1, 2, 68
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_ACK, NLM_F_DUMP = 0x1, 0x4, 0x300
NETNS_MODE = "sys/module/ib_core/parameters/netns_mode"
_NLMSG = struct.Struct("=IHHII")
_NLA = struct.Struct("=HH")

Mode = Literal["shared", "exclusive"]


def netns_mode(root: str) -> Mode | None:
    """ib_core's RDMA netns mode under ``root``; None without ib_core."""
    fs = HostFS(root)
    try:
        value = fs.read_optional(fs.path(NETNS_MODE))
    except AttrError as err:  # unreadable: no decision to build on, as without ib_core
        log.warning("RDMA netns mode unknown: %s", err)
        return None
    if value is None:
        return None
    return "exclusive" if value.strip() in ("N", "n", "0") else "shared"


def nldev_type(op: int) -> int:
    """The netlink message type of an RDMA netlink NLDEV operation (RDMA_NL_GET_TYPE)."""
    return (RDMA_NL_NLDEV << 10) + op


def _attr(kind: int, value: bytes) -> bytes:
    length = _NLA.size + len(value)
    return _NLA.pack(length, kind) + value + b"\0" * ((4 - length % 4) % 4)


def set_netns_message(index: int, netns_fd: int, seq: int = 1) -> bytes:
    """RDMA_NLDEV_CMD_SET: device ``index`` into the namespace open as ``netns_fd``."""
    body = _attr(RDMA_NLDEV_ATTR_DEV_INDEX, struct.pack("=I", index)) + _attr(RDMA_NLDEV_NET_NS_FD, struct.pack("=I", netns_fd))
    return _NLMSG.pack(_NLMSG.size + len(body), nldev_type(RDMA_NLDEV_CMD_SET), NLM_F_REQUEST | NLM_F_ACK, seq, 0) + body


def get_dump_message(seq: int = 1) -> bytes:
    return _NLMSG.pack(_NLMSG.size, nldev_type(RDMA_NLDEV_CMD_GET), NLM_F_REQUEST | NLM_F_DUMP, seq, 0)


def parse_devices(data: bytes) -> tuple[dict[str, int], bool]:
    """One datagram of the GET dump's answer -> ({device name: index}, dump finished);
    LinkError for a kernel error."""
    out: dict[str, int] = {}
    off = 0
    while off + _NLMSG.size <= len(data):
        length, mtype, _, _, _ = _NLMSG.unpack_from(data, off)
        if length < _NLMSG.size or off + length > len(data):
            break
        if mtype == NLMSG_DONE:
            return out, True
        if mtype == NLMSG_ERROR:
            (code,) = struct.unpack_from("=i", data, off + _NLMSG.size)
            if code:
                raise LinkError(-code, f"RDMA netlink: {os.strerror(-code)}")
            return out, True
        index, name, pos = None, None, off + _NLMSG.size
        while pos + _NLA.size <= off + length:
            alen, kind = _NLA.unpack_from(data, pos)
            if alen < _NLA.size:
                break
            value = data[pos + _NLA.size:pos + alen]
            if kind == RDMA_NLDEV_ATTR_DEV_INDEX and len(value) == 4:
                (index,) = struct.unpack("=I", value)
            elif kind == RDMA_NLDEV_ATTR_DEV_NAME:
                name = value.split(b"\0", 1)[0].decode(errors="replace")
            pos += (alen + 3) & ~3
        if index is not None and name:
            out[name] = index
        off += (length + 3) & ~3
    return out, False


def _request(sock: socket.socket, message: bytes) -> None:
    sock.send(message)
    data = sock.recv(65536)
    if len(data) >= _NLMSG.size + 4 and _NLMSG.unpack_from(data)[1] == NLMSG_ERROR:
        (code,) = struct.unpack_from("=i", data, _NLMSG.size)
        if code:
            raise LinkError(-code, f"RDMA netlink: {os.strerror(-code)}")


def devices(sock: socket.socket) -> dict[str, int]:
    """The RDMA devices the socket's namespace sees, by name."""
    sock.send(get_dump_message())
    out: dict[str, int] = {}
    done = False
    while not done:
        found, done = parse_devices(sock.recv(65536))
        out.update(found)
    return out


def move(src_netns: str, name: str, dst_netns: str) -> None:
    """RDMA device ``name`` from ``src_netns`` (where it is now) into ``dst_netns``. Already in
    ``dst_netns`` is fine (a move finished twice); nowhere is ENODEV."""
    with netlink_in_protocol(dst_netns, NETLINK_RDMA) as sock:
        if name in devices(sock):
            return
    with netlink_in_protocol(src_netns, NETLINK_RDMA) as sock:
        index = devices(sock).get(name)
        if index is None:
            raise LinkError(errno.ENODEV, f"no RDMA device {name} in {src_netns}")
        fd = os.open(dst_netns, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _request(sock, set_netns_message(index, fd))
        finally:
            os.close(fd)
