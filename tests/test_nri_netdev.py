"""A claim's netdev into its pod and back (agent/nri/netdev.py, prepare/steps/netdev.py), on the
real kernel: two network namespaces made by the test stand for the host and the pod, a veth end
for the NIC. The records are the claim's checkpoint entry (the step protocol's ``netdevs``). A
crash (an exception raised at each fault point: nothing after it runs) leaves records that the next
synchronization finishes: back to the host, or completed into a pod still running. Root only.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from types import SimpleNamespace

import pytest

from agent.kubeletplugin.types import ClaimRef
from agent.nri.netdev import NetdevError, NetdevMover
from agent.nri.plugin import Pod
from agent.prepare import rtnl
from agent.prepare.checkpoint import Checkpoint
from agent.prepare.checkpoint_format import COMPLETED
from agent.prepare.driver import Driver
from agent.prepare.metadata import layout
from agent.prepare.netdevs import group_consumers
from agent.prepare.steps.netdev import NetdevStep
from discovery.inventory import scan
from tests.conftest import REPO, profile_root, require_root, require_tool
from tests.kubelet_standin import claim, settings_for

CLAIM = "0b0c7c8e-1111-4222-8333-444455556666"
POD_UID = "9d3f1c2a-aaaa-4bbb-8ccc-dddddddddddd"
POINTS = ("netdev:recorded", "netdev:moved", "netdev:returning", "netdev:returned")
NIC, IFNAME = "nic-0000-3c-00-0", "enp60s0np0"  # server-2s-gpu-nic's NIC and its netdev


class Crash(BaseException):
    """Stands for SIGKILL: not an Exception, so no handler of the mover catches it."""


@pytest.fixture
def nets():
    require_root()
    require_tool("ip")
    tag = uuid.uuid4().hex[:6]
    names = {"host": f"sdt-{tag}-h", "pod": f"sdt-{tag}-p"}
    for n in names.values():
        subprocess.run(["ip", "netns", "add", n], check=True)
    nic = f"nic{tag}"
    subprocess.run(["ip", "-n", names["host"], "link", "add", nic, "type", "veth", "peer", "name", f"pe{tag}"], check=True)
    yield SimpleNamespace(host=f"/run/netns/{names['host']}", pod=f"/run/netns/{names['pod']}", nic=nic, names=names)
    for n in names.values():
        subprocess.run(["ip", "netns", "del", n], check=False)


def write_checkpoint(path, nic: str, pods=(POD_UID,), **move):
    cp = Checkpoint(str(path))
    cp.claims = {CLAIM: {"state": COMPLETED, "namespace": "ns", "name": "c", "bootID": "b", "allocation": "a",
                         "devices": [], "cdiSpec": None, "metadata": None, "pods": list(pods),
                         "netdevs": [{"device": "nic-0", "request": "net1", "host": nic, "pod": "net1", **move}]}}
    cp.save()


def records(tmp_path) -> list[dict]:
    return Checkpoint.load(str(tmp_path / "checkpoint.json")).claims[CLAIM]["netdevs"]


def mover(tmp_path, nets, fault=lambda point: None, **kw) -> NetdevMover:
    return NetdevMover(str(tmp_path), host_netns=nets.host, fault=fault, **kw)


def pod(nets, netns="pod", sandbox="sb1") -> Pod:
    return Pod(sandbox, "app", "ns", POD_UID, getattr(nets, netns) if netns else None)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def where(nets, host_name=None) -> tuple[bool, bool]:
    return rtnl.has_link(nets.host, host_name or nets.nic), rtnl.has_link(nets.pod, "net1")


def ip_json(nets, *args):
    out = subprocess.run(["ip", "-n", nets.names["pod"], "-j", *args], capture_output=True, check=True)
    return json.loads(out.stdout)


def test_the_netdev_goes_into_the_pod_up_under_its_name_and_comes_back(tmp_path, nets):
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    m = mover(tmp_path, nets)
    run(m.synchronized([]))
    run(m.pod_started(pod(nets)))
    assert where(nets) == (False, True)
    assert "UP" in ip_json(nets, "link", "show", "net1")[0]["flags"]
    (rec,) = records(tmp_path)
    assert rec["state"] == "in-pod" and rec["sandbox"] == "sb1" and rec["netns"] == nets.pod and rec["mac"]
    run(m.pod_started(pod(nets)))  # a repeated event changes nothing
    run(m.pod_stopped(pod(nets)))
    assert where(nets) == (True, False)
    run(m.pod_removed(pod(nets)))
    assert records(tmp_path) == [{"device": "nic-0", "request": "net1", "host": nets.nic, "pod": "net1"}]


def test_mtu_addresses_and_routes_are_set_in_the_pod(tmp_path, nets):
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic, mtu=1400, addresses=["192.0.2.5/24", "2001:db8::5/64"],
                     routes=[{"destination": "default", "gateway": "192.0.2.1"}, {"destination": "198.51.100.0/24"},
                             {"destination": "2001:db8:1::/48", "gateway": "2001:db8::1"}])
    run(mover(tmp_path, nets).pod_started(pod(nets)))
    (link,) = ip_json(nets, "addr", "show", "net1")
    assert link["mtu"] == 1400
    assert {f"{a['local']}/{a['prefixlen']}" for a in link["addr_info"] if a.get("scope") == "global"} == {
        "192.0.2.5/24", "2001:db8::5/64"}
    v4 = {(r["dst"], r.get("gateway")) for r in ip_json(nets, "route", "show", "dev", "net1")}
    assert {("default", "192.0.2.1"), ("198.51.100.0/24", None)} <= v4
    v6 = {(r["dst"], r.get("gateway")) for r in ip_json(nets, "-6", "route", "show", "dev", "net1")}
    assert ("2001:db8:1::/48", "2001:db8::1") in v6


def test_pods_without_netdev_claims_are_untouched_and_host_network_pods_are_refused(tmp_path, nets):
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic, pods=["11111111-2222-4333-8444-555555555555"])
    m = mover(tmp_path, nets)
    run(m.pod_started(pod(nets)))
    assert where(nets) == (True, False)
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    with pytest.raises(NetdevError, match="uses the host network"):
        run(m.pod_started(pod(nets, netns=None)))
    assert where(nets) == (True, False)


def test_a_failed_move_is_undone_and_fails_the_sandbox(tmp_path, nets):
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    cp = Checkpoint.load(str(tmp_path / "checkpoint.json"))
    cp.claims[CLAIM]["netdevs"].append({"device": "nic-1", "request": "net1", "host": "absent0", "pod": "net2"})
    cp.save()
    with pytest.raises(NetdevError, match="absent0"):
        run(mover(tmp_path, nets).pod_started(pod(nets)))
    assert where(nets) == (True, False)
    assert [r.get("state", "planned") for r in records(tmp_path)] == ["planned", "planned"]


def test_a_bad_address_fails_the_sandbox_and_the_netdev_comes_back(tmp_path, nets):
    """The kernel refuses a route whose gateway is not on any of the link's networks."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic, routes=[{"destination": "default", "gateway": "203.0.113.1"}])
    with pytest.raises(NetdevError, match="moving its netdevs failed"):
        run(mover(tmp_path, nets).pod_started(pod(nets)))
    assert where(nets) == (True, False)
    assert records(tmp_path)[0].get("state", "planned") == "planned"


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("still_running", [False, True])
def test_a_crash_at_each_step_is_finished_at_the_next_synchronization(tmp_path, nets, point, still_running):
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)

    def crash(at):
        if at == point:
            raise Crash(at)

    m = mover(tmp_path, nets, fault=crash)
    with pytest.raises(Crash):
        run(m.pod_started(pod(nets)))
        run(m.pod_stopped(pod(nets)))
    after = mover(tmp_path, nets)
    returning = point in ("netdev:returning", "netdev:returned")
    run(after.synchronized([pod(nets)] if still_running else []))
    expect = (False, True) if still_running and not returning else (True, False)
    assert where(nets) == expect
    assert [r.get("state", "planned") for r in records(tmp_path)] == ["in-pod" if expect == (False, True) else "planned"]


