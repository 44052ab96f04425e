"""A claim's netdev into its pod and back (agent/nri/netdev.py), on the real kernel: two network
namespaces made by the test stand for the host and the pod, a veth end for the NIC. A crash
(an exception raised at each fault point: nothing after it runs) leaves records that the next
synchronization finishes: back to the host, or completed into a pod still running. Root only.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from types import SimpleNamespace

import pytest

from agent.nri import rtnl
from agent.nri.moves import MoveRecords
from agent.prepare.netdevs import plan_netdevs, reserved_pods
from agent.nri.netdev import NetdevError, NetdevMover
from agent.nri.plugin import Pod
from agent.prepare.checkpoint import Checkpoint
from agent.prepare.checkpoint_format import COMPLETED
from tests.conftest import require_root, require_tool

CLAIM = "0b0c7c8e-1111-4222-8333-444455556666"
POD_UID = "9d3f1c2a-aaaa-4bbb-8ccc-dddddddddddd"
POINTS = ("netdev:recorded", "netdev:moved", "netdev:returning", "netdev:returned")


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
    yield SimpleNamespace(host=f"/run/netns/{names['host']}", pod=f"/run/netns/{names['pod']}", nic=nic)
    for n in names.values():
        subprocess.run(["ip", "netns", "del", n], check=False)


def write_checkpoint(path, nic: str, pods=(POD_UID,)):
    cp = Checkpoint(str(path))
    cp.claims = {CLAIM: {"state": COMPLETED, "namespace": "ns", "name": "c", "bootID": "b", "allocation": "a",
                         "devices": [], "cdiSpec": None, "metadata": None, "pods": list(pods),
                         "netdevs": [{"device": "nic-0", "request": "net1", "host": nic, "pod": "net1"}]}}
    cp.save()


def mover(tmp_path, nets, fault=lambda point: None) -> NetdevMover:
    return NetdevMover(str(tmp_path / "checkpoint.json"), str(tmp_path / "moves.json"), host_netns=nets.host, fault=fault)


def pod(nets, netns="pod") -> Pod:
    return Pod("sb1", "app", "ns", POD_UID, getattr(nets, netns) if netns else None)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def where(nets) -> tuple[bool, bool]:
    return rtnl.has_link(nets.host, nets.nic), rtnl.has_link(nets.pod, "net1")


def test_the_netdev_goes_into_the_pod_up_under_its_name_and_comes_back(tmp_path, nets):
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    m = mover(tmp_path, nets)
    run(m.synchronized([]))
    run(m.pod_started(pod(nets)))
    assert where(nets) == (False, True)
    out = subprocess.run(["ip", "-n", nets.pod.rsplit("/", 1)[1], "-j", "link", "show", "net1"], capture_output=True, check=True)
    assert "UP" in json.loads(out.stdout)[0]["flags"]
    assert [m.state for m in MoveRecords(str(tmp_path / "moves.json")).load().moves.values()] == ["in-pod"]
    run(m.pod_started(pod(nets)))  # a repeated event changes nothing
    run(m.pod_stopped(pod(nets)))
    assert where(nets) == (True, False)
    run(m.pod_removed(pod(nets)))
    assert MoveRecords(str(tmp_path / "moves.json")).load().moves == {}


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
    assert MoveRecords(str(tmp_path / "moves.json")).load().moves == {}


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
    records = MoveRecords(str(tmp_path / "moves.json")).load().moves
    assert [r.state for r in records.values()] == (["in-pod"] if expect == (False, True) else [])


def test_a_bad_records_file_is_moved_aside(tmp_path):
    path = tmp_path / "moves.json"
    path.write_text('{"x/y": {"sandbox": "x"}}')
    assert MoveRecords(str(path)).load().moves == {}
    assert (tmp_path / "moves.json.bad").exists() and not path.exists()


def test_plan_names_netdevs_after_their_requests_and_skips_shares():
    def nic(name):
        return SimpleNamespace(nic=SimpleNamespace(interfaces=(SimpleNamespace(name=name),)))

    def dev(name, request, share=None):
        return SimpleNamespace(device=name, requests=[request], share_id=share)

    by_name = {"a": nic("enp1s0f0"), "b": nic("enp1s0f1"), "c": nic("enp2s0"), "d": nic("enp3s0"),
               "g": SimpleNamespace(nic=None)}
    devices = [dev("a", "nic"), dev("b", "nic"), dev("c", "x" * 40), dev("d", "shared", share="s1"), dev("g", "gpu")]
    assert plan_netdevs(devices, by_name) == [
        {"device": "a", "request": "nic", "host": "enp1s0f0", "pod": "nic"},
        {"device": "b", "request": "nic", "host": "enp1s0f1", "pod": "nic1"},
        {"device": "c", "request": "x" * 40, "host": "enp2s0", "pod": "enp2s0"}]
    claim = {"status": {"reservedFor": [{"resource": "pods", "name": "p", "uid": POD_UID}, {"resource": "x", "uid": CLAIM},
                                        {"resource": "pods", "uid": "../etc"}]}}
    assert reserved_pods(claim) == [POD_UID] and reserved_pods({"status": "x"}) == []


def test_a_pod_namespace_gone_unannounced_drops_its_records(tmp_path, nets):
    """containerd forgets its pods' NRI state when it restarts: a pod's namespace can go without
    StopPodSandbox. A veth dies with it; the record goes at the next look."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    m = mover(tmp_path, nets)
    run(m.pod_started(pod(nets)))
    m._reconcile()  # still there: kept
    assert list(MoveRecords(str(tmp_path / "moves.json")).load().moves)
    subprocess.run(["ip", "netns", "del", nets.pod.rsplit("/", 1)[1]], check=True)
    m._reconcile()
    assert MoveRecords(str(tmp_path / "moves.json")).load().moves == {}
