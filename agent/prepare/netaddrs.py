"""A NIC's IP addresses for ``status.devices[].networkData.ips``, in the server's canonical
``ip/prefix`` form, global scope only (link-local addresses mean nothing to other pods).

They come from the kernel of the host's network namespace over rtnetlink: an RTM_GETADDR dump
(IPv4 and IPv6, what ``ip -o addr`` shows), each address's interface index named by an
RTM_GETLINK dump on the same socket (``socket.if_indextoname`` answers in this process's own
namespace, which for the DaemonSet's agent is its pod's, where the index is another link or
none). On ``/`` the host's namespace is this process's own (systemd; a container with the host's
network); under another root whose ``sys`` is the kernel's sysfs (the DaemonSet's ``/host``) it
is the root's init's, ``proc/1/ns/net``, where the socket is made
(``agent.rtnetlink.host_events_socket``: CAP_SYS_PTRACE to open it, CAP_SYS_ADMIN to enter it).
Without those rights, and under a fixture tree (files, no kernel of its own), they come from
the init's ``<root>/proc/1/net/if_inet6``: IPv6 only, procfs has no per-interface IPv4 list.

Best effort: a failure gives no addresses, never an error (a NIC given to a pod usually gets its
addresses later, from CNI, through ``sysdra metadata update``). Blocking (netlink, setns):
called in worker threads (the kubelet plugin's prepare).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import struct
from typing import Callable

from agent import rtnetlink
from discovery.sysfs import AttrError, HostFS, is_sysfs

log = logging.getLogger(__name__)

RTM_NEWLINK, RTM_GETLINK = 16, 18
RTM_GETADDR, RTM_NEWADDR = 22, 20
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
IFA_ADDRESS, IFA_LOCAL = 1, 2
IFLA_IFNAME = 3
RT_SCOPE_UNIVERSE = 0
_NLMSG = struct.Struct("=IHHII")
_IFADDR = struct.Struct("=BBBBI")  # ifaddrmsg: family, prefixlen, flags, scope, index
_IFINFO = struct.Struct("=BxHiII")  # ifinfomsg: family, type, index, flags, change
_RTA = struct.Struct("=HH")
MAX_DUMP_BYTES = 4 << 20  # per dump: a host with thousands of addresses or links still fits

Parsed = tuple[list[tuple[int, str]], bool]  # ([(ifindex, text)], dump finished)
Each = Callable[[tuple, dict[int, bytes]], tuple[int, str] | None]  # header fields, attributes -> found


def _attrs(body: memoryview, start: int) -> dict[int, bytes]:
    """The rtattrs of one message body from ``start``; a malformed one ends the walk."""
    attrs: dict[int, bytes] = {}
    a = start
    while a + _RTA.size <= len(body):
        alen, atype = _RTA.unpack_from(body, a)
        if alen < _RTA.size or a + alen > len(body):
            break
        attrs[atype] = bytes(body[a + _RTA.size:a + alen])
        a += rtnetlink.align(alen)
    return attrs


def _walk(data: bytes, mtype: int, header: struct.Struct, each: Each) -> Parsed:
    """``each(header fields, attributes)`` of the ``mtype`` messages of one dump datagram."""
    out: list[tuple[int, str]] = []
    for kind, body in rtnetlink.messages(data):
        if kind in (NLMSG_DONE, NLMSG_ERROR):
            return out, True
        if kind == mtype and len(body) >= header.size:
            if (found := each(header.unpack_from(body), _attrs(body, header.size))) is not None:
                out.append(found)
    return out, False


def _address(fields: tuple, attrs: dict[int, bytes]) -> tuple[int, str] | None:
    family, prefix, _, scope, index = fields
    raw = attrs.get(IFA_LOCAL) or attrs.get(IFA_ADDRESS)  # IFA_LOCAL: IPv4's own address
    if scope != RT_SCOPE_UNIVERSE or not raw or family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        return index, f"{ipaddress.ip_address(raw)}/{prefix}"
    except ValueError:
        return None


def _link(fields: tuple, attrs: dict[int, bytes]) -> tuple[int, str] | None:
    name = attrs.get(IFLA_IFNAME, b"").split(b"\0", 1)[0]
    return (fields[2], name.decode(errors="replace")) if name else None


def parse_addresses(data: bytes) -> Parsed:
    """RTM_NEWADDR messages of one datagram -> ([(ifindex, "ip/prefix")], dump finished)."""
    return _walk(data, RTM_NEWADDR, _IFADDR, _address)


def parse_links(data: bytes) -> Parsed:
    """RTM_NEWLINK messages of one datagram -> ([(ifindex, name)], dump finished): the names
    of the socket's namespace, which this process's ``if_indextoname`` may not see."""
    return _walk(data, RTM_NEWLINK, _IFINFO, _link)


def _dump(sock: socket.socket, mtype: int, seq: int, body: bytes, parse: Callable[[bytes], Parsed]) -> list[tuple[int, str]]:
    """One dump request's answer, parsed, up to MAX_DUMP_BYTES (a truncated dump gives what
    it read: best effort)."""
    sock.send(_NLMSG.pack(_NLMSG.size + len(body), mtype, NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body)
    found: list[tuple[int, str]] = []
    total, done = 0, False
    while not done and total < MAX_DUMP_BYTES:
        data = sock.recv(65536)
        if not data:
            break
        total += len(data)
        got, done = parse(data)
        found += got
    return found


def netlink_addresses(sock: socket.socket) -> dict[str, list[str]]:
    """The addresses of the namespace ``sock`` (an unbound NETLINK_ROUTE socket, closed here)
    belongs to, under the names of that namespace; an address whose link is gone is left out."""
    with sock:
        sock.settimeout(2.0)
        found = _dump(sock, RTM_GETADDR, 1, _IFADDR.pack(socket.AF_UNSPEC, 0, 0, 0, 0), parse_addresses)
        if not found:
            return {}
        names = dict(_dump(sock, RTM_GETLINK, 2, _IFINFO.pack(socket.AF_UNSPEC, 0, 0, 0, 0), parse_links))
    by_name: dict[str, list[str]] = {}
    for index, addr in found:
        if index in names:
            by_name.setdefault(names[index], []).append(addr)
    return by_name


def _netlink_dump() -> dict[str, list[str]]:
    """This process's own namespace's addresses (the host's on ``/``)."""
    return netlink_addresses(socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE))


