"""NICs the host uses are tainted ``sysdra.io/host-in-use`` (agent/service/hostnics.py), so the
scheduler's own allocator keeps claims away unless they tolerate it. On the real kernel: a network
namespace of the test stands for the host (the fixture root's ``proc/1`` is a process in it, as
the DaemonSet's ``/host/proc/1`` is the host's init), and a veth named like the server-2s-gpu-nic
fixture's NIC netdev for that NIC. Root only."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
from types import SimpleNamespace

import kubernetes_validate
import pytest

from agent.publish.slices import render
from agent.service import hostnics
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


def test_a_link_that_keeps_changing_does_not_hold_the_taint_off(host):
    """Address and link messages without a pause (another port flapping, pods starting back to
    back) do not put the read of the host off for as long as they come: a NIC the host starts
    using meanwhile is tainted SETTLE after the first of them. The read waited for a quiet
    SETTLE, and the NIC stayed offered untainted (a claim given it fails prepare) until it came."""
    s, nets = host
    inv = scan(s.root)

    async def main():
        changes: list[dict] = []
        nics = HostNics(lambda: s, lambda: changes.append(dict(nics.used)))
        await nics.scanned(inv)
        assert await nics.follow(kernel=True)
        ip(nets, "link", "add", "sdtfl0", "type", "veth", "peer", "name", "sdtfl1")
        flap = subprocess.Popen(["ip", "netns", "exec", nets.names["host"], "sh", "-c",
                                 "while :; do ip link set sdtfl0 up; ip link set sdtfl0 down; done"])
        try:
            ip(nets, "addr", "add", "10.9.8.7/24", "dev", IFNAME)  # DHCP gave it an address
            await until(lambda: changes == [{NIC: IFNAME}], timeout=10)
        finally:
            flap.kill()
            flap.wait()
            nics.stop()

    asyncio.run(main())


def test_a_taint_unhealthy_turned_on_by_sighup_follows_the_hosts_address_events(host):
    s, nets = host
    agent = Agent(s.replace(taint_unhealthy=False))
    agent.watcher = SimpleNamespace(uevents=True)  # as the daemon's on a host: the root's proc/1 is the host's init

    def tainted() -> bool:
        (nic,) = [d for d in _devices(agent.pool) if d["name"] == NIC]
        return any(t["key"] == TAINT_KEY for t in nic.get("taints", ()))

    async def main():
        await agent.rescan()
        assert not tainted()
        agent.reload(agent.settings.replace(taint_unhealthy=True))  # "live on SIGHUP" (docs/health.md)
        try:
            await until(lambda: agent.rescans >= 2 and not agent._scanning.locked() and not agent._background)
            assert not tainted()  # the host does not use it yet
            ip(nets, "addr", "add", "10.9.8.7/24", "dev", IFNAME)  # DHCP gave it an address: an address event
            await until(tainted, timeout=10)
        finally:
            agent.host_nics.stop()

    asyncio.run(main())


def _devices(pool) -> list[dict]:
    slices = render(pool, driver_name=DRIVER, node_name=NODE, generation=1, full_name=True)
    return [d for sl in slices for d in sl["spec"].get("devices", [])]


@pytest.mark.parametrize("first", ["event", "scan"])
def test_a_read_of_the_host_never_undoes_a_newer_one(monkeypatch, first):
    """An address event's read and a scan's read under way at once (a netdev back from its pod: the
    uevent's rescan and the host's link and address events): whichever ends last, what stays is
    what the host uses now among the NICs of the inventory now."""
    old, new = SimpleNamespace(devices=()), SimpleNamespace(devices=())  # only the new one has the NIC
    host = {"uses": False}  # whether the host uses the NIC's netdev
    gates = {"event": threading.Event(), "scan": threading.Event()}
    began = {"event": threading.Event(), "scan": threading.Event()}
    order: list[str] = []  # which read each call of host_used is, in the order they begin

    def host_used(root, inventory):  # in a worker thread, like the real one: reads the host, then takes a while
        seen = {NIC: IFNAME} if inventory is new and host["uses"] else {}
        if order:
            read = order.pop(0)
            began[read].set()
            gates[read].wait(10)
        return seen

    async def begun(read: str) -> None:
        assert await asyncio.to_thread(began[read].wait, 10)

    monkeypatch.setattr(hostnics, "host_used", host_used)
    s = SimpleNamespace(taint_unhealthy=True, root="/")

    async def main():
        nics = HostNics(lambda: s, lambda: None)
        await nics.scanned(old)
        if first == "event":  # the event's read begins with the old inventory; the scan's, of the new, ends first
            host["uses"] = True
            order[:] = ["event", "scan"]
            nics._reread()
            await begun("event")
            scan = asyncio.create_task(nics.scanned(new))
            await begun("scan")
            gates["scan"].set()
            await scan
            gates["event"].set()
            await event_read(nics)
        else:  # the scan's read begins before the host uses the netdev; the event's read after it, and ends first
            order[:] = ["scan", "event"]
            scan = asyncio.create_task(nics.scanned(new))
            await begun("scan")
            host["uses"] = True
            nics._reread()
            await begun("event")
            gates["event"].set()
            await event_read(nics)
            gates["scan"].set()
            await scan
        try:
            await until(lambda: nics.used == {NIC: IFNAME}, timeout=5)
        finally:
            nics.stop()

    asyncio.run(main())


async def event_read(nics: HostNics) -> None:
    """The address event's read done (its task ended)."""
    await asyncio.wait_for(asyncio.shield(nics._task), 10)


def test_without_the_hosts_namespace_under_the_root_nothing_is_tainted(tmp_path):
    root = copy_profile(tmp_path, "server-2s-gpu-nic")  # a fixture tree: its NICs are not this machine's
    assert host_used(root, scan(root)) is None


def test_a_name_no_label_value_can_hold_taints_without_a_value():
    assert taint("eth@0")["value"] == "" and taint("enp60s0np0")["value"] == "enp60s0np0"


async def until(predicate, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.05)
