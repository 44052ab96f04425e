"""Which link is the claim's netdev (prepare/netmove.py ``identify``/``pick``), whatever its
name: on the real kernel, with the namespaces and veth of tests/test_nri_netdev.py. A name in
the pod that another interface has fails the sandbox instead of configuring that interface; a
netdev the pod renamed comes back and a link the pod made under its name stays; a host name
another link took meanwhile keeps the record until it is free; a netdev the kernel gave back as
``dev<index>`` is found by its index, not mistaken for a host link of its pod name; the host's
MTU comes back with it. No device type of this kernel is returned to the host when its
namespace goes (physical NICs are; veths die), so the test moves a veth back as the kernel
would name it. Root only."""

from __future__ import annotations

import os
import subprocess

import pytest
from pydantic import ValidationError

from agent.nri.netdev import NetdevError
from agent.prepare import netmove, rtnl
from agent.prepare.checkpoint import Checkpoint
from agent.prepare.records import NetdevMove
from tests.test_nri_netdev import CLAIM, ip_json, mover, nets, pod, records, run, where, write_checkpoint  # noqa: F401


def ip(nets, where_: str, *args: str) -> None:  # noqa: F811
    subprocess.run(["ip", "-n", nets.names[where_], *args], check=True)


def global_addresses(nets, name: str) -> set[str]:  # noqa: F811
    (link,) = ip_json(nets, "addr", "show", name)
    return {a["local"] for a in link["addr_info"] if a.get("scope") == "global"}


def test_a_name_another_interface_has_in_the_pod_fails_the_sandbox(tmp_path, nets):  # noqa: F811
    """The runtime's own interface (a CNI's eth0), another claim's netdev of the same request
    name: the claim's netdev stays on the host and that interface gets none of its addresses."""
    ip(nets, "pod", "link", "add", "net1", "type", "veth", "peer", "name", "cni0")
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic, addresses=["192.0.2.5/24"])
    with pytest.raises(NetdevError, match="net1 is taken in the pod's network namespace by another interface"):
        run(mover(tmp_path, nets).pod_started(pod(nets)))
    assert rtnl.has_link(nets.host, nets.nic) and global_addresses(nets, "net1") == set()
    assert records(tmp_path)[0].get("state", "planned") == "planned"


def test_a_netdev_the_pod_renamed_comes_back_and_the_pods_own_link_of_its_name_stays(tmp_path, nets):  # noqa: F811
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    m = mover(tmp_path, nets)
    run(m.pod_started(pod(nets)))
    ip(nets, "pod", "link", "set", "net1", "down")
    ip(nets, "pod", "link", "set", "net1", "name", "x")
    ip(nets, "pod", "link", "add", "net1", "type", "veth", "peer", "name", "made0")  # the pod's, under the claim's name
    run(m.pod_stopped(pod(nets)))
    assert rtnl.has_link(nets.host, nets.nic) and not rtnl.has_link(nets.pod, "x")
    assert rtnl.has_link(nets.pod, "net1") and rtnl.link(nets.pod, "net1").parent is None
    assert records(tmp_path)[0].get("state", "planned") == "planned"


def test_a_host_name_another_link_took_keeps_the_record_until_it_is_free(tmp_path, nets):  # noqa: F811
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    m = mover(tmp_path, nets)
    run(m.pod_started(pod(nets)))
    ip(nets, "host", "link", "add", nets.nic, "type", "veth", "peer", "name", "took0")
    with pytest.raises(NetdevError, match=f"netdev {nets.nic} cannot come back under its name: another link has it now"):
        run(m.pod_stopped(pod(nets)))
    assert where(nets) == (True, True) and records(tmp_path)[0]["state"] == "returning"
    ip(nets, "host", "link", "del", nets.nic)
    run(m.reconcile())  # the way back tried again
    assert where(nets) == (True, False) and records(tmp_path)[0].get("state", "planned") == "planned"


def test_a_netdev_given_back_as_dev_index_is_found_by_its_index(tmp_path, nets):  # noqa: F811
    """Its namespace went unannounced; the kernel named it ``dev<index>`` (its name was taken)
    and a host link has its pod name: that link is not taken for it, the netdev is renamed."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic, mtu=1400)
    m = mover(tmp_path, nets)
    run(m.pod_started(pod(nets)))
    index = records(tmp_path)[0]["index"]
    rtnl.move(nets.pod, "net1", nets.host, f"dev{index}")  # as the kernel gives a physical netdev back
    ip(nets, "host", "link", "add", "net1", "type", "veth", "peer", "name", "other0")
    subprocess.run(["ip", "netns", "del", nets.names["pod"]], check=True)
    run(m.reconcile())
    back = rtnl.link(nets.host, nets.nic)
    assert back is not None and back.index == index and back.mtu == 1500  # the host's MTU again
    assert not rtnl.has_link(nets.host, f"dev{index}") and rtnl.has_link(nets.host, "net1")
    assert records(tmp_path)[0].get("state", "planned") == "planned"


def test_the_hosts_mtu_comes_back_with_the_netdev(tmp_path, nets):  # noqa: F811
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic, mtu=1400)
    m = mover(tmp_path, nets)
    run(m.pod_started(pod(nets)))
    assert rtnl.link(nets.pod, "net1").mtu == 1400
    run(m.pod_stopped(pod(nets)))
    assert rtnl.link(nets.host, nets.nic).mtu == 1500


def _bus_device() -> str:
    """A device on one of this machine's buses, as a NIC function would be."""
    return next(d for b in sorted(os.listdir("/sys/bus")) if os.path.isdir(f"/sys/bus/{b}/devices")
                for d in sorted(os.listdir(f"/sys/bus/{b}/devices")) if netmove._BUS.match(d))