def test_a_bad_record_refuses_the_pod_without_touching_the_host(tmp_path, nets):
    """The checkpoint is input: a record that is no NetdevMove is rejected when loaded."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic, mtu=12)
    with pytest.raises(NetdevError, match="not valid .*mtu"):
        run(mover(tmp_path, nets).pod_started(pod(nets)))
    assert where(nets) == (True, False)


def test_a_pod_namespace_gone_unannounced_drops_its_records(tmp_path, nets):
    """containerd forgets its pods' NRI state when it restarts: a pod's namespace can go without
    StopPodSandbox. A veth dies with it; the record goes back to planned at the next look."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    m = mover(tmp_path, nets)
    run(m.pod_started(pod(nets)))
    run(m.reconcile())  # still there: kept
    assert records(tmp_path)[0]["state"] == "in-pod"
    subprocess.run(["ip", "netns", "del", nets.names["pod"]], check=True)
    run(m.reconcile())
    assert records(tmp_path)[0].get("state", "planned") == "planned"
    locked = []
    m._locked = lambda *args: locked.append(args)
    run(m.reconcile())  # nothing in a pod: no locked look at the whole checkpoint
    assert locked == []


def test_a_new_sandbox_of_the_pod_gets_the_netdev_of_a_gone_one(tmp_path, nets):
    """The kubelet recreates a pod's sandbox (after a reboot, a failed sandbox): the record of the
    old one, no longer running, is given back first."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    m = mover(tmp_path, nets)
    run(m.pod_started(pod(nets, sandbox="old")))
    run(m.pod_removed(pod(nets, sandbox="other")))  # not the old one: nothing moves
    m.pods.pop("old")  # the runtime forgot it (no RemovePodSandbox)
    run(m.pod_started(pod(nets, sandbox="new")))
    assert where(nets) == (False, True) and records(tmp_path)[0]["sandbox"] == "new"
    with pytest.raises(NetdevError, match="still runs"):
        run(m.pod_started(pod(nets, sandbox="third")))


# --- with the driver: prepare plans, the hook moves and writes metadata, unprepare undoes ------
@pytest.fixture
def ifname_nets(nets):
    """``nets`` with the fixture NIC's interface name on the test's host namespace."""
    subprocess.run(["ip", "-n", nets.names["host"], "link", "set", nets.nic, "name", IFNAME], check=True)
    return SimpleNamespace(**{**vars(nets), "nic": IFNAME})


def nic_claim(config: dict | None = None) -> dict:
    c = claim("nic", [("net1", NIC)], uid=CLAIM)
    c["status"]["reservedFor"] = [{"resource": "pods", "name": "app", "uid": POD_UID}]
    if config:
        c["status"]["allocation"]["devices"]["config"] = [{"source": "FromClaim", "opaque": {
            "driver": "sysdra.io", "parameters": {"apiVersion": "sysdra.io/v1alpha1", "kind": "NicConfig", **config}}}]
    return c


def test_a_nic_config_name_taken_twice_fails_the_claim(tmp_path):
    s = settings_for(str(tmp_path), root=profile_root("server-2s-gpu-nic"))
    inv = scan(s.root)
    c = claim("nic", [("net1", NIC), ("net1", "nic-0000-bd-00-0")], uid=CLAIM)
    c["status"]["allocation"]["devices"]["config"] = [{"source": "FromClaim", "opaque": {"driver": "sysdra.io", "parameters": {
        "apiVersion": "sysdra.io/v1alpha1", "kind": "NicConfig", "interfaceName": "data0"}}}]
    res = Driver(s, lambda: inv).prepare_claims([c])[CLAIM]
    assert "interfaceName 'data0' is given to two netdevs" in res.error


def test_a_prepare_holding_the_lock_delays_only_pods_with_netdevs(tmp_path, nets):
    """Every pod of the node starts through the plugin: one without a netdev claim never waits for
    the plugin's lock (a long prepare holds it); one with such a claim fails after the lock's
    timeout, and the kubelet retries its sandbox."""
    from agent.prepare.metadata.update import Flock

    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    m = mover(tmp_path, nets, lock_timeout=0.2)
    other = Pod("sb2", "other", "ns", "11111111-2222-4333-8444-555555555555", nets.pod)
    with Flock(str(tmp_path / "serialize.lock"), 1.0):
        run(m.pod_started(other))
        run(m.pod_stopped(other))
        with pytest.raises(NetdevError, match="timed out"):
            run(m.pod_started(pod(nets)))
    assert where(nets) == (True, False)
    run(m.pod_started(pod(nets)))
    assert where(nets) == (False, True)


def test_a_re_prepare_follows_the_pods_the_claim_is_reserved_for(tmp_path):
    """The kubelet prepares a shared claim again for each new pod: the netdev record's pods follow."""
    s = settings_for(str(tmp_path), root=profile_root("server-2s-gpu-nic"))
    inv = scan(s.root)
    d = Driver(s, lambda: inv)
    c = nic_claim()
    assert d.prepare_claims([c])[CLAIM].error is None
    second = "22222222-3333-4444-8555-666666666666"
    c["status"]["reservedFor"].append({"resource": "pods", "name": "b", "uid": second})
    assert d.prepare_claims([c])[CLAIM].error is None
    assert Checkpoint.load(d.checkpoint_path).claims[CLAIM]["pods"] == [POD_UID, second]


