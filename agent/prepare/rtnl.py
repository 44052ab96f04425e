"""Moving a netdev between network namespaces over rtnetlink, and configuring it there (MTU,
addresses, routes): blocking calls, run them in a worker thread (agent/prepare/netmove.py does).

One RTM_NEWLINK with IFLA_NET_NS_FD and IFLA_IFNAME moves a link (the kernel brings it down
first) and renames it: under the new name at once when its own is taken in the target
namespace, else moved under its own and renamed after, so a new name that is taken there leaves
it moved under its own (EEXIST): callers look first (prepare/netmove.py). A netlink socket belongs to the namespace it was created in:
:func:`netlink_in` creates one inside another namespace (``agent.rtnetlink.socket_in``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import ipaddress
import struct
from collections.abc import Iterator
from typing import NamedTuple

from agent import rtnetlink

RTM_NEWLINK, RTM_GETLINK, RTM_NEWADDR, RTM_NEWROUTE = 16, 18, 20, 24
NLMSG_ERROR = 2
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400
NLMSG_DONE, NLM_F_DUMP = 3, 0x300
IFLA_ADDRESS, IFLA_IFNAME, IFLA_MTU, IFLA_NET_NS_FD, IFLA_PARENT_DEV_NAME = 1, 3, 4, 28, 56
IFLA_LINK, IFLA_MASTER, IFLA_LINKINFO, IFLA_INFO_KIND = 5, 10, 18, 1
MAX_LINKS = 4096  # links read from one namespace's dump: a host with more is refused, not half-read
IFA_ADDRESS, IFA_LOCAL = 1, 2
IFA_F_NODAD = 0x02
RTA_DST, RTA_OIF, RTA_GATEWAY = 1, 4, 5
RT_TABLE_MAIN, RTPROT_STATIC, RTN_UNICAST = 254, 4, 1
RT_SCOPE_UNIVERSE, RT_SCOPE_LINK = 0, 253
IFF_UP = 0x1
_NLMSG = struct.Struct("=IHHII")
_IFINFO = struct.Struct("=BxHiII")  # family, type, index, flags, change
_RTA = struct.Struct("=HH")
_IFADDR = struct.Struct("=BBBBI")  # family, prefix length, flags, scope, index
_RTMSG = struct.Struct("=BBBBBBBBI")  # family, dst/src length, tos, table, protocol, scope, type, flags


class LinkError(OSError):
    """A kernel refusal (errno set) or a link that is not there."""


class Link(NamedTuple):
    """A link as the kernel reports it. ``parent``: the bus device it belongs to (a PCI
    function's address for a NIC's netdev, Linux >= 5.14), None for a virtual link. ``master``:
    the index of the bond, bridge, team or OVS datapath it is a port of; ``lower``: the link it
    sits on (a VLAN's or macvlan's; a veth's peer); ``kind``: a virtual link's type (``vlan``,
    ``bond``, ...), None for a NIC's netdev."""

    name: str
    index: int
    mac: str | None
    mtu: int | None
    parent: str | None
    master: int | None = None
    lower: int | None = None
    kind: str | None = None


def netlink_in(netns: str) -> contextlib.AbstractContextManager[socket.socket]:
    """A NETLINK_ROUTE socket in the network namespace at ``netns`` (a path)."""
    return netlink_in_protocol(netns, socket.NETLINK_ROUTE)


@contextlib.contextmanager
def netlink_in_protocol(netns: str, protocol: int) -> Iterator[socket.socket]:
    """A netlink socket of ``protocol`` in the network namespace at ``netns`` (a path)."""
    with rtnetlink.socket_in(netns, protocol) as sock:
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


def move(src_netns: str, name: str, dst_netns: str, new_name: str, index: int | None = None) -> None:
    """Move link ``name`` (the link of ``index``, when given: a name another link may take
    meanwhile) from ``src_netns`` to ``dst_netns`` as ``new_name``; LinkError (ENODEV when it
    is not in ``src_netns``, EEXIST when ``new_name`` is taken there)."""
    with netlink_in(src_netns) as sock:
        index = index if index is not None else link_index(sock, name)
        if index is None:
            raise LinkError(errno.ENODEV, f"no link {name} in {src_netns}")
        dst = os.open(dst_netns, os.O_RDONLY | os.O_CLOEXEC)
        try:
            body = (_IFINFO.pack(socket.AF_UNSPEC, 0, index, 0, 0) + _attr(IFLA_NET_NS_FD, struct.pack("=I", dst))
                    + _attr(IFLA_IFNAME, new_name.encode() + b"\0"))
            _request(sock, RTM_NEWLINK, NLM_F_ACK, body)
        finally:
            os.close(dst)


def rename(netns: str, name: str, new_name: str, index: int | None = None) -> None:
    """Rename a link (down: a netdev whose namespace died came back down); ``index`` as for ``move``."""
    with netlink_in(netns) as sock:
        index = index if index is not None else link_index(sock, name)
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


def _text(raw: bytes | None) -> str | None:
    return raw.split(b"\0", 1)[0].decode(errors="replace") or None if raw else None


def _parse_link(body: bytes | memoryview) -> Link | None:
    """An RTM_NEWLINK body -> Link; None when it is cut short or names no link."""
    if len(body) < _IFINFO.size:
        return None
    attrs: dict[int, bytes] = {}
    off = _IFINFO.size
    while off + _RTA.size <= len(body):
        length, kind = _RTA.unpack_from(body, off)
        if length < _RTA.size or off + length > len(body):
            break
        attrs[kind & 0x3FFF] = bytes(body[off + _RTA.size:off + length])  # without the nested/byte-order flags
        off += (length + 3) & ~3
    name = _text(attrs.get(IFLA_IFNAME))
    if name is None:
        return None
    return Link(name, _IFINFO.unpack_from(body)[2], ":".join(f"{b:02x}" for b in attrs.get(IFLA_ADDRESS, b"")) or None,
                _u32(attrs.get(IFLA_MTU)), _text(attrs.get(IFLA_PARENT_DEV_NAME)), _u32(attrs.get(IFLA_MASTER)) or None,
                _u32(attrs.get(IFLA_LINK)) or None, _kind(attrs.get(IFLA_LINKINFO)))


def _u32(raw: bytes | None) -> int | None:
    return struct.unpack("=I", raw)[0] if raw is not None and len(raw) == 4 else None


def _kind(linkinfo: bytes | None) -> str | None:
    """IFLA_INFO_KIND of a nested IFLA_LINKINFO: a virtual link's type."""
    off = 0
    while linkinfo and off + _RTA.size <= len(linkinfo):
        length, kind = _RTA.unpack_from(linkinfo, off)
        if length < _RTA.size or off + length > len(linkinfo):
            break
        if kind & 0x3FFF == IFLA_INFO_KIND:
            return _text(linkinfo[off + _RTA.size:off + length])
        off += (length + 3) & ~3
    return None


def link(netns: str, name: str) -> Link | None:
    """Link ``name`` in ``netns``; None when there is none."""
    with netlink_in(netns) as sock:
        try:
            answer = _request(sock, RTM_GETLINK, 0, _IFINFO.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
                              + _attr(IFLA_IFNAME, name.encode() + b"\0"))
        except LinkError as err:
            if err.errno == errno.ENODEV:
                return None
            raise
    return _parse_link(answer)


def links(netns: str) -> list[Link]:
    """Every link in ``netns`` (one dump); LinkError past MAX_LINKS."""
    out: list[Link] = []
    with netlink_in(netns) as sock:
        body = _IFINFO.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
        sock.send(_NLMSG.pack(_NLMSG.size + len(body), RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, 2, 0) + body)
        while True:
            data = sock.recv(65536)
            for mtype, msg in rtnetlink.messages(data):
                if mtype == NLMSG_DONE:
                    return out
                if mtype == NLMSG_ERROR:
                    (code,) = struct.unpack_from("=i", msg)
                    raise LinkError(-code, os.strerror(-code))
                if mtype == RTM_NEWLINK and (found := _parse_link(msg)) is not None:
                    out.append(found)
            if len(out) > MAX_LINKS:
                raise LinkError(errno.E2BIG, f"more than {MAX_LINKS} links in {netns}")
            if not data:
                raise LinkError(errno.EIO, "the link dump ended early")


def _index(sock: socket.socket, name: str, netns: str) -> int:
    index = link_index(sock, name)
    if index is None:
        raise LinkError(errno.ENODEV, f"no link {name} in {netns}")
    return index


def set_mtu(netns: str, name: str, mtu: int) -> None:
    with netlink_in(netns) as sock:
        index = _index(sock, name, netns)
        _request(sock, RTM_NEWLINK, NLM_F_ACK,
                 _IFINFO.pack(socket.AF_UNSPEC, 0, index, 0, 0) + _attr(IFLA_MTU, struct.pack("=I", mtu)))


def address_message(index: int, address: str) -> bytes:
    """RTM_NEWADDR's body for ``address`` (``ip/prefix``) on link ``index``. IPv6 without
    duplicate address detection: the pod's application binds it at once."""
    iface = ipaddress.ip_interface(address)
    family = socket.AF_INET if iface.version == 4 else socket.AF_INET6
    flags = IFA_F_NODAD if iface.version == 6 else 0
    body = _IFADDR.pack(family, iface.network.prefixlen, flags, RT_SCOPE_UNIVERSE, index)
    packed = iface.ip.packed
    return body + _attr(IFA_LOCAL, packed) + _attr(IFA_ADDRESS, packed) if iface.version == 4 else body + _attr(IFA_ADDRESS, packed)


def route_message(index: int, destination: str, gateway: str | None) -> bytes:
    """RTM_NEWROUTE's body: ``destination`` (a network, ``default`` for 0.0.0.0/0 or ::/0 of the
    gateway's family) out of link ``index``, through ``gateway`` or on the link."""
    if destination == "default":
        destination = "::/0" if gateway and ipaddress.ip_address(gateway).version == 6 else "0.0.0.0/0"
    net = ipaddress.ip_network(destination)
    family = socket.AF_INET if net.version == 4 else socket.AF_INET6
    scope = RT_SCOPE_UNIVERSE if gateway else RT_SCOPE_LINK
    body = _RTMSG.pack(family, net.prefixlen, 0, 0, RT_TABLE_MAIN, RTPROT_STATIC, scope, RTN_UNICAST, 0)
    if net.prefixlen:
        body += _attr(RTA_DST, net.network_address.packed)
    if gateway:
        body += _attr(RTA_GATEWAY, ipaddress.ip_address(gateway).packed)
    return body + _attr(RTA_OIF, struct.pack("=i", index))


def _create(sock: socket.socket, mtype: int, body: bytes) -> None:
    """Create an address or route; one already there is fine (a move finished twice)."""
    try:
        _request(sock, mtype, NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL, body)
    except LinkError as err:
        if err.errno != errno.EEXIST:
            raise


def add_address(netns: str, name: str, address: str) -> None:
    with netlink_in(netns) as sock:
        _create(sock, RTM_NEWADDR, address_message(_index(sock, name, netns), address))


def add_route(netns: str, name: str, destination: str, gateway: str | None) -> None:
    with netlink_in(netns) as sock:
        _create(sock, RTM_NEWROUTE, route_message(_index(sock, name, netns), destination, gateway))
