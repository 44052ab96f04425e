"""Addresses for a claimed NIC's netdev from an IPAM pool of the node (agent/prepare/ipam.py): the
real CNI ``host-local`` plugin (Debian's containernetworking-plugins, as a node has it in
/opt/cni/bin) leases an address per pod sandbox when the NRI hook moves the netdev, the lease is in
the record before it is used, the pod gets it with the pool's routes and its metadata says it, and
it is given back when the netdev comes back (or the claim goes while it is away). A crash between
the lease and its record, or after it, is finished at the next synchronization without a second
lease or a lost one. On the real kernel with the namespaces and veth of tests/test_nri_netdev.py.
Root only."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time

import pytest

from agent.kubeletplugin.types import ClaimRef
from agent.nri.netdev import NetdevError, NetdevMover
from agent.prepare.checkpoint import Checkpoint
from agent.prepare.driver import Driver
from agent.prepare.ipam import Ipam
from agent.prepare.metadata import layout
from agent.prepare.steps.netdev import NetdevStep
from agent.settings import ConfigError
from discovery.inventory import scan
from tests.conftest import profile_root, require_root
from tests.kubelet_standin import settings_for
from tests.test_nri_netdev import CLAIM, IFNAME, Crash, ifname_nets, ip_json, nets, nic_claim, pod, run, where  # noqa: F401

CNI_BIN = "/usr/lib/cni"  # Debian's containernetworking-plugins (the CI installs it)
POOL = {"type": "host-local", "ranges": [[{"subnet": "10.77.0.0/24", "rangeStart": "10.77.0.10", "rangeEnd": "10.77.0.11",
                                            "gateway": "10.77.0.1"}]], "routes": [{"dst": "0.0.0.0/0"}]}  # fmt: skip


@pytest.fixture
def root(tmp_path) -> str:
    """A copy of the NIC's fixture node whose /opt/cni/bin is this machine's CNI plugins."""
    require_root()
    if not os.access(os.path.join(CNI_BIN, "host-local"), os.X_OK):
        pytest.fail(f"{CNI_BIN}/host-local is missing: install containernetworking-plugins (.ci/run does)")
    r = tmp_path / "root"
    shutil.copytree(profile_root("server-2s-gpu-nic"), r, symlinks=True)
    os.makedirs(r / "opt" / "cni")
    os.symlink(CNI_BIN, r / "opt" / "cni" / "bin")
    return str(r)


def driver(tmp_path, root: str, nets, **settings) -> Driver:  # noqa: F811
    s = settings_for(str(tmp_path), root=root, nic_ipam=settings.pop("pools", {"data": POOL}), **settings)
    inv = scan(root)
    d = Driver(s, lambda: inv)
    next(st for st in d.steps if isinstance(st, NetdevStep)).host_netns = lambda: nets.host
    return d


def leases(d: Driver) -> list[str]:
    """The addresses host-local holds for the pool (its files under <plugin dir>/ipam)."""
    store = os.path.join(d.settings.plugin_dir, "ipam", "sysdra-data")
    return sorted(n for n in os.listdir(store) if n[0].isdigit()) if os.path.isdir(store) else []


def record(d: Driver) -> dict:
    (rec,) = Checkpoint.load(d.checkpoint_path).claims[CLAIM]["netdevs"]
    return rec


def test_each_sandbox_gets_a_lease_that_goes_when_the_netdev_comes_back(tmp_path, root, ifname_nets):
    nets = ifname_nets
    d = driver(tmp_path, root, nets)
    assert d.prepare_claims([nic_claim({"ipamPool": "data", "addresses": ["192.0.2.5/24"]})])[CLAIM].error is None
    assert record(d)["ipamPool"] == "data" and leases(d) == []  # nothing leased before a sandbox exists
    mover = NetdevMover(d.settings.plugin_dir, host_netns=nets.host, settings=d.settings)
    run(mover.pod_started(pod(nets)))
    assert where(nets, IFNAME) == (False, True) and leases(d) == ["10.77.0.10"]
    rec = record(d)
    assert rec["leased"] == ["10.77.0.10/24"] and rec["leasedRoutes"] == [{"destination": "default", "gateway": "10.77.0.1"}]
    addrs = {a["local"] + "/" + str(a["prefixlen"]) for a in ip_json(nets, "addr", "show", "net1")[0]["addr_info"]}
    assert {"192.0.2.5/24", "10.77.0.10/24"} <= addrs  # the config's and the pool's
    assert ip_json(nets, "route", "show", "default")[0]["gateway"] == "10.77.0.1"
    with open(layout.host_file(d.settings.plugin_dir, "default", "nic", "net1")) as f:
        meta = json.JSONDecoder().raw_decode(f.read())[0]
    (dev,) = [dev for r in meta["requests"] for dev in r["devices"]]
    assert dev["networkData"]["ips"] == ["192.0.2.5/24", "10.77.0.10/24"]
    run(mover.pod_removed(pod(nets)))
    assert where(nets, IFNAME) == (True, False) and leases(d) == []
    assert "leased" not in record(d) and "sandbox" not in record(d)
    run(mover.pod_started(pod(nets, sandbox="sb2")))  # the pod's next sandbox: a lease of its own
    (held,) = leases(d)  # host-local goes round the range: the next address
    assert record(d)["leased"] == [f"{held}/24"] and record(d)["sandbox"] == "sb2"
    # unprepared while the netdev is in the pod (no StopPodSandbox came): the step gives the lease back
    assert d.unprepare_claims([ClaimRef("default", "nic", CLAIM)]) == {CLAIM: None}
    assert where(nets, IFNAME) == (True, False) and leases(d) == []


@pytest.mark.parametrize("now", ["removed", "moved"])
def test_a_lease_goes_back_with_the_configuration_it_was_asked_with(tmp_path, root, ifname_nets, now):
    """The admin removes the pool, or gives it another dataDir, while a sandbox holds a lease of it
    (the agent restarted with the new config): the DEL gets the ADD's configuration, as CNI asks,
    and host-local frees the address where it leased it. New sandboxes get the pool as it is then."""
    nets = ifname_nets
    d = driver(tmp_path, root, nets)
    assert d.prepare_claims([nic_claim({"ipamPool": "data"})])[CLAIM].error is None
    run(NetdevMover(d.settings.plugin_dir, host_netns=nets.host, settings=d.settings).pod_started(pod(nets)))
    assert leases(d) == ["10.77.0.10"]
    assert record(d)["ipamConfig"] == {**POOL, "dataDir": os.path.join(d.settings.plugin_dir, "ipam")}
    elsewhere = str(tmp_path / "elsewhere")
    pools = {} if now == "removed" else {"data": {**POOL, "dataDir": elsewhere}}
    restarted = d.settings.replace(nic_ipam=pools)
    run(NetdevMover(d.settings.plugin_dir, host_netns=nets.host, settings=restarted).pod_removed(pod(nets)))
    assert where(nets, IFNAME) == (True, False) and leases(d) == []
    assert "ipamConfig" not in record(d) and "leased" not in record(d)
    if now == "moved":  # the next sandbox: the pool as it is now
        run(NetdevMover(d.settings.plugin_dir, host_netns=nets.host, settings=restarted).pod_started(pod(nets, sandbox="sb2")))
        assert record(d)["ipamConfig"]["dataDir"] == elsewhere and os.listdir(os.path.join(elsewhere, "sysdra-data"))
    else:  # a removed pool leases no more: the sandbox fails, the netdev stays
        with pytest.raises(NetdevError, match="IPAM pool 'data' is not configured"):
            run(NetdevMover(d.settings.plugin_dir, host_netns=nets.host, settings=restarted).pod_started(pod(nets, sandbox="sb2")))
        assert where(nets, IFNAME) == (True, False)


def test_a_claim_unprepared_after_its_pool_was_removed_gives_the_lease_back(tmp_path, root, ifname_nets):
    nets = ifname_nets
    d = driver(tmp_path, root, nets)
    assert d.prepare_claims([nic_claim({"ipamPool": "data"})])[CLAIM].error is None
    run(NetdevMover(d.settings.plugin_dir, host_netns=nets.host, settings=d.settings).pod_started(pod(nets)))
    assert leases(d) == ["10.77.0.10"]
    restarted = driver(tmp_path, root, nets, pools={})  # the agent restarted without the pool
    assert restarted.unprepare_claims([ClaimRef("default", "nic", CLAIM)]) == {CLAIM: None}
    assert where(nets, IFNAME) == (True, False) and leases(d) == []


def test_a_pool_the_node_does_not_have_fails_the_claim(tmp_path, root, ifname_nets):
    d = driver(tmp_path, root, ifname_nets)
    err = d.prepare_claims([nic_claim({"ipamPool": "storage"})])[CLAIM].error
    assert "request 'net1': NicConfig ipamPool 'storage' is not one of this node's IPAM pools (data: nic_ipam)" in err
    assert CLAIM not in Checkpoint.load(d.checkpoint_path).claims


def test_a_plugin_that_gives_no_lease_fails_the_sandbox_and_the_netdev_stays(tmp_path, root, ifname_nets):
    nets = ifname_nets
    full = {**POOL, "ranges": [[{"subnet": "10.77.0.0/24", "rangeStart": "10.77.0.10", "rangeEnd": "10.77.0.10"}]]}
    d = driver(tmp_path, root, nets, pools={"data": full})
    assert d.prepare_claims([nic_claim({"ipamPool": "data"})])[CLAIM].error is None
    taken = Ipam.of(d.settings)
    taken.lease("data", "someone-else", nets.pod, "eth9")  # the range's one address, another sandbox's
    mover = NetdevMover(d.settings.plugin_dir, host_netns=nets.host, settings=d.settings)
    with pytest.raises(NetdevError, match=r"pod ns/app: moving its netdevs failed: IPAM pool 'data': ADD failed: "
                                          r"failed to allocate for range 0: no IP addresses available in range set"):
        run(mover.pod_started(pod(nets)))
    assert where(nets, IFNAME) == (True, False) and leases(d) == ["10.77.0.10"]
    assert record(d).get("state", "planned") == "planned" and "leased" not in record(d)
    taken.release("data", "someone-else", nets.pod, "eth9")
    run(mover.pod_started(pod(nets, sandbox="sb2")))  # the runtime's next sandbox
    assert where(nets, IFNAME) == (False, True) and record(d)["leased"] == ["10.77.0.10/24"]
    assert d.unprepare_claims([ClaimRef("default", "nic", CLAIM)]) == {CLAIM: None}
    assert leases(d) == []


@pytest.mark.parametrize("point,running", [("netdev:leased", True), ("netdev:leased", False),
                                           ("netdev:moved", True), ("netdev:moved", False)])
def test_a_crash_around_the_lease_is_finished_without_a_second_or_a_lost_one(tmp_path, root, ifname_nets, point, running):
    """Killed after the plugin leased, before the record says so (the lease is unrecorded), or
    after the move: the next synchronization completes the move into the running sandbox with one
    lease, or gives the netdev and the lease back."""
    nets = ifname_nets
    d = driver(tmp_path, root, nets)
    assert d.prepare_claims([nic_claim({"ipamPool": "data"})])[CLAIM].error is None

    def crash(at):
        if at == point:
            raise Crash(at)

    with pytest.raises(Crash):
        run(NetdevMover(d.settings.plugin_dir, host_netns=nets.host, settings=d.settings, fault=crash).pod_started(pod(nets)))
    assert leases(d) == ["10.77.0.10"]
    again = NetdevMover(d.settings.plugin_dir, host_netns=nets.host, settings=d.settings)
    run(again.synchronized([pod(nets)] if running else []))
    if running:
        (held,) = leases(d)  # one: an unrecorded lease was given back before the next
        assert where(nets, IFNAME) == (False, True)
        assert record(d)["leased"] == [f"{held}/24"] and record(d)["state"] == "in-pod"
    else:
        assert where(nets, IFNAME) == (True, False) and leases(d) == []
    assert d.unprepare_claims([ClaimRef("default", "nic", CLAIM)]) == {CLAIM: None}
    assert leases(d) == []


def unfinished(tmp_path, root, nets):  # noqa: F811
    """Killed once the record said ``moving``; at the next synchronization the pool has no address
    left (another sandbox holds the range's one): the move into the running sandbox cannot be
    finished. -> the driver, the pool (its one lease held elsewhere), the mover synchronized."""
    one = {**POOL, "ranges": [[{"subnet": "10.77.0.0/24", "rangeStart": "10.77.0.10", "rangeEnd": "10.77.0.10"}]]}
    d = driver(tmp_path, root, nets, pools={"data": one})
    assert d.prepare_claims([nic_claim({"ipamPool": "data"})])[CLAIM].error is None

    def crash(at):
        if at == "netdev:recorded":
            raise Crash(at)

    with pytest.raises(Crash):
        run(NetdevMover(d.settings.plugin_dir, host_netns=nets.host, settings=d.settings, fault=crash).pod_started(pod(nets)))
    taken = Ipam.of(d.settings)
    taken.lease("data", "someone-else", nets.pod, "eth9")
    again = NetdevMover(d.settings.plugin_dir, host_netns=nets.host, settings=d.settings)
    run(again.synchronized([pod(nets)]))
    return d, taken, again


def test_a_move_that_cannot_be_finished_at_synchronization_holds_the_pods_containers(tmp_path, root, ifname_nets):
    """The pod's containers wait for it, as a pod's whose sandbox started unseen; before, its
    record stayed ``moving`` and they were created at once, without the lease, for good."""
    d, taken, again = unfinished(tmp_path, root, nets := ifname_nets)
    with pytest.raises(NetdevError, match="no IP addresses available"):
        run(again.container_created(pod(nets), "app"))
    taken.release("data", "someone-else", nets.pod, "eth9")
    run(again.container_created(pod(nets), "app"))  # the kubelet's next try
    assert where(nets, IFNAME) == (False, True)
    assert record(d)["state"] == "in-pod" and record(d)["leased"] == ["10.77.0.10/24"] and leases(d) == ["10.77.0.10"]
    assert d.unprepare_claims([ClaimRef("default", "nic", CLAIM)]) == {CLAIM: None}
    assert leases(d) == []


def test_such_a_move_is_finished_by_the_look_for_the_containers_that_run(tmp_path, root, ifname_nets):
    """Containers created before (the agent away) wait for no event: the look every 10 s tries the
    move again. Before, the record stayed ``moving`` and the pod without its lease for good."""
    d, taken, again = unfinished(tmp_path, root, nets := ifname_nets)
    run(again.reconcile())  # still no address
    assert record(d)["state"] == "moving"
    taken.release("data", "someone-else", nets.pod, "eth9")
    run(again.reconcile())
    assert record(d)["state"] == "in-pod" and record(d)["leased"] == ["10.77.0.10/24"] and leases(d) == ["10.77.0.10"]


def test_a_pool_is_the_admins_and_checked(tmp_path):
    for bad, said in (({"x": {"ranges": []}}, "needs a 'type'"), ({"x": {"type": "../../bin/sh"}}, "needs a 'type'"),
                      ({"Data": POOL}, "not a DNS label")):
        with pytest.raises(ConfigError, match=said):
            settings_for(str(tmp_path), nic_ipam=bad)
    # the configuration a move recorded is input too (a checkpoint's): the same checks
    from pydantic import ValidationError

    from agent.prepare.records import NetdevMove

    for bad in ({"type": "../../bin/sh"}, {"ranges": []}, {**POOL, "pad": "x" * (20 << 10)}):
        with pytest.raises(ValidationError, match="IPAM configuration"):
            NetdevMove.model_validate({"device": "nic-a", "request": "net1", "host": "eth1", "pod": "net1",
                                       "ipamPool": "data", "ipamConfig": bad})  # fmt: skip
    from agent.settings import Settings

    env = Settings.of({"node_name": "n", "nic_ipam": '{data: {type: host-local, ranges: [[{subnet: 10.77.0.0/24}]]}}'})
    assert env.nic_ipam["data"]["type"] == "host-local"  # SYSDRA_NIC_IPAM as YAML text


@pytest.mark.parametrize("result", ["[]", '"10.77.0.10/24"', "null", "7", "[" * 50000])  # (nested too deep to parse)
def test_a_plugin_result_that_is_not_an_object_is_the_plugins_error_and_its_lease_goes_back(tmp_path, result):
    """A CNI result is a JSON object; whatever else the plugin prints is its error (IpamError:
    the sandbox fails with it, the move is undone) and what its ADD may have leased is given back."""
    from agent.prepare.ipam import IpamError

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    plugin = bin_dir / "odd"
    plugin.write_text(f"#!/bin/sh\necho $CNI_COMMAND >> {log}\n[ $CNI_COMMAND = ADD ] && echo '{result}'\nexit 0\n")
    plugin.chmod(0o755)
    ipam = Ipam({"p": {"type": "odd"}}, str(bin_dir), str(tmp_path / "data"))
    with pytest.raises(IpamError, match="not one this agent can use"):
        ipam.lease("p", "sb1", "/run/netns/x", "net1")
    assert log.read_text().split() == ["DEL", "ADD", "DEL"]


def test_a_plugins_error_nested_too_deep_is_told_as_it_printed_it(tmp_path):
    from agent.prepare.ipam import IpamError

    (tmp_path / "bin").mkdir()
    plugin = tmp_path / "bin" / "odd"
    plugin.write_text("#!/bin/sh\n[ $CNI_COMMAND = DEL ] && exit 0\necho '%s'\nexit 1\n" % ("[" * 50000))
    plugin.chmod(0o755)
    with pytest.raises(IpamError, match=r"ADD failed: \[\[\[\["):
        Ipam({"p": {"type": "odd"}}, str(tmp_path / "bin"), str(tmp_path / "data")).lease("p", "sb1", "/run/netns/x", "net1")


def test_the_pods_network_data_names_each_address_once_and_at_most_sixteen():
    """A static address the lease repeats is one IP; past 16 (the config's 16 and a lease), status
    and metadata take the first 16 rather than none (the check would refuse the whole pod view)."""
    from agent.nri.podmeta import network_data
    from agent.prepare.records import NetdevMove

    static = [f"10.9.0.{i}/24" for i in range(1, 17)]
    move = NetdevMove(device="nic-0000-3b-00-0", request="r", host="eth1", pod="net1", mac="aa:00:00:00:00:01",
                      addresses=static[:2], leased=[static[1], "10.9.1.7/24"])
    assert network_data(move).ips == [static[0], static[1], "10.9.1.7/24"]
    net = network_data(move.changed(addresses=static, leased=["10.9.1.7/24"]))
    net.check()
    assert net.ips == static and net.interface_name == "net1"


@pytest.fixture
def dhcp_server(ifname_nets):
    """busybox's udhcpd on the veth peer of the test's netdev (the host's side of its wire), and
    CNI's dhcp daemon (the dhcp plugin's other half) on a socket of its own."""
    require_root()
    busybox = shutil.which("busybox")
    if busybox is None or not os.access(os.path.join(CNI_BIN, "dhcp"), os.X_OK):
        pytest.fail(f"busybox (udhcpd) and {CNI_BIN}/dhcp are needed")
    nets = ifname_nets
    host, peer = nets.names["host"], "pe" + nets.names["host"].split("-")[1]
    subprocess.run(["ip", "-n", host, "addr", "add", "10.78.0.1/24", "dev", peer], check=True)
    subprocess.run(["ip", "-n", host, "link", "set", peer, "up"], check=True)
    work = tempfile.mkdtemp(prefix="sdhcp", dir="/tmp")  # a unix socket's path is short
    conf = os.path.join(work, "udhcpd.conf")
    with open(conf, "w") as f:
        f.write(f"start 10.78.0.50\nend 10.78.0.60\ninterface {peer}\nlease_file {work}/leases\npidfile {work}/pid\n"
                "option subnet 255.255.255.0\noption router 10.78.0.1\noption lease 600\n")
    open(os.path.join(work, "leases"), "w").close()
    sock = os.path.join(work, "dhcp.sock")
    procs = [subprocess.Popen(["ip", "netns", "exec", host, busybox, "udhcpd", "-f", conf], stderr=subprocess.DEVNULL),
             subprocess.Popen([os.path.join(CNI_BIN, "dhcp"), "daemon", "-socketpath", sock], stderr=subprocess.DEVNULL)]
    try:
        for _ in range(100):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        yield {"type": "dhcp", "daemonSocketPath": sock}
    finally:
        for p in procs:
            p.terminate()
            p.wait(5)
        shutil.rmtree(work, ignore_errors=True)


def test_a_dhcp_pool_leases_on_the_netdev_where_cni_has_it(tmp_path, root, ifname_nets, dhcp_server):
    """The docs' dhcp pool: CNI's dhcp plugin looks the interface up as CNI_IFNAME in CNI_NETNS at
    its ADD (as a main plugin runs IPAM: the interface is in the container first; host-device,
    which moves a host's NIC, moves it before its IPAM ADD) and asks the DHCP server over it. The
    lease comes from the server on the netdev's wire, goes into the record and the pod, and goes
    back at the DEL."""
    nets = ifname_nets
    d = driver(tmp_path, root, nets, pools={"lan": dhcp_server})
    assert d.prepare_claims([nic_claim({"ipamPool": "lan"})])[CLAIM].error is None
    mover = NetdevMover(d.settings.plugin_dir, host_netns=nets.host, settings=d.settings)
    run(mover.pod_started(pod(nets)))
    assert where(nets, IFNAME) == (False, True)
    (leased,) = record(d)["leased"]
    assert 50 <= int(leased.removesuffix("/24").split(".")[3]) <= 60  # udhcpd's range
    addrs = {a["local"] + "/" + str(a["prefixlen"]) for a in ip_json(nets, "addr", "show", "net1")[0]["addr_info"]}
    assert leased in addrs
    assert ip_json(nets, "route", "show", "default")[0]["gateway"] == "10.78.0.1"
    run(mover.pod_removed(pod(nets)))
    assert where(nets, IFNAME) == (True, False) and "leased" not in record(d)


# what whereabouts (v0.8.0) does with CNI_ARGS: its pod is K8S_POD_NAMESPACE/K8S_POD_NAME (pkg/config/config.go),
# without which an allocation fails ("IPAM client initialization error: no pod name", pkg/storage/kubernetes/ipam.go)
# and a deallocation does nothing, successfully (cmd/whereabouts.go cmdDel ignores IPManagement's error)
WHEREABOUTS = """#!/bin/sh
echo "$CNI_COMMAND $CNI_CONTAINERID $CNI_IFNAME $CNI_ARGS" >> {calls}
case ";$CNI_ARGS;" in *";K8S_POD_NAME="[!\\;]*) pod=yes;; *) pod=;; esac
case "$CNI_COMMAND" in
ADD) [ -n "$pod" ] || {{ echo '{{"code": 999, "msg": "IPAM client initialization error: no pod name"}}'; exit 1; }}
     touch {held}/$CNI_CONTAINERID
     echo '{{"cniVersion": "1.0.0", "ips": [{{"address": "10.79.0.7/24", "gateway": "10.79.0.1"}}]}}';;
