"""A claimed NIC's netdev in its pod keeps its facts in the slice (discovery/away.py,
agent/service/inpod.py): the function's ``interfaceName``, ``macAddress`` and ``mtu`` stay as they
were before the move, so a pod's start and stop write no slice (dranet#99).

The move is real: the agent's NRI side moves a veth named as the fixture NIC's netdev from the
test's host namespace into its pod namespace (tests/test_nri_netdev.py). What the host's sysfs
shows cannot follow it here (the NIC is a fixture tree's: a veth has no PCI function), so the test
does what the kernel's sysfs does when the netdev leaves the host's namespace: the fixture copy's
``net/<name>`` goes (and comes back with the netdev), and the rescan is the one its uevent asks for
(that function). Slice writes are counted by the publisher's sync. Root only."""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest

from agent.nri.netdev import NetdevMover
from agent.prepare.driver import Driver
from agent.prepare.steps.netdev import NetdevStep
from agent.service.daemon import Agent
from agent.service.inpod import InPodNetdevs
from discovery.away import kept
from discovery.models import NetInterface, NicInfo
from tests.conftest import copy_profile
from tests.kubelet_standin import settings_for
from tests.test_nri_netdev import CLAIM, IFNAME, NIC, ifname_nets, nets, nic_claim, pod, where  # noqa: F401

BDF = "0000:3c:00.0"


@pytest.fixture
def node(tmp_path, ifname_nets):  # noqa: F811
    root = copy_profile(tmp_path, "server-2s-gpu-nic")
    s = settings_for(str(tmp_path), root=root, metrics_address="")
    netdev = os.path.realpath(os.path.join(root, "sys/bus/pci/devices", BDF, "net", IFNAME))
    kept_copy = str(tmp_path / "netdev")
    shutil.copytree(netdev, kept_copy, symlinks=True)

    def sysfs_shows(there: bool) -> None:  # the kernel's sysfs, as the netdev leaves or comes back
        if there:
            shutil.copytree(kept_copy, netdev, symlinks=True)
        else:
            shutil.rmtree(netdev)

    return s, ifname_nets, sysfs_shows


def slices(s) -> dict[str, bytes]:
    out = {}
    for dirpath, _, files in os.walk(s.cluster_dir):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                out[os.path.join(dirpath, name)] = f.read()
    return out


def facts(agent: Agent) -> dict:
    attrs = agent.inventory.by_name()[NIC].attributes
    return {k: attrs[k].encoded for k in ("interfaceName", "macAddress", "mtu", "switchdevPortName") if k in attrs}


def prepare(s, nets, agent: Agent) -> NetdevMover:  # noqa: F811
    d = Driver(s, lambda: agent.inventory)
    next(st for st in d.steps if isinstance(st, NetdevStep)).host_netns = lambda: nets.host
    assert d.prepare_claims([nic_claim()])[CLAIM].error is None
    return NetdevMover(s.plugin_dir, host_netns=nets.host, settings=s)


def test_a_pod_start_and_stop_write_no_slice(node):
    s, nets, sysfs_shows = node

    async def cycle():
        agent = Agent(s)
        assert await agent.rescan()
        assert (await agent.publisher.sync_once()).writes > 0
        published, seen = slices(s), facts(agent)
        assert seen["interfaceName"] == {"string": IFNAME} and "macAddress" in seen and "mtu" in seen
        mover = prepare(s, nets, agent)
        await mover.pod_started(pod(nets))
        assert where(nets, IFNAME) == (False, True)  # in the pod: the host's sysfs no longer shows it
        sysfs_shows(False)
        assert not await agent.rescan(changed={BDF})  # the move's uevent: nothing new to publish
        assert not await agent.rescan()  # nor a full resync
        assert (await agent.publisher.sync_once()).writes == 0
        assert slices(s) == published and facts(agent) == seen
        await mover.pod_stopped(pod(nets))
        assert where(nets, IFNAME) == (True, False)
        sysfs_shows(True)
        assert not await agent.rescan(changed={BDF})
        assert (await agent.publisher.sync_once()).writes == 0
        assert slices(s) == published

    asyncio.run(asyncio.wait_for(cycle(), 60))


def test_an_agent_started_while_the_netdev_is_in_its_pod_publishes_the_records_facts(node):
    """No earlier scan to keep: the move's record knows the netdev's host name, MAC and MTU."""
    s, nets, sysfs_shows = node

    async def start():
        first = Agent(s)
        await first.rescan()
        mover = prepare(s, nets, first)
        await mover.pod_started(pod(nets))
        sysfs_shows(False)
        agent = Agent(s)  # a restart
        await agent.rescan()
        return facts(agent), InPodNetdevs(s.plugin_dir)()

    seen, away = asyncio.run(asyncio.wait_for(start(), 60))
    (fact,) = away[BDF].values()
    assert fact.name == IFNAME and fact.mac and fact.mtu == 1500
    assert seen == {"interfaceName": {"string": IFNAME}, "macAddress": {"string": fact.mac}, "mtu": {"int": 1500}}


def test_kept_adds_only_the_netdevs_away_in_the_order_last_read():
    a, b, c = (NetInterface(name=n, mac=None, mtu=1500) for n in ("p0", "p1", "p2"))
    record = NetInterface(name="p1", mac="02:00:00:00:00:01", mtu=9000)
    now = NicInfo(interfaces=(a, c), rdma=())
    assert kept(now, (a, b, c), {"p1": record}).interfaces == (a, b, c)  # as last read, not as recorded
    assert kept(now, (), {"p1": record}).interfaces == (a, record, c)  # nothing read before: the record's
    assert kept(now, (a, b, c), {"p0": record}) is now  # still on the host: as read now


def test_scan_slices_shows_what_run_publishes_while_the_netdev_is_in_its_pod(node):
    import json
    import subprocess
    import sys

    from tests.conftest import REPO

    s, nets, sysfs_shows = node

    async def move():
        agent = Agent(s)
        await agent.rescan()
        await prepare(s, nets, agent).pod_started(pod(nets))

    asyncio.run(asyncio.wait_for(move(), 60))
    sysfs_shows(False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYSDRA_")}
    out = subprocess.run([sys.executable, "-m", "agent", "scan", "--root", s.root, "-o", "slices", "--node-name", s.node_name,
                          "--nvml", "false"], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**env, "SYSDRA_CONFIG": os.devnull, "SYSDRA_KUBELET_DIR": s.kubelet_dir})  # fmt: skip
    assert out.returncode == 0, out.stderr
    (dev,) = [d for item in json.loads(out.stdout)["items"] for d in item["spec"]["devices"] if d["name"] == NIC]
    assert dev["attributes"]["interfaceName"] == {"string": IFNAME}
