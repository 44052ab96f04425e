"""A NIC that becomes part of the host's uplink after the agent started (enslaved to the uplink
bond, added as a port of the default route's bridge) leaves the slices at once: the route watch
(agent/service/routewatch.py) hears the link change, reads the uplink again and asks for a full
rescan. It heard default routes only, and incremental scans keep the uplink of the last full scan,
so such a NIC stayed offered until the full resync (5 minutes): a pod given it takes the node's
network down. A NIC joining a bridge that is not the uplink (a pod's veth) costs no rescan.

On the real kernel: a network namespace of the test is the host (the fixture root's ``proc/1`` is
a process in it, as the DaemonSet's ``/host/proc/1`` is the host's init), with a bridge carrying the
default route. This machine has no PCI NIC to spare, so the fixture's sysfs stands for the PCI NIC
the kernel would show as the bridge's new port (``brif/``), beside the kernel's link change."""

from __future__ import annotations

import asyncio
import os
import subprocess
from types import SimpleNamespace

import pytest

from agent.service.routewatch import follow_default_routes
from discovery.inventory import IncrementalScanner
from tests.conftest import copy_profile, require_root, require_tool
from tests.test_uplink import PF0, PF1, _upper

pytestmark = pytest.mark.root


@pytest.fixture
def host(tmp_path):
    """(fixture root, ip in the host's namespace, its name): br0 holds the default route, with no port yet."""
    require_root()
    require_tool("ip")
    name = f"sdt-up-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    init = subprocess.Popen(["ip", "netns", "exec", name, "sleep", "600"])
    try:
        root = copy_profile(tmp_path, "sriov-nic")
        os.makedirs(os.path.join(root, "proc"), exist_ok=True)
        os.symlink(f"/proc/{init.pid}", os.path.join(root, "proc", "1"))
        _upper(root, "br0", [], bridge=True)
        os.makedirs(os.path.join(root, "sys/devices/virtual/net/br0/brif"))
        ip = lambda *a: subprocess.run(["ip", "-n", name, *a], check=True)  # noqa: E731
        for cmd in (["link", "add", "br0", "type", "bridge"], ["link", "set", "br0", "up"],
                    ["addr", "add", "192.0.2.1/24", "dev", "br0"], ["route", "add", "default", "via", "192.0.2.254"],
                    ["link", "add", "cni0", "type", "bridge"], ["link", "add", "up0", "type", "veth", "peer", "name", "pod0"]):
            ip(*cmd)
        yield root, ip, name
    finally:
        init.kill()
        init.wait()
        subprocess.run(["ip", "netns", "del", name], check=False)


async def until(predicate, what: str) -> None:
    async with asyncio.timeout(30):
        while not predicate():
            await asyncio.sleep(0.02)


def test_a_nic_added_to_the_uplink_bridge_leaves_the_inventory(host):
    root, ip, _ = host
    scanner = IncrementalScanner(root)
    assert PF1 in {d.pci.bdf for d in scanner.full().devices}  # br0 has no port yet
    rescans: list[set[str]] = []

    async def main():
        def full_rescan():
            rescans.append({d.pci.bdf for d in scanner.update(None).devices})

        watch = await follow_default_routes(SimpleNamespace(root=root, publish_uplink=False), True, full_rescan)
        assert watch is not None
        try:
            # enp6s0f1 (the fixture's PF1) becomes a port of the default route's bridge
            os.symlink("../../../../class/net/enp6s0f1/brport", os.path.join(root, "sys/devices/virtual/net/br0/brif/enp6s0f1"))
            ip("link", "set", "up0", "master", "br0")
            await until(lambda: rescans, "a full rescan after the uplink bridge got a port")
            # a pod's veth joining another bridge: the uplink is read again, nothing rescanned
            reads = watch.reads
            ip("link", "set", "pod0", "master", "cni0")
            await until(lambda: watch.reads > reads, "the uplink read again after the link change")
        finally:
            watch.stop()

    asyncio.run(main())
    assert len(rescans) == 1 and PF1 not in rescans[0] and PF0 in rescans[0]



def test_a_link_that_keeps_changing_does_not_hold_the_read_off(host):
    """Link messages without a pause (a port flapping, pods starting one after another) do not put
    the read off for as long as they come: it follows SETTLE after the first of them."""
    root, ip, name = host
    rescans: list[int] = []

    async def main():
        watch = await follow_default_routes(SimpleNamespace(root=root, publish_uplink=False), True, lambda: rescans.append(1))
        flap = subprocess.Popen(["ip", "netns", "exec", name, "sh", "-c",
                                 "while :; do ip link set pod0 up; ip link set pod0 down; done"])
        try:
            os.symlink("../../../../class/net/enp6s0f1/brport", os.path.join(root, "sys/devices/virtual/net/br0/brif/enp6s0f1"))
            ip("link", "set", "up0", "master", "br0")
            await until(lambda: rescans, "a full rescan while another link keeps changing")
        finally:
            flap.kill()
            flap.wait()
            watch.stop()

    asyncio.run(main())