DEL) [ -z "$pod" ] || rm -f {held}/$CNI_CONTAINERID;;
esac
exit 0
"""


def test_a_whereabouts_pool_gets_the_pod_in_cni_args_at_the_add_and_every_del(tmp_path, ifname_nets):
    """The docs' whereabouts pool: the runtime's CNI_ARGS name the sandbox's pod (IgnoreUnknown=1,
    K8S_POD_NAMESPACE, K8S_POD_NAME, K8S_POD_INFRA_CONTAINER_ID), which whereabouts allocates for
    and deallocates with; the DEL gets the ADD's, as CNI asks, also from the record after a restart
    and at an unprepare. Without them no lease is made, and a DEL frees nothing."""
    nets = ifname_nets
    r = tmp_path / "root"
    shutil.copytree(profile_root("server-2s-gpu-nic"), r, symlinks=True)
    bin_dir, held, calls = r / "opt" / "cni" / "bin", tmp_path / "held", tmp_path / "calls"
    bin_dir.mkdir(parents=True)
    held.mkdir()
    (bin_dir / "whereabouts").write_text(WHEREABOUTS.format(calls=calls, held=held))
    (bin_dir / "whereabouts").chmod(0o755)
    pools = {"cluster": {"type": "whereabouts", "range": "10.79.0.0/24"}}
    d = driver(tmp_path, str(r), nets, pools=pools)
    assert d.prepare_claims([nic_claim({"ipamPool": "cluster"})])[CLAIM].error is None
    run(NetdevMover(d.settings.plugin_dir, host_netns=nets.host, settings=d.settings).pod_started(pod(nets)))
    assert record(d)["leased"] == ["10.79.0.7/24"] and os.listdir(held) == ["sb1"]
    # the agent restarted: the DEL's pod is the record's
    run(NetdevMover(d.settings.plugin_dir, host_netns=nets.host, settings=d.settings).pod_removed(pod(nets)))
    assert where(nets, IFNAME) == (True, False) and os.listdir(held) == []
    run(NetdevMover(d.settings.plugin_dir, host_netns=nets.host, settings=d.settings).pod_started(pod(nets, sandbox="sb2")))
    assert os.listdir(held) == ["sb2"]
    assert driver(tmp_path, str(r), nets, pools=pools).unprepare_claims([ClaimRef("default", "nic", CLAIM)]) == {CLAIM: None}
    assert os.listdir(held) == []
    args = "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=app;K8S_POD_INFRA_CONTAINER_ID="
    assert calls.read_text().splitlines() == [f"{c} {sb} net1 {args}{sb}" for sb in ("sb1", "sb2") for c in ("DEL", "ADD", "DEL")]
