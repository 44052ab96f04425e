"""A NIC's IP addresses for ``status.devices[].networkData.ips``, in the server's canonical
``ip/prefix`` form, global scope only (link-local addresses mean nothing to other pods).

On the real host (``root == "/"``) they come from the kernel over rtnetlink (an RTM_GETADDR
dump, what ``ip -o addr`` shows); under another root (a fixture tree, or ``/host`` in a
container whose own network namespace is not the host's) from the host init's
``<root>/proc/1/net/if_inet6`` (IPv6 only: procfs has no per-interface IPv4 list). Both are
best effort: a failure gives no addresses, never an error (a NIC given to a pod usually gets
its addresses later, from CNI, through ``sysdra metadata update``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import struct

log = logging.getLogger(__name__)

RTM_GETADDR, RTM_NEWADDR = 22, 20
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
IFA_ADDRESS, IFA_LOCAL = 1, 2
RT_SCOPE_UNIVERSE = 0
_NLMSG = struct.Struct("=IHHII")
_IFADDR = struct.Struct("=BBBBI")  # ifaddrmsg: family, prefixlen, flags, scope, index
_RTA = struct.Struct("=HH")
MAX_DUMP_BYTES = 4 << 20  # a host with thousands of addresses still fits


def _align(n: int) -> int:
    return (n + 3) & ~3


def parse_addresses(data: bytes) -> tuple[list[tuple[int, str]], bool]:
    """RTM_NEWADDR messages of one datagram -> ([(ifindex, "ip/prefix")], dump finished)."""
    out: list[tuple[int, str]] = []
    off = 0
    while off + _NLMSG.size <= len(data):
        length, mtype, _, _, _ = _NLMSG.unpack_from(data, off)
        if length < _NLMSG.size or off + length > len(data):
            break
        if mtype in (NLMSG_DONE, NLMSG_ERROR):
            return out, True
        body = off + _NLMSG.size
        if mtype == RTM_NEWADDR and body + _IFADDR.size <= off + length:
            family, prefix, _, scope, index = _IFADDR.unpack_from(data, body)
            attrs: dict[int, bytes] = {}
            a = body + _IFADDR.size
            while a + _RTA.size <= off + length:
                alen, atype = _RTA.unpack_from(data, a)
                if alen < _RTA.size or a + alen > off + length:
                    break
                attrs[atype] = data[a + _RTA.size:a + alen]
                a += _align(alen)
            raw = attrs.get(IFA_LOCAL) or attrs.get(IFA_ADDRESS)  # IFA_LOCAL: IPv4's own address
            if scope == RT_SCOPE_UNIVERSE and raw and family in (socket.AF_INET, socket.AF_INET6):
                try:
                    out.append((index, f"{ipaddress.ip_address(raw)}/{prefix}"))
                except ValueError:
                    pass
        off += _align(length)
    return out, False


def _netlink_dump() -> dict[str, list[str]]:
    by_name: dict[str, list[str]] = {}
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE) as sock:
        sock.settimeout(2.0)
        msg = _IFADDR.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
        sock.send(_NLMSG.pack(_NLMSG.size + len(msg), RTM_GETADDR, NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + msg)
        total, done = 0, False
        while not done and total < MAX_DUMP_BYTES:
            data = sock.recv(65536)
            total += len(data)
            if not data:
                break
            found, done = parse_addresses(data)
            for index, addr in found:
                try:
                    name = socket.if_indextoname(index)
                except OSError:
                    continue
                by_name.setdefault(name, []).append(addr)
    return by_name


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


def addresses(root: str) -> dict[str, list[str]]:
    """``{interface name: ["ip/prefix", ...]}`` of the host's network namespace."""
    try:
        if root == "/":
            return _netlink_dump()
        with open(os.path.join(root, "proc", "1", "net", "if_inet6"), encoding="ascii", errors="replace") as f:
            return parse_if_inet6(f.read(1 << 20))
    except OSError as err:
        log.debug("interface addresses not read: %s", err)
        return {}
