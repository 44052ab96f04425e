"""NICs the host uses are not given away (prepare/hostuse.py): a netdev that in the host's network
namespace holds a global address, is a bridge (bond, team, OVS) port or master, or carries a
macvlan (VLAN, ipvlan) is refused by the netdev step (moved into a pod) and the VFIO step (bound to
vfio-pci) at prepare, nothing changed, unless the node's ``allow_host_in_use_nics`` and the claim's
``allowHostInUse`` both say so. On the real kernel: the network namespaces and veth of
tests/test_nri_netdev.py stand for the host and its NIC's netdev (this kernel has bridges and
macvlans, no bonds or VLANs: the kernel reports a bond's ports as a bridge's, IFLA_MASTER). The
VFIO side binds on the simulated kernel of tests/test_vfio.py. Root only."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agent.kubeletplugin.types import ClaimRef
from agent.nri.netdev import NetdevError, NetdevMover
from agent.prepare import hostuse, netmove, rtnl
from agent.prepare.checkpoint import Checkpoint
from agent.prepare.driver import Driver
from agent.prepare.steps.netdev import NetdevStep
from agent.prepare.steps.vfio import VfioStep
from discovery.inventory import scan
from tests.conftest import REPO, profile_root, require_root, require_tool
from tests.kubelet_standin import settings_for
from tests.test_nri_netdev import CLAIM, IFNAME, ifname_nets, nets, nic_claim, pod, run, where  # noqa: F401
from tests.test_vfio import UID, VF, VF_BDF, node, vfio_claim  # noqa: F401

BDF = "0000:3c:00.0"  # server-2s-gpu-nic's NIC, whose netdev is IFNAME


def ip(nets, *args: str) -> None:  # noqa: F811
    subprocess.run(["ip", "-n", nets.names["host"], *args], check=True)


def test_what_the_host_uses_is_read_from_its_namespace(nets):  # noqa: F811
    ip(nets, "link", "set", nets.nic, "up")  # an up link gets an IPv6 link-local address: not the host's use
    assert hostuse.host_uses(nets.host, {nets.nic: None, "absent0": None}) == {}
    ip(nets, "addr", "add", "10.9.8.7/24", "dev", nets.nic)
    ip(nets, "addr", "add", "2001:db8::7/64", "dev", nets.nic, "nodad")
    assert hostuse.host_uses(nets.host, {nets.nic: None}) == {
        nets.nic: "it holds the host's addresses 10.9.8.7/24, 2001:db8::7/64"}
    ip(nets, "addr", "flush", "dev", nets.nic)
    ip(nets, "link", "add", "sdtbr0", "type", "bridge")
    ip(nets, "link", "set", nets.nic, "master", "sdtbr0")
    assert hostuse.host_uses(nets.host, {nets.nic: None, "sdtbr0": None}) == {
        nets.nic: "it is a port of bridge sdtbr0", "sdtbr0": f"it is the master of {nets.nic}"}
    ip(nets, "link", "set", nets.nic, "nomaster")
    ip(nets, "link", "add", "link", nets.nic, "name", "sdtmv0", "type", "macvlan")
    assert hostuse.host_uses(nets.host, {nets.nic: None}) == {nets.nic: "macvlan sdtmv0 sits on it"}
    assert hostuse.host_uses(nets.host, {"sdtmv0": None}) == {}  # the macvlan itself: nothing of the host's on it


def test_a_netdev_of_another_pci_function_is_not_the_claims():
    link = rtnl.Link("eth1", 3, None, 1500, "0000:3b:00.0")
    assert hostuse._ours([link], "eth1", BDF) is None
    assert hostuse._ours([link], "eth1", "0000:3b:00.0") is link
    assert hostuse._ours([link._replace(parent="virtio3")], "eth1", BDF) is not None  # a virtio netdev's bus device


def test_a_namespace_that_cannot_be_read_refuses_unless_both_allow_whatever_it_is():
    for node_allows, claim_allows in ((False, False), (True, False), (False, True)):
        why = hostuse.refusal(lambda: "/nonexistent/netns", {IFNAME: BDF}, node_allows, claim_allows, "moved into a pod",
                              "NicConfig")
        assert why.startswith(f"whether the host uses netdev {IFNAME} cannot be read ([Errno 2] No such file")
    assert hostuse.refusal(lambda: "/nonexistent/netns", {IFNAME: BDF}, True, True, "moved into a pod", "NicConfig") is None


def test_an_init_namespace_the_agent_may_not_open_refuses(tmp_path):
    """The DaemonSet's agent without hostPID and CAP_SYS_PTRACE: the init's namespace under the root
    is there but cannot be opened, and ``netmove.host_netns`` falls back to the agent's own, where
    no netdev of the host would be found: that is no answer, so the claim is refused."""
    require_root()
    require_tool("setpriv")
    init = subprocess.Popen(["sleep", "600"])  # an init: root with every capability this test has
    try:
        os.makedirs(tmp_path / "proc")
        os.symlink(f"/proc/{init.pid}", tmp_path / "proc" / "1")
        check = ("import sys; from agent.prepare import hostuse, netmove; root = sys.argv[1]; "
                 "print(hostuse.refusal(lambda: hostuse.namespace(root, lambda: netmove.host_netns(root)), "
                 "{'eth0': None}, False, False, 'moved into a pod', 'NicConfig'))")
        out = subprocess.run(["setpriv", "--inh-caps=-all", "--bounding-set=-all,+net_admin,+sys_admin,+dac_override",
                              sys.executable, "-c", check, str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": REPO}, check=True)  # fmt: skip
        assert out.stdout.startswith("whether the host uses netdev eth0 cannot be read ([Errno 13] "), out
        assert "proc/1/ns/net: Permission denied" in out.stdout
    finally:
        init.kill()
        init.wait()


# --- the netdev step -----------------------------------------------------------------------
def netdev_driver(tmp_path, nets, **settings) -> Driver:  # noqa: F811
    s = settings_for(str(tmp_path), root=profile_root("server-2s-gpu-nic"), **settings)
    inv = scan(s.root)
    d = Driver(s, lambda: inv)
    next(st for st in d.steps if isinstance(st, NetdevStep)).host_netns = lambda: nets.host
    return d


def test_a_netdev_with_the_hosts_address_is_not_moved_unless_node_and_claim_allow_it(tmp_path, ifname_nets):  # noqa: F811
    nets = ifname_nets
    ip(nets, "addr", "add", "10.9.8.7/24", "dev", IFNAME)
    err = netdev_driver(tmp_path / "a", nets).prepare_claims([nic_claim()])[CLAIM].error
    assert (f"request 'net1': nic-0000-3c-00-0: the host uses it: netdev {IFNAME} ({BDF}): it holds the host's "
            "address 10.9.8.7/24; not moved into a pod, which would cut the node off that network (the node's "
            "setting allow_host_in_use_nics is off") in err
    # the claim alone cannot allow it; nor the node alone
    assert "allow_host_in_use_nics is off" in netdev_driver(tmp_path / "b", nets).prepare_claims(
        [nic_claim({"allowHostInUse": True})])[CLAIM].error
    d = netdev_driver(tmp_path / "c", nets, allow_host_in_use_nics=True)
    assert "the claim's NicConfig does not say allowHostInUse: true" in d.prepare_claims([nic_claim()])[CLAIM].error
    assert CLAIM not in Checkpoint.load(d.checkpoint_path).claims  # nothing recorded, nothing moves
    assert where(nets, IFNAME) == (True, False)
    # both: prepared (the record keeps the claim's say), and the hook moves it
    assert d.prepare_claims([nic_claim({"allowHostInUse": True})])[CLAIM].error is None
    assert Checkpoint.load(d.checkpoint_path).claims[CLAIM]["netdevs"][0]["allowHostInUse"] is True
    run(NetdevMover(d.settings.plugin_dir, host_netns=nets.host, settings=d.settings).pod_started(pod(nets)))
    assert where(nets, IFNAME) == (False, True)
    assert d.unprepare_claims([ClaimRef("default", "nic", CLAIM)]) == {CLAIM: None}


def test_a_netdev_the_host_took_after_prepare_stays_until_the_host_lets_it_go(tmp_path, ifname_nets):  # noqa: F811
    """Prepare found the netdev idle; before the pod's sandbox the host gave it an address (a
    network manager configuring a netdev back from a pod, DHCP): the move checks again, the
    sandbox fails with why and the netdev stays with its address; the runtime's next sandbox of
    the pod gets it once the host no longer uses it."""
    nets = ifname_nets
    d = netdev_driver(tmp_path, nets)
    assert d.prepare_claims([nic_claim()])[CLAIM].error is None
    ip(nets, "addr", "add", "10.9.8.7/24", "dev", IFNAME)
    mover = NetdevMover(d.settings.plugin_dir, host_netns=nets.host, settings=d.settings)
    with pytest.raises(NetdevError) as refused:
        run(mover.pod_started(pod(nets)))
    assert str(refused.value) == (
        f"pod ns/app: claim {CLAIM}: nic-0000-3c-00-0: the host uses it: netdev {IFNAME} ({BDF}): it holds the "
        "host's address 10.9.8.7/24; not moved into a pod, which would cut the node off that network (the node's "
        "setting allow_host_in_use_nics is off; docs/networking.md)")
    assert where(nets, IFNAME) == (True, False)
    assert [m.get("state", "planned") for m in Checkpoint.load(d.checkpoint_path).claims[CLAIM]["netdevs"]] == ["planned"]
    ip(nets, "addr", "flush", "dev", IFNAME)
    run(mover.pod_started(pod(nets, sandbox="sb2")))
    assert where(nets, IFNAME) == (False, True)
    assert d.unprepare_claims([ClaimRef("default", "nic", CLAIM)]) == {CLAIM: None}


def test_a_move_of_a_claim_that_allowed_it_needs_the_node_to_allow_it_at_the_move(tmp_path, ifname_nets):  # noqa: F811
    """The claim said allowHostInUse on a node that allowed it; the agent now runs with the
    setting off (changed, restarted): the node's say at the move is the one that counts."""
    nets = ifname_nets
    d = netdev_driver(tmp_path, nets, allow_host_in_use_nics=True)
    assert d.prepare_claims([nic_claim({"allowHostInUse": True})])[CLAIM].error is None
    ip(nets, "link", "add", "sdtbr0", "type", "bridge")
    ip(nets, "link", "set", IFNAME, "master", "sdtbr0")
    off = d.settings.replace(allow_host_in_use_nics=False)
    with pytest.raises(NetdevError, match=r"it is a port of bridge sdtbr0; .*allow_host_in_use_nics is off"):
        run(NetdevMover(off.plugin_dir, host_netns=nets.host, settings=off).pod_started(pod(nets)))
    assert where(nets, IFNAME) == (True, False)
    run(NetdevMover(d.settings.plugin_dir, host_netns=nets.host, settings=d.settings).pod_started(pod(nets, sandbox="sb2")))
    assert where(nets, IFNAME) == (False, True)
    assert d.unprepare_claims([ClaimRef("default", "nic", CLAIM)]) == {CLAIM: None}


