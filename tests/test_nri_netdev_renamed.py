"""A claimed NIC's netdev is found by the PCI function it was allocated, not by the name its record
has: after a reboot the same function's netdev may come up under another name (ethN renumbering, a
naming-policy or driver change), or the operator renamed it while the agent restarted, and the
kubelet's re-prepare keeps the claim's record. The move at the pod's sandbox takes the function's
netdev (sysfs ``<root>/sys/bus/pci/devices/<bdf>/net/``), checks the host's use of it under its name
now, records that name and gives the netdev back under it; another NIC that took the old name
stays. On the real kernel: the namespaces and veth of tests/test_nri_netdev.py, a copy of the
server-2s-gpu-nic profile whose sysfs names the veth as its NIC's netdev. Root only."""

from __future__ import annotations

import os
import subprocess

import pytest

from agent.kubeletplugin.types import ClaimRef
from agent.nri.netdev import NetdevError, NetdevMover
from agent.prepare import netmove, rtnl
from agent.prepare.checkpoint import Checkpoint
from agent.prepare.driver import Driver
from agent.prepare.records import NetdevMove
from agent.prepare.steps.netdev import NetdevStep
from discovery.inventory import scan
from tests.conftest import copy_profile
from tests.kubelet_standin import settings_for
from tests.test_nri_netdev import CLAIM, IFNAME, ifname_nets, nets, nic_claim, pod, run  # noqa: F401

BDF, OTHER_BDF = "0000:3c:00.0", "0000:bd:00.0"  # the claim's NIC (its netdev IFNAME) and another NIC


def ip(nets, *args: str) -> None:  # noqa: F811
    subprocess.run(["ip", "-n", nets.names["host"], *args], check=True)


def prepared(tmp_path, nets) -> Driver:  # noqa: F811
    """The claim prepared on a copy of the profile (its NIC's netdev IFNAME, the test's veth)."""
    root = copy_profile(tmp_path, "server-2s-gpu-nic")
    s = settings_for(str(tmp_path / "agent"), root=root)
    inv = scan(root)
    d = Driver(s, lambda: inv)
    next(st for st in d.steps if isinstance(st, NetdevStep)).host_netns = lambda: nets.host
    assert d.prepare_claims([nic_claim()])[CLAIM].error is None
    return d


def sysfs_rename(root: str, bdf: str, old: str, new: str) -> None:
    """What sysfs shows once the kernel has the function's netdev under ``new``."""
    net = os.path.join(root, "sys/bus/pci/devices", bdf, "net")
    os.rename(os.path.join(net, old), os.path.join(net, new))
    target = os.readlink(os.path.join(root, "sys/class/net", old))
    os.unlink(os.path.join(root, "sys/class/net", old))
    os.symlink(os.path.join(os.path.dirname(target), new), os.path.join(root, "sys/class/net", new))


def rename(nets, root: str, old: str, new: str) -> None:  # noqa: F811
    ip(nets, "link", "set", old, "name", new)
    sysfs_rename(root, BDF, old, new)


def host_names(d: Driver) -> list[str]:
    return [m["host"] for m in Checkpoint.load(d.checkpoint_path).claims[CLAIM]["netdevs"]]


def test_a_netdev_renamed_after_prepare_is_moved_and_comes_back_under_its_new_name(tmp_path, ifname_nets):  # noqa: F811
    nets = ifname_nets
    d = prepared(tmp_path, nets)
    rename(nets, d.settings.root, IFNAME, "eth7")  # the next boot's name for the same function
    assert d.prepare_claims([nic_claim()])[CLAIM].error is None  # the kubelet's re-prepare keeps the record
    m = NetdevMover(d.settings.plugin_dir, host_netns=nets.host, settings=d.settings)
    run(m.pod_started(pod(nets)))
    assert rtnl.has_link(nets.pod, "net1") and not rtnl.has_link(nets.host, "eth7")
    assert host_names(d) == ["eth7"]
    run(m.pod_stopped(pod(nets)))
    assert rtnl.has_link(nets.host, "eth7") and not rtnl.has_link(nets.host, IFNAME)  # the host's name now
    assert d.unprepare_claims([ClaimRef("default", "nic", CLAIM)]) == {CLAIM: None}