@pytest.mark.parametrize("on_bus", [True, False])
def test_a_nics_netdev_in_neither_namespace_is_looked_for_again_while_its_function_is_on_the_bus(tmp_path, nets, on_bus):  # noqa: F811
    """A NIC's netdev (its record names its bus device) not in its gone namespace and not back:
    the kernel returns it once the namespace is torn down, so its record waits; a function that
    left the bus (a VF removed) has nothing to give back."""
    subprocess.run(["ip", "netns", "del", nets.names["pod"]], check=True)
    write_checkpoint(tmp_path / "checkpoint.json", "vf9", state="in-pod", sandbox="sb1", netns=nets.pod, index=4242,
                     parent=_bus_device() if on_bus else "0000:ff:1f.7")
    run(mover(tmp_path, nets).reconcile())
    assert records(tmp_path)[0].get("state", "planned") == ("returning" if on_bus else "planned")


def test_a_sandbox_no_record_can_name_is_refused_before_anything_is_saved(tmp_path, nets):  # noqa: F811
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    with pytest.raises(NetdevError, match="its sandbox is not one a record can name"):
        run(mover(tmp_path, nets).pod_started(pod(nets, sandbox="x" * 200)))
    assert where(nets) == (True, False)
    assert not Checkpoint.load(str(tmp_path / "checkpoint.json")).rejected and records(tmp_path)[0].get("state", "planned") == "planned"


# --- picking the link, on what the kernel lists ---------------------------------------------
def _link(name, index, mac=None, parent=None):
    return rtnl.Link(name, index, mac, 1500, parent)


def _move(**kw):
    return NetdevMove(device="nic-0", request="r", host="ens1f0", pod="net1", **kw)


def test_a_nics_netdev_is_picked_by_its_bus_device_then_index_then_mac():
    pf, rep1, rep2 = _link("ens1f0", 7, "aa:00:00:00:00:01", "0000:3b:00.0"), _link("eth0", 8, "aa:00:00:00:00:02", "0000:3b:00.0"), \
        _link("net1", 9, "aa:00:00:00:00:03", "0000:3b:00.0")
    made = _link("net1", 7, "aa:00:00:00:00:01")  # the pod's: same index and MAC, no bus device
    assert netmove.pick([made, pf], _move(parent="0000:3b:00.0", index=7), "net1") == pf
    assert netmove.pick([made], _move(parent="0000:3b:00.0", index=7), "net1") is None
    assert netmove.pick([pf, rep1, rep2], _move(parent="0000:3b:00.0", index=8), "net1") == rep1  # switchdev representors
    assert netmove.pick([pf, rep1, rep2], _move(parent="0000:3b:00.0", index=99, mac="aa:00:00:00:00:03"), "x") == rep2
    assert netmove.pick([pf, rep1], _move(parent="0000:3b:00.0", index=99), "ens1f0") is None  # ambiguous: never a guess
    assert netmove.pick([rep1], _move(parent="0000:3b:00.0", index=99), "x") == rep1  # renamed and renumbered, still its function's


def test_a_virtual_link_is_picked_by_mac_then_index_and_by_name_only_without_either():
    veth, other, twin = _link("devX", 12, "aa:00:00:00:00:0c"), _link("net1", 13, "aa:00:00:00:00:0d"), _link("t", 14, "aa:00:00:00:00:0c")
    assert netmove.pick([other, veth], _move(index=13, mac="aa:00:00:00:00:0c"), "net1") == veth  # renumbered by a move
    assert netmove.pick([other, veth, twin], _move(index=14, mac="aa:00:00:00:00:0c"), "net1") == twin
    assert netmove.pick([other, veth, twin], _move(index=15, mac="aa:00:00:00:00:0c"), "net1") is None  # never a guess
    assert netmove.pick([other, veth], _move(index=13), "devX") == other
    assert netmove.pick([other, veth], _move(), "net1") == other  # a record of an earlier agent, before a move


def test_the_kernels_links_say_their_bus_device():
    """rtnl.links (one dump) against sysfs: each link's bus device is its ``device`` link's name."""
    found = {link.name: link for link in rtnl.links("/proc/self/ns/net")}
    assert "lo" in found and found["lo"].index == 1 and found["lo"].parent is None
    for name, link in found.items():
        device = f"/sys/class/net/{name}/device"
        assert link.parent == (os.path.basename(os.path.realpath(device)) if os.path.exists(device) else None), name
        assert rtnl.link("/proc/self/ns/net", name) == link