def test_a_bridge_port_is_refused_and_without_nri_nothing_moves_so_nothing_is_refused(tmp_path, ifname_nets):  # noqa: F811
    nets = ifname_nets
    ip(nets, "link", "add", "sdtbr0", "type", "bridge")
    ip(nets, "link", "set", IFNAME, "master", "sdtbr0")
    err = netdev_driver(tmp_path / "a", nets).prepare_claims([nic_claim()])[CLAIM].error
    assert f"netdev {IFNAME} ({BDF}): it is a port of bridge sdtbr0" in err
    assert netdev_driver(tmp_path / "b", nets, nri_socket="").prepare_claims([nic_claim()])[CLAIM].error is None


def test_an_idle_netdev_is_moved_as_before(tmp_path, ifname_nets):  # noqa: F811
    d = netdev_driver(tmp_path, ifname_nets)
    assert d.prepare_claims([nic_claim()])[CLAIM].error is None


def test_a_move_is_checked_in_the_namespace_it_takes_the_netdev_from(tmp_path, ifname_nets, monkeypatch):  # noqa: F811
    """An agent that may not open the init's namespace (systemd without CAP_SYS_PTRACE, a sandbox
    whose PID 1 is another user namespace's) moves netdevs from and to its own: the check reads
    that one, so an idle netdev there is prepared and one with an address there is refused."""
    monkeypatch.setattr(netmove, "host_netns_problem", lambda root: f"{root}/proc/1/ns/net: Permission denied")
    assert netdev_driver(tmp_path / "a", ifname_nets).prepare_claims([nic_claim()])[CLAIM].error is None
    ip(ifname_nets, "addr", "add", "10.9.8.7/24", "dev", IFNAME)
    assert "it holds the host's address 10.9.8.7/24" in netdev_driver(tmp_path / "b", ifname_nets).prepare_claims(
        [nic_claim()])[CLAIM].error