def test_a_claim_reserved_for_a_pod_group_cannot_give_its_netdev_to_a_pod(tmp_path):
    """DRAWorkloadResourceClaims: a claim reserved for a PodGroup, not its pods. Its netdev would
    stay on the host whatever pod starts (a sandbox names its pod, not its group): the claim fails
    saying so, and without NRI (nothing moves) it is prepared as any."""
    s = settings_for(str(tmp_path), root=profile_root("server-2s-gpu-nic"))
    inv = scan(s.root)
    c = nic_claim()
    c["status"]["reservedFor"] = [{"apiGroup": "scheduling.k8s.io", "resource": "podgroups", "name": "trainers",
                                   "uid": "33333333-4444-4555-8666-777777777777"}]
    err = Driver(s, lambda: inv).prepare_claims([c])[CLAIM].error
    assert "the claim is reserved for podgroups/trainers, not for pods (DRAWorkloadResourceClaims)" in err
    no_nri = s.replace(nri_socket="", kubelet_dir=str(tmp_path / "other"))
    assert Driver(no_nri, lambda: inv).prepare_claims([c])[CLAIM].error is None
    # reserved for a pod beside the group: that pod gets it; an entry without a pod's UID names none
    c["status"]["reservedFor"] += [{"resource": "pods", "name": "app", "uid": POD_UID},
                                   {"resource": "pods", "name": "x", "uid": "../x"}]
    d = Driver(s, lambda: inv)
    assert d.prepare_claims([c])[CLAIM].error is None
    assert Checkpoint.load(d.checkpoint_path).claims[CLAIM]["pods"] == [POD_UID]
    many = {"status": {"reservedFor": [{"resource": "podgroups", "name": f"g{i}"} for i in range(6)]}}
    assert group_consumers(many) == "podgroups/g0, podgroups/g1, podgroups/g2, podgroups/g3"  # a message's worth