def test_another_nic_that_took_the_old_name_is_not_moved(tmp_path, ifname_nets):  # noqa: F811
    """ethN renumbering: the other NIC's netdev now has the claim's recorded name."""
    nets = ifname_nets
    d = prepared(tmp_path, nets)
    root = d.settings.root
    rename(nets, root, IFNAME, "eth7")
    ip(nets, "link", "add", IFNAME, "type", "veth", "peer", "name", "otherpeer")
    sysfs_rename(root, OTHER_BDF, "enp189s0np0", IFNAME)
    other = rtnl.link(nets.host, IFNAME).index
    run(NetdevMover(d.settings.plugin_dir, host_netns=nets.host, settings=d.settings).pod_started(pod(nets)))
    after = rtnl.link(nets.host, IFNAME)
    assert after is not None and after.index == other and not rtnl.has_link(nets.host, "eth7")
    assert rtnl.has_link(nets.pod, "net1") and host_names(d) == ["eth7"]


def test_the_hosts_use_is_read_under_the_netdevs_name_now(tmp_path, ifname_nets):  # noqa: F811
    nets = ifname_nets
    d = prepared(tmp_path, nets)
    rename(nets, d.settings.root, IFNAME, "eth7")
    ip(nets, "addr", "add", "10.9.8.7/24", "dev", "eth7")
    with pytest.raises(NetdevError, match=f"netdev eth7 \\({BDF}\\): it holds the host's address 10.9.8.7/24"):
        run(NetdevMover(d.settings.plugin_dir, host_netns=nets.host, settings=d.settings).pod_started(pod(nets)))
    assert rtnl.has_link(nets.host, "eth7") and not rtnl.has_link(nets.pod, "net1")
    assert [m.get("state", "planned") for m in Checkpoint.load(d.checkpoint_path).claims[CLAIM]["netdevs"]] == ["planned"]


def test_a_function_with_several_netdevs_none_under_the_recorded_name_is_never_guessed(monkeypatch):
    """A switchdev PF and its representor (one bus device), both renamed."""
    pf, rep = rtnl.Link("eth3", 7, "aa:00:00:00:00:01", 1500, BDF), rtnl.Link("eth4", 8, "aa:00:00:00:00:02", 1500, BDF)
    monkeypatch.setattr(rtnl, "links", lambda netns: [rtnl.Link("lo", 1, None, 65536, None), pf, rep])
    move = NetdevMove(device="nic-0", request="r", bdf=BDF, host="ens1f0", pod="net1")
    with pytest.raises(rtnl.LinkError, match=f"which netdev of {BDF} \\(eth3, eth4\\) is the claim's cannot be told"):
        netmove.identify(move, "/host-netns", "/nonexistent")
    assert netmove.identify(move.changed(host="eth4"), "/host-netns", "/nonexistent").index == 8


# --- a netdev already on the host under another name, its recorded name another link's ----------
def test_a_netdev_back_on_the_host_whose_recorded_name_is_taken_keeps_its_name_now(tmp_path, nets):  # noqa: F811
    """After a reboot (its pod's namespace gone) the NIC's netdev is on the host under the boot's
    name and its recorded name is another NIC's: nothing is left to move, so the record is finished
    under the name it has (the look every 10 s, Synchronize) and unprepare undoes it; it stayed
    ``returning``, and every unprepare failed, until the other link let the name go."""
    from tests.test_nri_netdev import mover, records, write_checkpoint

    mine = rtnl.link(nets.host, nets.nic)
    gone = f"/run/netns/{nets.names['pod']}-gone"
    write_checkpoint(tmp_path / "checkpoint.json", "old0", state="in-pod", sandbox="sb1", netns=gone, index=mine.index,
                     mac=mine.mac)
    ip(nets, "link", "add", "old0", "type", "veth", "peer", "name", "otherpeer")
    run(mover(tmp_path, nets).reconcile())
    (rec,) = records(tmp_path)
    assert (rec.get("state", "planned"), rec["host"]) == ("planned", nets.nic)
    assert rtnl.link(nets.host, nets.nic).index == mine.index and rtnl.has_link(nets.host, "old0")
    settings = settings_for(str(tmp_path / "agent"))
    step = NetdevStep(settings, lambda: nets.host)
    undone = step.undo(tuple(step.read({"netdevs": [{**rec, "host": "old0", "state": "in-pod", "sandbox": "sb1",
                                                       "netns": gone, "index": mine.index, "mac": mine.mac}]})), {})
    assert undone.problems == [] and rtnl.has_link(nets.host, nets.nic)
