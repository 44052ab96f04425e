"""status.devices without a server: the ``dir:`` store's claim file, the entry builder and the
address readers (the real-server side is tests/test_claim_status.py and test_claim_status_writes.py)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import threading

from agent.kubeletplugin import devicestatus
from agent.kubeletplugin.statuswriter import StatusWriter, status_writer
from agent.kubeletplugin.types import ClaimRef
from agent.prepare import claimstatus, netaddrs
from tests.kubelet_standin import claim, gpu, inventory, nic, registered_plugin, settings_for, store_claim

OTHER = {"driver": "other.example.com", "pool": "p", "device": "x", "data": {"theirs": True}}


def _with_plugin(s, inv, body):
    """Run ``body(kubelet, writer)`` against a real kubelet plugin serving ``inv`` offline."""
    from agent.kubeletplugin.claims import claim_source

    async def go():
        writer = status_writer(s)
        async with registered_plugin(s, inv, claim_source(s), writer) as kubelet:
            return await body(kubelet, writer)

    return asyncio.run(go())


def _claim_file(s, c) -> str:
    return os.path.join(s.cluster_dir, "resourceclaims", c["metadata"]["namespace"], c["metadata"]["name"] + ".json")


def _prepare_unprepare(s, inv, c):
    async def body(kubelet, writer):
        assert (await kubelet.prepare(c)).claims[c["metadata"]["uid"]].error == ""
        await writer.idle(10)
        prepared = json.load(open(_claim_file(s, c)))
        assert (await kubelet.unprepare(c)).claims[c["metadata"]["uid"]].error == ""
        await writer.idle(10)
        return prepared, json.load(open(_claim_file(s, c)))

    return _with_plugin(s, inv, body)


def test_offline_prepare_writes_the_claim_file_status_and_unprepare_removes_ours(tmp_path):
    s = settings_for(str(tmp_path))
    inv = inventory(gpu(0), nic(0, "ens9f0"))
    c = claim("c", [("gpu", "gpu-0000-1b-00-0"), ("nic", "nic-0000-40-00-0")])
    c["status"]["devices"] = [OTHER]
    store_claim(s, c)
    prepared, after = _prepare_unprepare(s, inv, c)
    devices = prepared["status"]["devices"]
    assert devices[0] == OTHER and [e["device"] for e in devices[1:]] == ["gpu-0000-1b-00-0", "nic-0000-40-00-0"]
    assert devices[2]["networkData"] == {"interfaceName": "ens9f0"}
    assert all(not devicestatus.problems(e) for e in devices[1:])
    assert after["status"]["devices"] == [OTHER] and after["status"]["allocation"] == c["status"]["allocation"]
    assert not [f for f in os.listdir(os.path.dirname(s.cluster_dir + "/resourceclaims/default/")) if f.startswith(".")]


def test_offline_writer_refuses_a_replaced_claim(tmp_path):
    s = settings_for(str(tmp_path))
    c = store_claim(s, claim("c", [("gpu", "gpu-0000-1b-00-0")]))
    writer = status_writer(s)

    async def go():
        writer.submit(ClaimRef("default", "c", "00000000-0000-4000-8000-000000000000"), [])
        writer.submit(ClaimRef("default", "c", "00000000-0000-4000-8000-000000000001"),
                      [{"driver": "sysdra.io", "pool": "node-a", "device": "gpu-0000-1b-00-0"}])
        await writer.idle(10)

    asyncio.run(go())
    assert writer.failed == 2 and "replaced" in writer.last_error
    assert "devices" not in json.load(open(os.path.join(s.cluster_dir, "resourceclaims", "default", "c.json")))["status"]
    assert c["metadata"]["uid"]


def test_a_write_the_server_would_refuse_is_never_sent(tmp_path):
    class Recorder:
        calls = []

        def write(self, ref, entries):
            self.calls.append(entries)

    class Results:
        seen = []

        def claim_status_written(self, ref, result, reason):
            self.seen.append((ref.name, result, reason))

    writer = StatusWriter(Recorder(), observer=Results())
    bad = {"driver": "sysdra.io", "pool": "p", "device": "d", "networkData": {"ips": ["192.0.2.5"]}}

    async def go():
        writer.submit(ClaimRef("default", "c", "u-1"), [bad])
        writer.submit(ClaimRef("default", "d", "u-2"), [])
        await writer.idle(5)

    asyncio.run(go())
    assert Recorder.calls == [[]]
    (invalid, written) = Results.seen
    assert invalid[:2] == ("c", "invalid") and "192.0.2.5" in invalid[2] and written == ("d", "written", None)
    assert writer.failed == 1


def test_entries_fit_the_limits_with_hundreds_of_device_nodes():
    from discovery.models import DeviceNode

    from agent.kubeletplugin.types import PreparedDevice

    nodes = tuple(DeviceNode(path=f"/dev/some/long/path/node{i:04d}", host_path=f"/dev/x{i}", major=1, minor=i, source="test")
                  for i in range(600))  # fmt: skip
    dev = gpu(0).replace(device_nodes=nodes)
    (entry,) = claimstatus.build("sysdra.io", "/nonexistent", [PreparedDevice(["gpu"], "node-a", dev.name, ["k=x"])],
                                 {dev.name: dev}, when="2026-01-01T00:00:00Z")
    assert entry["data"]["deviceNodes"] == 600 and not devicestatus.problems(entry)


def test_if_inet6_and_netlink_parsers():
    text = ("20010db8000000000000000000000005 05 40 00 80 ens9f0\n"
            "fe800000000000000e42a1fffe000001 05 40 20 80 ens9f0\n"
            "garbage\n00000000000000000000000000000001 01 80 10 80 lo\n"
            "20010db8000000000000000000000006 05 81 00 80 ens9f0\n")  # fmt: skip  (a prefix of 129: none)
    assert netaddrs.parse_if_inet6(text) == {"ens9f0": ["2001:db8::5/64"]}

    def msg(family, prefix, scope, index, addr):
        attr = struct.pack("=HH", 4 + len(addr), netaddrs.IFA_LOCAL if family == socket.AF_INET else netaddrs.IFA_ADDRESS) + addr
        body = struct.pack("=BBBBI", family, prefix, 0, scope, index) + attr
        return struct.pack("=IHHII", 16 + len(body), netaddrs.RTM_NEWADDR, 0, 1, 0) + body

    data = msg(socket.AF_INET, 24, 0, 2, bytes([192, 0, 2, 5])) + msg(socket.AF_INET6, 64, 253, 2, b"\xfe\x80" + b"\0" * 14)
    assert netaddrs.parse_addresses(data) == ([(2, "192.0.2.5/24")], False)
    done = struct.pack("=IHHII", 20, netaddrs.NLMSG_DONE, 0, 1, 0) + b"\0\0\0\0"
    assert netaddrs.parse_addresses(data + done)[1] is True
    assert netaddrs.parse_addresses(b"\xff" * 7) == ([], False)
    # a point-to-point IPv4 link: IFA_ADDRESS is the peer's, IFA_LOCAL the link's own
    attrs = (struct.pack("=HH", 8, netaddrs.IFA_ADDRESS) + bytes([192, 0, 2, 9])
             + struct.pack("=HH", 8, netaddrs.IFA_LOCAL) + bytes([192, 0, 2, 5]))
    body = struct.pack("=BBBBI", socket.AF_INET, 32, 0, 0, 3) + attrs
    p2p = struct.pack("=IHHII", 16 + len(body), netaddrs.RTM_NEWADDR, 0, 1, 0) + body
    assert netaddrs.parse_addresses(p2p) == ([(3, "192.0.2.5/32")], False)


def test_link_name_parser():
    """RTM_NEWLINK -> (ifindex, IFLA_IFNAME): the names of the dump's namespace, not this process's."""

    def link(index, *attrs):
        body = struct.pack("=BxHiII", socket.AF_UNSPEC, 1, index, 0, 0)
        for kind, value in attrs:
            body += struct.pack("=HH", 4 + len(value), kind) + value + b"\0" * (-len(value) % 4)
        return struct.pack("=IHHII", 16 + len(body), netaddrs.RTM_NEWLINK, 0, 2, 0) + body

    mtu = (4, struct.pack("=I", 1500))
    data = link(7, mtu, (netaddrs.IFLA_IFNAME, b"hostnic7\0")) + link(8, mtu) + link(9, (netaddrs.IFLA_IFNAME, b"\0"))
    assert netaddrs.parse_links(data) == ([(7, "hostnic7")], False)  # no name, or an empty one: left out
    done = struct.pack("=IHHII", 20, netaddrs.NLMSG_DONE, 0, 2, 0) + b"\0\0\0\0"
    assert netaddrs.parse_links(data + done + link(10, (netaddrs.IFLA_IFNAME, b"late\0"))) == ([(7, "hostnic7")], True)
    assert netaddrs.parse_links(link(7, (netaddrs.IFLA_IFNAME, b"x\0"))[:-4]) == ([], False)  # cut short
    assert netaddrs.parse_links(b"\xff" * 7) == ([], False)


def test_netlink_dump_on_this_host_lists_loopback_free_global_addresses():
    found = netaddrs._netlink_dump()  # raises if the kernel does not answer
    assert "lo" not in found  # 127.0.0.1 is host scope
    for addrs in found.values():
        assert all(devicestatus.canonical_interface_address(a) == a for a in addrs)


def test_the_hosts_addresses_are_read_in_its_network_namespace(tmp_path):
    """The DaemonSet's agent, in its pod's namespace, reads the host's (its root's init's) over
    rtnetlink: IPv4 and IPv6, under the host's interface name (a link of an index and a name this
    process's namespace has not). A fixture tree, or no right to enter the init's namespace:
    its if_inet6 file, IPv6 only (tests/netaddrs_scenario.py)."""
    import subprocess
    import sys

    from tests.conftest import REPO, require_root, require_tool

    require_root()
    unshare = require_tool("unshare")
    for tool in ("ip", "nsenter", "setpriv"):
        require_tool(tool)
    proc = subprocess.run([unshare, "-n", sys.executable, "-m", "tests.netaddrs_scenario", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    out = json.loads(lines[-1])
    assert proc.returncode == 0, out.get("failure")
    assert "hostnic7" not in out["own_links"]
    assert out["kernel"] == {"hostnic7": ["192.0.2.7/24", "2001:db8::7/64"]}
    assert out["files"] == out["no_sys_admin"] == {"hostnic7": ["2001:db8::7/64"]}


def test_a_deferred_metadata_update_brings_the_network_data_into_the_status(tmp_path):
    import subprocess
    import sys

    from tests.conftest import REPO

    s = settings_for(str(tmp_path))
    inv = inventory(gpu(0), nic(0, "ens9f0"))
    c = store_claim(s, claim("c", [("gpu", "gpu-0000-1b-00-0"), ("nic", "nic-0000-40-00-0")]))
    path = _claim_file(s, c)

    async def prepare(kubelet, writer):
        assert (await kubelet.prepare(c)).claims[c["metadata"]["uid"]].error == ""
        await writer.idle(10)

    _with_plugin(s, inv, prepare)
    cmd = [sys.executable, "-m", "agent", "metadata", "update", "--config", os.devnull, "--kubelet-dir", s.kubelet_dir,
           "--cluster", s.cluster, "--namespace", "default", "--claim", "c", "--uid", c["metadata"]["uid"],
           "--request", "nic", "--interface-name", "net1", "--ip", "192.0.2.7/24", "--ip", "2001:DB8::7/64"]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "status.devices updated (2 entries)" in out.stdout
    nic_entry = [e for e in json.load(open(path))["status"]["devices"] if e["device"] == "nic-0000-40-00-0"][0]
    assert nic_entry["networkData"] == {"interfaceName": "net1", "ips": ["192.0.2.7/24", "2001:db8::7/64"]}
    assert not devicestatus.problems(nic_entry)
    # the claim is gone from the node: the update says so and writes nothing
    gone = subprocess.run(cmd[:-4] + ["--uid", "00000000-0000-4000-8000-000000000009"] + cmd[-4:], cwd=REPO,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert gone.returncode == 1 and "not found in prepared claim" in gone.stderr


def _metadata_update(s, c, *net: str):
    import subprocess
    import sys

    from tests.conftest import REPO

    cmd = [sys.executable, "-m", "agent", "metadata", "update", "--config", os.devnull, "--kubelet-dir", s.kubelet_dir,
           "--cluster", s.cluster, "--namespace", c["metadata"]["namespace"], "--claim", c["metadata"]["name"],
           "--uid", c["metadata"]["uid"], "--request", "nic", *net]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)


class HeldBackend:
    """The writer's real backend, whose writes wait until the test opens ``gate``."""

    def __init__(self, real):
        self.real, self.gate = real, threading.Event()

    def write(self, *args, **kw):
        assert self.gate.wait(30), "the test never opened the gate"
        return self.real.write(*args, **kw)