def test_an_init_namespace_the_agent_may_not_open_is_said_at_start(tmp_path):
    """The host's network namespace is the init's: a fixture root has none (the agent's own is
    used, nothing to say); a root with the real init's link names why it cannot be opened by a
    process without the init's capabilities or CAP_SYS_PTRACE (the chart's grant)."""
    require_root()
    require_tool("setpriv")
    from agent.prepare import netmove

    assert netmove.host_netns_problem(profile_root("server-2s-gpu-nic")) is None
    init = subprocess.Popen(["sleep", "600"])  # an init: root with every capability this test has
    try:
        os.makedirs(tmp_path / "proc")
        os.symlink(f"/proc/{init.pid}", tmp_path / "proc" / "1")
        assert netmove.host_netns_problem(str(tmp_path)) is None  # the same capabilities
        check = "from agent.prepare import netmove; import sys; print(netmove.host_netns_problem(sys.argv[1]))"
        reduced = "-all,+net_admin,+sys_admin,+dac_override"  # what the chart grants without SYS_PTRACE
        for caps, said in ((reduced, "Permission denied"), (reduced + ",+sys_ptrace", "None")):
            out = subprocess.run(["setpriv", "--inh-caps=-all", f"--bounding-set={caps}", sys.executable, "-c", check,
                                  str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                                 env={**os.environ, "PYTHONPATH": REPO}, check=True)  # fmt: skip
            assert said in out.stdout, out
    finally:
        init.kill()
        init.wait()


def test_the_capabilities_a_move_needs_are_read_from_the_effective_set(tmp_path):
    from agent.prepare import netmove

    status = tmp_path / "status"
    for effective, lacking in (("0000000000000002", ["CAP_NET_ADMIN", "CAP_SYS_ADMIN"]),  # DAC_OVERRIDE alone
                               ("0000000000201002", []), ("0000000000001000", ["CAP_SYS_ADMIN"])):  # fmt: skip
        status.write_text(f"Name:\tsysdra\nCapInh:\t0000000000000000\nCapEff:\t{effective}\n")
        assert netmove.missing_move_capabilities(str(status)) == lacking
    status.write_text("Name:\tsysdra\n")  # unreadable: nothing said
    assert netmove.missing_move_capabilities(str(status)) == []