# --- VFIO --------------------------------------------------------------------------------
@pytest.mark.parametrize("allow", [(False, False), (True, False), (False, True), (True, True)])
def test_vfio_refuses_a_function_whose_netdev_the_host_uses(node, nets, allow):  # noqa: F811
    """The sriov-nic fixture's VF has the netdev enp6s0f0v0: the test's host namespace has a link
    of that name with the host's address (its bus device unknown, as a virtual link's)."""
    s, sim, state, _ = node
    node_allows, claim_allows = allow
    ip(nets, "link", "set", nets.nic, "name", "enp6s0f0v0")
    ip(nets, "addr", "add", "10.9.8.7/24", "dev", "enp6s0f0v0")
    d = Driver(s.replace(allow_host_in_use_nics=node_allows), lambda: state["inv"])
    d.kernel.wait = 3.0
    next(st for st in d.steps if isinstance(st, VfioStep)).host_netns = lambda: nets.host
    params = {"apiVersion": "sysdra.io/v1alpha1", "kind": "VfioConfig", "allowHostInUse": claim_allows}
    before = list(sim.log)
    err = d.prepare_claims([vfio_claim("vm", [VF], UID, params=params)])[UID].error
    if node_allows and claim_allows:
        assert err is None and sim.driver(VF_BDF) == "vfio-pci"
        return
    assert f"{VF_BDF}: the host uses it: netdev enp6s0f0v0 ({VF_BDF}): it holds the host's address 10.9.8.7/24; " \
           "not bound to vfio-pci" in err
    assert ("does not say allowHostInUse" if node_allows else "allow_host_in_use_nics is off") in err
    assert sim.log == before and sim.driver(VF_BDF) == "mlx5_core" and UID not in d.checkpoint.claims
