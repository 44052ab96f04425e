"""The host's uplink is never published (discovery/routes.py): the NICs of the lowest-metric
default routes (IPv4, IPv6, ECMP and multipath), the chain below them (bond slaves, bridge ports,
a VLAN's parent) and the VFs of an uplink PF; ``publish_uplink`` publishes them anyway. Default
route changes are followed live over rtnetlink (agent/service/routewatch.py)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time

import pytest

from agent.service.routewatch import RTM_DELROUTE, RTM_NEWROUTE, default_route_changed
from discovery.inventory import IncrementalScanner, bdf_of_path, scan
from discovery.routes import uplink
from discovery.sysfs import HostFS
from tests.conftest import REPO, _missing, profile_root

PF0, PF1, ENO1 = "0000:06:00.0", "0000:06:00.1", "0000:3f:00.0"
PF0_VFS = {f"0000:06:00.{i}" for i in range(2, 8)} | {"0000:06:01.0", "0000:06:01.1"}
V4_HEADER = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT"


def node(tmp_path, v4: list[tuple[str, int]] = (), v6: list[tuple[str, int]] = ()) -> str:
    """sriov-nic with default routes: (interface, metric) per family, plus one non-default route."""
    root = str(tmp_path / "node")
    shutil.copytree(profile_root("sriov-nic"), root, symlinks=True)
    os.makedirs(os.path.join(root, "proc/net"))
    lines = [V4_HEADER] + [f"{i}\t00000000\t0100A8C0\t0003\t0\t0\t{m}\t00000000\t0\t0\t0" for i, m in v4]
    lines.append("eno1\t0000A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0")  # 192.168.0.0/24: not default
    with open(os.path.join(root, "proc/net/route"), "w") as f:
        f.write("\n".join(lines) + "\n")
    six = [f"{'0' * 32} 00 {'0' * 32} 00 fe800000000000000000000000000001 {m:08x} 00000001 00000000 00000003 {i}"
           for i, m in v6]
    six.append(f"{'fd00' + '0' * 28} 40 {'0' * 32} 00 {'0' * 32} 00000100 00000001 00000000 00000001 enp6s0f1")
    with open(os.path.join(root, "proc/net/ipv6_route"), "w") as f:
        f.write("\n".join(six) + "\n")
    return root


def skipped(inv) -> dict[str, str]:
    return {s.bdf: s.reason for s in inv.skipped}


def names(inv) -> set[str]:
    return {d.pci.bdf for d in inv.devices}


def test_the_default_routes_nic_and_its_vfs_are_not_published(tmp_path):
    root = node(tmp_path, v4=[("enp6s0f0", 100)])
    inv = scan(root)
    assert PF0 not in names(inv) and not PF0_VFS & names(inv)
    assert skipped(inv)[PF0] == "the host's uplink: default route via enp6s0f0"
    assert skipped(inv)["0000:06:00.2"] == f"the host's uplink: a VF of {PF0}, default route via enp6s0f0"
    assert {PF1, ENO1} <= names(inv)
    everything = scan(root, publish_uplink=True)
    assert {PF0, *PF0_VFS} - {"0000:06:01.1"} <= names(everything)  # 06:01.1 is unbound: never offered


def test_a_default_route_via_a_name_that_is_not_utf8_still_keeps_its_nic(tmp_path):
    """The kernel allows any bytes in a name: the route table is read with them as they are,
    never refused whole (which would publish the uplink), and the reason shows them escaped."""
    root = node(tmp_path)
    raw = b"en\xff0"
    os.rename(os.path.join(root, "sys/class/net/enp6s0f0"), os.path.join(os.fsencode(root), b"sys/class/net/" + raw))
    with open(os.path.join(root, "proc/net/route"), "ab") as f:
        f.write(raw + b"\t00000000\t0100A8C0\t0003\t0\t0\t100\t00000000\t0\t0\t0\n")
    up = uplink(root)
    assert up.interfaces == ("en\\xff0",) and up.functions[PF0] == "default route via en\\xff0"
    assert PF0 not in names(scan(root))


def test_the_inits_routes_are_the_hosts(tmp_path):
    """proc/net is the reader's own network namespace (a pod's, for the DaemonSet's agent);
    the host's routes are its init's, proc/1/net, where the tree has one."""
    root = node(tmp_path, v4=[("eth0", 0)])  # the reader's: a pod's eth0, no NIC of this host
    os.makedirs(os.path.join(root, "proc/1/net"))
    with open(os.path.join(root, "proc/1/net/route"), "w") as f:
        f.write(f"{V4_HEADER}\nenp6s0f0\t00000000\t0100A8C0\t0003\t0\t0\t100\t00000000\t0\t0\t0\n")
    inv = scan(root)
    assert PF0 not in names(inv) and skipped(inv)[PF0] == "the host's uplink: default route via enp6s0f0"


def _this_hosts_uplink() -> tuple[str, str]:
    """(interface, PCI function) of this machine's lowest-metric IPv4 default route."""
    with open("/proc/1/net/route") as f:
        routes = [line.split() for line in f.read().splitlines()[1:]]
    default = sorted((int(r[6]), r[0]) for r in routes if len(r) > 7 and r[1] == "00000000" and r[7] == "00000000")
    device = f"/sys/class/net/{default[0][1]}/device" if default else ""
    if not os.path.exists(device):
        _missing(f"this machine's default route is on no PCI function ({default})")
    return default[0][1], bdf_of_path(os.path.realpath(device).removeprefix("/sys"))  # a virtio NIC's is its parent's