@pytest.mark.parametrize("netns, valid", [
    ("/proc/1/ns/net", True), ("/" + "é" * 4095, True), ("/a\nb", True), ("//", True),
    ("/", False), ("/" + "x" * 4096, False), ("/a\x00b", False), ("net", False), ("", False)])
def test_a_records_netns_is_a_path_of_at_most_4096_characters_without_nul(netns, valid):
    """Checkpoint contents are untrusted: "/" and 1-4,095 more characters, none NUL (the limit
    is a length, not a repetition in the pattern: see records.NetnsPath)."""
    if valid:
        assert _move(netns=netns).netns == netns
    else:
        with pytest.raises(ValidationError):
            _move(netns=netns)


# --- a NIC function with more than one netdev (a switchdev PF and its representor, ports) ------
class _Kernel:
    """Namespaces (files under tmp_path, so ``os.path.exists`` sees them) and their links, for the
    rtnl calls netmove makes: links keep their index across a move unless it is taken there."""

    def __init__(self, tmp_path, **namespaces):
        self.ns = {}
        for name, links in namespaces.items():
            path = str(tmp_path / name)
            open(path, "w").close()
            self.ns[path] = {link.index: link for link in links}
        self.paths = {name: str(tmp_path / name) for name in namespaces}

    def patch(self, monkeypatch):
        for name in ("links", "link", "move", "rename", "set_mtu", "set_up", "add_address", "add_route"):
            monkeypatch.setattr(rtnl, name, getattr(self, name))

    def links(self, ns):
        return list(self.ns[ns].values())

    def link(self, ns, name):
        return next((link for link in self.ns[ns].values() if link.name == name), None)

    def _take(self, ns, name, index):
        link = self.ns[ns].pop(index if index is not None else self.link(ns, name).index)
        assert link.name == name
        return link

    def move(self, src, name, dst, new_name, index=None):
        link = self._take(src, name, index)
        assert self.link(dst, new_name) is None
        new_index = link.index if link.index not in self.ns[dst] else max(self.ns[dst]) + 1
        self.ns[dst][new_index] = link._replace(name=new_name, index=new_index)

    def rename(self, ns, name, new_name, index=None):
        link = self._take(ns, name, index)
        assert self.link(ns, new_name) is None
        self.ns[ns][link.index] = link._replace(name=new_name)

    def set_mtu(self, ns, name, mtu):
        link = self.link(ns, name)
        self.ns[ns][link.index] = link._replace(mtu=mtu)

    def set_up(self, ns, name):
        pass

    def add_address(self, ns, name, address):
        pass

    def add_route(self, ns, name, destination, gateway):
        pass

    def names(self, name):
        return {link.name: link.index for link in self.ns[self.paths[name]].values()}


def test_a_pf_in_its_pod_is_not_taken_for_its_representor_left_on_the_host(tmp_path, monkeypatch):
    """A switchdev PF (or one port of a multi-port function) goes into the pod; its representor,
    a netdev of the same bus device, stays on the host. At StopPodSandbox the PF comes back from the
    pod: the representor, the one link of that bus device still on the host, is not the claim's
    netdev (renamed to the PF's host name while the PF stays in the pod)."""
    bdf = "0000:3b:00.0"
    k = _Kernel(tmp_path, host=[_link("lo", 1), _link("ens1f0", 7, "aa:00:00:00:00:01", bdf),
                                _link("eth0", 8, "aa:00:00:00:00:02", bdf)],
                pod=[_link("lo", 1), _link("eth0", 2, "aa:00:00:00:00:0e")])
    k.patch(monkeypatch)
    host, netns = k.paths["host"], k.paths["pod"]
    move = netmove.identify(_move(bdf=bdf, sandbox="sb1", netns=netns), host)
    assert (move.parent, move.index) == (bdf, 7)
    move = netmove.move_in(move.changed(state="moving"), host)
    assert k.names("pod") == {"lo": 1, "eth0": 2, "net1": 7} and k.names("host") == {"lo": 1, "eth0": 8}
    netmove.move_out(move.changed(state="returning"), host)
    assert k.names("host") == {"lo": 1, "ens1f0": 7, "eth0": 8}  # the PF back, its representor as it was
    assert k.names("pod") == {"lo": 1, "eth0": 2}


def test_the_hosts_mtu_comes_back_when_the_pod_changed_it(tmp_path, nets):  # noqa: F811
    """No NicConfig mtu: the pod (CAP_NET_ADMIN, its own network setup) set one. The netdev comes
    back to the host "left down, its MTU as it was on the host" (docs/networking.md)."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    m = mover(tmp_path, nets)
    run(m.pod_started(pod(nets)))
    ip(nets, "pod", "link", "set", "net1", "mtu", "9000")
    run(m.pod_stopped(pod(nets)))
    assert rtnl.link(nets.host, nets.nic).mtu == 1500
