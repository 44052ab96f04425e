"""NICs the host uses are tainted ``sysdra.io/host-in-use`` (agent/service/hostnics.py), so the
scheduler's own allocator keeps claims away unless they tolerate it. On the real kernel: a network
namespace of the test stands for the host (the fixture root's ``proc/1`` is a process in it, as
the DaemonSet's ``/host/proc/1`` is the host's init), and a veth named like the server-2s-gpu-nic
fixture's NIC netdev for that NIC. Root only."""

from __future__ import annotations

import asyncio
import os
import subprocess

import kubernetes_validate
import pytest

from agent.publish.slices import render
from agent.service.daemon import Agent
from agent.service.hostnics import TAINT_KEY, HostNics, host_used, taint
from discovery.inventory import scan
from tests.conftest import copy_profile
from tests.controlplane import Unschedulable, allocate
from tests.kubelet_standin import settings_for
from tests.test_allocator import CLASSES, DRIVER, NODE, claim, exactly, picked
from tests.test_nri_netdev import IFNAME, NIC, ifname_nets, nets  # noqa: F401

TOLERATE = [{"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}]


@pytest.fixture
def host(tmp_path, ifname_nets):  # noqa: F811
    """(settings, nets): the fixture root whose init lives in the test's host namespace."""
    root = copy_profile(tmp_path, "server-2s-gpu-nic")
    init = subprocess.Popen(["ip", "netns", "exec", ifname_nets.names["host"], "sleep", "600"])
    try:
        os.symlink(f"/proc/{init.pid}", os.path.join(root, "proc", "1"))
        s = settings_for(str(tmp_path), root=root, node_name=NODE, taint_unhealthy=True, nvml=False, metrics_address="",
                         nri_socket="")
        yield s, ifname_nets
    finally:
        init.kill()
        init.wait()


def ip(nets, *args: str) -> None:  # noqa: F811
    subprocess.run(["ip", "-n", nets.names["host"], *args], check=True)


def nic_request(tolerate: bool) -> dict:
    sel = [{"cel": {"expression": f'device.attributes["sysdra.io"].interfaceName == "{IFNAME}"'}}]
    return exactly("nic", "nic.sysdra.io", selectors=sel, **({"tolerations": TOLERATE} if tolerate else {}))


def test_the_allocator_keeps_claims_away_from_a_nic_the_host_uses(host):
    s, nets = host
    ip(nets, "addr", "add", "10.9.8.7/24", "dev", IFNAME)

    async def main():
        agent = Agent(s)
        await agent.rescan()
        return agent.pool

    pool = asyncio.run(main())
    slices = render(pool, driver_name=DRIVER, node_name=NODE, generation=1, full_name=True)
    (entry,) = [d for sl in slices for d in sl["spec"].get("devices", []) if d["name"] == NIC]
    assert {"key": TAINT_KEY, "value": IFNAME, "effect": "NoSchedule"} in entry["taints"]
    assert [d["name"] for sl in slices for d in sl["spec"].get("devices", [])
            if any(t["key"] == TAINT_KEY for t in d.get("taints", ()))] == [NIC]  # the others' netdevs are not the host's
    for obj in slices:
        kubernetes_validate.validate(obj, "1.37", strict=True)
    with pytest.raises(Unschedulable):
        allocate(slices, CLASSES, claim("plain", nic_request(False)), node=NODE)
    (a,) = allocate(slices, CLASSES, claim("meant", nic_request(True)), node=NODE)
    assert picked(a)["nic"] == [NIC]


def test_the_taint_follows_the_hosts_address_and_link_events(host):
    s, nets = host
    inv = scan(s.root)

    async def main():
        changes: list[dict] = []
        nics = HostNics(lambda: s, lambda: changes.append(dict(nics.used)))
        await nics.scanned(inv)
        assert nics.used == {}  # the veth holds nothing of the host's yet
        assert await nics.follow(kernel=True)  # the root's proc/1: the test's host namespace
        try:
            ip(nets, "addr", "add", "10.9.8.7/24", "dev", IFNAME)  # DHCP gave it an address
            await until(lambda: changes == [{NIC: IFNAME}])
            ip(nets, "addr", "flush", "dev", IFNAME)
            await until(lambda: changes[-1:] == [{}])
            ip(nets, "link", "add", "sdthn0", "type", "bridge")
            ip(nets, "link", "set", IFNAME, "master", "sdthn0")  # made a bridge port: a link event only
            await until(lambda: changes[-1:] == [{NIC: IFNAME}])
            assert nics.with_taints({NIC: [{"key": "sysdra.io/unhealthy", "value": "link-down", "effect": "NoSchedule"}]}) == {
                NIC: [{"key": "sysdra.io/unhealthy", "value": "link-down", "effect": "NoSchedule"}, taint(IFNAME)]}
        finally:
            nics.stop()

    asyncio.run(main())


def test_without_the_hosts_namespace_under_the_root_nothing_is_tainted(tmp_path):
    root = copy_profile(tmp_path, "server-2s-gpu-nic")  # a fixture tree: its NICs are not this machine's
    assert host_used(root, scan(root)) is None


def test_a_name_no_label_value_can_hold_taints_without_a_value():
    assert taint("eth@0")["value"] == "" and taint("enp60s0np0")["value"] == "enp60s0np0"


async def until(predicate, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.05)