def parse_if_inet6(text: str) -> dict[str, list[str]]:
    """``/proc/net/if_inet6`` lines: address (32 hex), ifindex, prefix (hex), scope (hex), flags, name."""
    by_name: dict[str, list[str]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 6 or len(parts[0]) != 32:
            continue
        try:
            addr = ipaddress.IPv6Address(bytes.fromhex(parts[0]))
            prefix, scope = int(parts[2], 16), int(parts[3], 16)
        except ValueError:
            continue
        if scope == RT_SCOPE_UNIVERSE and 0 <= prefix <= 128:
            by_name.setdefault(parts[5], []).append(f"{addr}/{prefix}")
    return by_name


def _host_socket(root: str) -> socket.socket | None:
    """A NETLINK_ROUTE socket in the host's namespace, or None where there is none to be had
    (a fixture tree; no right to enter the init's: logged, the if_inet6 file will do)."""
    try:
        return rtnetlink.host_events_socket(root, is_sysfs(os.path.join(root, "sys")))
    except OSError as err:
        log.debug("host's network namespace not entered (%s): IPv6 addresses only, from if_inet6", err)
        return None


def addresses(root: str) -> dict[str, list[str]]:
    """``{interface name: ["ip/prefix", ...]}`` of the host's network namespace."""
    try:
        if (sock := _host_socket(root)) is not None:
            return netlink_addresses(sock)
        fs = HostFS(root)  # the root's reader: a FIFO or device there is refused, a huge file not read
        return parse_if_inet6(fs.read_bytes(fs.path("proc/1/net/if_inet6"), limit=1 << 20).decode("ascii", "replace"))
    except (OSError, AttrError) as err:
        log.debug("interface addresses not read: %s", err)
    except Exception:  # a bug must not fail the prepare: the addresses are a nicety
        log.warning("interface addresses not read", exc_info=True)
    return {}