@pytest.mark.root
def test_an_agent_in_another_network_namespace_keeps_the_hosts_uplink(tmp_path):
    """This machine's own uplink, scanned (``sysdra scan -o json`` on /) from a network namespace
    with no routes, as the DaemonSet's agent is in its pod's: still not offered."""
    iface, bdf = _this_hosts_uplink()
    if shutil.which("unshare") is None:
        pytest.fail("util-linux (unshare) is required")
    out = subprocess.run(["unshare", "-n", sys.executable, "-m", "agent", "scan", "-o", "json"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    inv = json.loads(out.stdout)
    assert {s["bdf"]: s["reason"] for s in inv["skipped"]}.get(bdf) == f"the host's uplink: default route via {iface}", inv


def test_only_the_lowest_metric_counts_and_ties_are_all_uplinks(tmp_path):
    inv = scan(node(tmp_path / "a", v4=[("eno1", 100), ("enp6s0f1", 600)]))
    assert ENO1 not in names(inv) and PF1 in names(inv)
    inv = scan(node(tmp_path / "b", v4=[("eno1", 100), ("enp6s0f1", 100)]))  # ECMP
    assert not {ENO1, PF1} & names(inv)


def test_ipv6_default_routes_and_multipath_next_hops(tmp_path):
    root = node(tmp_path, v6=[("eno1", 1024), ("enp6s0f1", 1024), ("enp6s0f0", 2048)])
    assert uplink(root).interfaces == ("eno1", "enp6s0f1")
    assert not {ENO1, PF1} & names(scan(root)) and PF0 in names(scan(root))


@pytest.mark.root
def test_an_ipv6_default_route_past_the_first_page_of_a_real_ipv6_route(tmp_path):
    """procfs hands out about a page per read(): the kernel lists ::/0 after the other routes
    (150 bytes each), so with enough of them it is past the first read. A network namespace of
    the test's own, the host's to the scan (its init: the root's proc/1)."""
    if shutil.which("ip") is None or shutil.which("unshare") is None or shutil.which("nsenter") is None:
        pytest.fail("iproute2 and util-linux (unshare, nsenter) are required")
    host = subprocess.Popen(["unshare", "-n", "sleep", "infinity"])
    try:
        while os.readlink(f"/proc/{host.pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            time.sleep(0.01)
        script = ["ip link add up0 type veth peer name up1", "ip link set up0 up", "ip link set up1 up",
                  "ip -6 addr add 2001:db8::1/64 dev up0 nodad"]  # fmt: skip
        script += [f"ip -6 route add 2001:db8:{i:x}::/48 dev up0" for i in range(1, 41)]
        script.append("ip -6 route add default via 2001:db8::fe dev up0 metric 100")
        subprocess.run(["nsenter", "-t", str(host.pid), "-n", "sh", "-ec", "\n".join(script)], check=True, timeout=60)
        table = f"/proc/{host.pid}/net/ipv6_route"
        with open(table) as f:
            whole = f.read()
        assert whole.index(f"{'0' * 32} 00 {'0' * 32} 00 20010db8") > 4096  # else no short read to miss it
        assert HostFS("/").read_text(table, limit=1 << 20) == whole
        os.makedirs(tmp_path / "host/proc")
        os.symlink(f"/proc/{host.pid}", tmp_path / "host/proc/1")
        assert uplink(str(tmp_path / "host")).interfaces == ("up0",)
    finally:
        host.kill()
        host.wait()


def _upper(root: str, name: str, lowers: list[str], bridge: bool = False) -> None:
    """A virtual netdev (bond, bridge) in the tree, on top of ``lowers``."""
    d = os.path.join(root, "sys/devices/virtual/net", name)
    os.makedirs(d)
    os.symlink(f"../../devices/virtual/net/{name}", os.path.join(root, "sys/class/net", name))
    for lower in lowers:
        if bridge:
            os.makedirs(os.path.join(d, "brif"), exist_ok=True)
            os.symlink(f"../../../../class/net/{lower}/brport", os.path.join(d, "brif", lower))
        else:
            os.symlink(f"../../../../class/net/{lower}", os.path.join(d, f"lower_{lower}"))


def test_the_chain_below_a_bond_and_a_bridge(tmp_path):
    root = node(tmp_path, v4=[("br0", 0)])
    _upper(root, "bond0", ["eno1", "enp6s0f1"])
    _upper(root, "br0", ["bond0"], bridge=True)
    up = uplink(root)
    assert up.functions[ENO1] == "default route via br0 (eno1)" and up.functions[PF1] == "default route via br0 (enp6s0f1)"
    assert not {ENO1, PF1} & names(scan(root)) and PF0 in names(scan(root))


def test_a_chain_that_loops_ends(tmp_path):
    """sysfs is input: lower links in a cycle (which the kernel never makes) end the walk."""
    root = node(tmp_path, v4=[("bond0", 0)])
    _upper(root, "bond0", ["bond1", "eno1"])
    _upper(root, "bond1", ["bond0"])
    assert set(uplink(root).functions) == {ENO1}


def test_incremental_scans_keep_a_new_vf_of_the_uplink_out(tmp_path):
    root = node(tmp_path, v4=[("enp6s0f0", 0)])
    sc = IncrementalScanner(root)
    sc.full()
    inv = sc.update({"0000:06:00.3"})
    assert "0000:06:00.3" in skipped(inv) and PF0 in skipped(inv)


def test_a_vfio_claim_of_the_uplink_is_refused_with_the_reason(tmp_path):
    from agent.prepare.vfio import host_own
    from agent.prepare.vfio_kernel import PciKernel

    root = node(tmp_path, v4=[("enp6s0f0", 0)])
    assert host_own(root, PciKernel(root), "0000:06:00.4") == f"it is the host's uplink (a VF of {PF0}, default route via enp6s0f0)"


def _route_msg(mtype: int, dst_len: int) -> bytes:
    body = struct.pack("=BBBBBBBBI", 2, dst_len, 0, 0, 254, 3, 0, 1, 0)
    return struct.pack("=IHHII", 16 + len(body), mtype, 0, 0, 0) + body


def test_route_messages_of_default_routes_only():
    assert default_route_changed(_route_msg(RTM_NEWROUTE, 0)) and default_route_changed(_route_msg(RTM_DELROUTE, 0))
    assert not default_route_changed(_route_msg(RTM_NEWROUTE, 24))
    assert default_route_changed(_route_msg(RTM_NEWROUTE, 24) + _route_msg(RTM_DELROUTE, 0))
    assert not default_route_changed(b"\xff" * 7) and not default_route_changed(_route_msg(RTM_NEWROUTE, 0)[:20])


WATCH = r"""
import asyncio, os, subprocess, sys, types
sys.path.insert(0, sys.argv[1])
from agent.service.routewatch import follow_default_routes

async def main(mode, tmp):
    root, ip = "/", lambda *a: subprocess.run(["ip", *a], check=True)
    if mode == "host":  # the DaemonSet's agent: the host is the init of its root's procfs, another namespace
        host = subprocess.Popen(["unshare", "-n", "sleep", "infinity"])
        while os.readlink(f"/proc/{host.pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            await asyncio.sleep(0.01)
        root = os.path.join(tmp, "host")
        os.makedirs(os.path.join(root, "proc"))
        os.symlink(f"/proc/{host.pid}", os.path.join(root, "proc", "1"))
        ip = lambda *a: subprocess.run(["nsenter", "-t", str(host.pid), "-n", "ip", *a], check=True)
    seen = asyncio.Event()
    watch = await follow_default_routes(types.SimpleNamespace(root=root, publish_uplink=False), True, seen.set)
    try:
        ip("link", "add", "up0", "type", "veth", "peer", "name", "up1"); ip("link", "set", "up0", "up")
        ip("addr", "add", "192.0.2.1/24", "dev", "up0")
        await asyncio.sleep(0.2)
        print("before default route:", seen.is_set())
        ip("route", "add", "default", "via", "192.0.2.254", "dev", "up0")
        await asyncio.wait_for(seen.wait(), 10)
        print("after default route:", seen.is_set())
    finally:
        watch.stop()
        if mode == "host":
            host.kill()

asyncio.run(main(sys.argv[2], sys.argv[3]))
"""


@pytest.mark.root
@pytest.mark.parametrize("mode", ["own", "host"])
def test_a_default_route_change_is_seen_over_rtnetlink(tmp_path, mode):
    """In a network namespace of the test's own: a veth interface and a default route over it,
    made in the agent's own namespace (``/``: systemd) or in the host's, another one, reached
    through the init of the root's procfs (the DaemonSet's agent, in its pod's namespace)."""
    if shutil.which("ip") is None or shutil.which("unshare") is None or shutil.which("nsenter") is None:
        pytest.fail("iproute2 and util-linux (unshare, nsenter) are required")
    out = subprocess.run(["unshare", "-n", sys.executable, "-c", WATCH, REPO, mode, str(tmp_path)], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["before default route: False", "after default route: True"]


def test_half_default_routes_and_the_kernels_unreachable_one_on_lo_are_no_uplink(tmp_path):
    """0.0.0.0/1 (a VPN's split default, metric 0) is no default route, nor is the unreachable
    IPv6 default the kernel keeps on lo."""
    root = node(tmp_path, v4=[("eno1", 100)])
    with open(os.path.join(root, "proc/net/route"), "a") as f:
        f.write("enp6s0f1\t00000000\t0100A8C0\t0003\t0\t0\t0\t00000080\t0\t0\t0\n")
    with open(os.path.join(root, "proc/net/ipv6_route"), "a") as f:
        f.write(f"{'0' * 32} 00 {'0' * 32} 00 {'0' * 32} ffffffff 00000001 00000000 00200200       lo\n")
    assert uplink(root).interfaces == ("eno1",) and PF1 in names(scan(root))


def test_a_default_route_whose_metric_is_no_number_is_no_route_not_a_failed_scan(tmp_path):
    """``str.isdigit`` is true of "²", ``int`` refuses it: the route is not counted, the scan goes on."""
    root = node(tmp_path, v4=[("enp6s0f0", "\u00b2"), ("enp6s0f1", 100)])
    inv = scan(root)
    assert skipped(inv)[PF1] == "the host's uplink: default route via enp6s0f1"
    assert PF0 in names(inv)