def test_a_queued_write_keeps_the_network_data_a_metadata_update_wrote_meanwhile(tmp_path):
    """The prepare's write is still queued when the runtime hook's `sysdra metadata update` writes
    the claim's IPs: the queued write must not put the entries of before the update back."""
    s = settings_for(str(tmp_path))
    inv = inventory(gpu(0), nic(0, "ens9f0"))
    c = claim("c", [("gpu", "gpu-0000-1b-00-0"), ("nic", "nic-0000-40-00-0")])
    c["status"]["devices"] = [OTHER]
    store_claim(s, c)
    path = _claim_file(s, c)
    net = {"interfaceName": "net1", "ips": ["192.0.2.7/24"]}

    async def body(kubelet, writer):
        writer.backend = held = HeldBackend(writer.backend)
        assert (await kubelet.prepare(c)).claims[c["metadata"]["uid"]].error == ""
        out = await asyncio.to_thread(_metadata_update, s, c, "--interface-name", "net1", "--ip", "192.0.2.7/24")
        assert out.returncode == 0 and "status.devices updated (2 entries)" in out.stdout, out.stderr
        updated = json.load(open(path))["status"]["devices"]
        held.gate.set()  # now the prepare's write, queued before the update
        await writer.idle(10)
        return updated, writer

    updated, writer = _with_plugin(s, inv, body)
    assert [e["networkData"] for e in updated if e.get("device") == "nic-0000-40-00-0"] == [net]
    devices = json.load(open(path))["status"]["devices"]
    assert devices[0] == OTHER and [e["device"] for e in devices[1:]] == ["gpu-0000-1b-00-0", "nic-0000-40-00-0"]
    assert devices[2]["networkData"] == net, devices[2]
    assert writer.failed == 0, writer.last_error
