"""API faults: the real agent in API mode (``--cluster kube``, KUBECONFIG -> the stand-in API
server) while the server returns 5xx bursts, 409 storms, drops watches and stalls. The agent
keeps answering the kubelet during the fault and its slices converge once the server recovers.

``SYSDRA_FAULT_STALL`` (default 30) is the length of the one long stall of the ResourceSlice
endpoints the issue asks for."""

from __future__ import annotations

import os
import time

import pytest

from tests.apiserver_standin import SLICES, StandinAPIServer
from tests.faults.harness import NODE, Node, run

pytestmark = pytest.mark.slow

STALL = float(os.environ.get("SYSDRA_FAULT_STALL", "30"))


@pytest.fixture
def api():
    server = StandinAPIServer().start()
    server.add_node(NODE)
    yield server
    server.stop()


@pytest.fixture
def node(api, tmp_path):
    n = Node(tmp_path)
    kubeconfig = api.kubeconfig(str(tmp_path / "kubeconfig"))
    g = [d for d in n.devices() if d.startswith("gpu-")]
    n.claims = []
    for i in range(3):
        c = n.write_claim(f"c{i}", [("gpu", g[i])], uid=f"{i:08d}-0000-4000-8000-0000000a9100")
        api.claims[("default", f"c{i}")] = c
        n.claims.append(c)
    n.hot = g[7]
    n.start(env={"KUBECONFIG": kubeconfig}, cluster="kube")
    yield n
    n.stop()


def converge(api, node: Node, timeout: float) -> float:
    t0 = time.monotonic()
    want = node.expected_devices()
    while True:
        mine = [s for s in api.slice_list() if s["spec"]["nodeName"] == NODE]
        names = sorted(d["name"] for s in mine for d in s["spec"].get("devices", []))
        if names == want and {s["spec"]["pool"]["resourceSliceCount"] for s in mine} == {len(mine)}:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"slices did not converge in {timeout}s: {names} != {want}\n{node.log_tail()}")
        time.sleep(0.05)


def prepare_works(node: Node, claim: dict, within: float = 5.0) -> float:
    """NodePrepareResources answers successfully and quickly; returns its latency."""
    t0 = time.monotonic()
    r = run(node.prepare(claim))
    latency = time.monotonic() - t0
    assert not r.claims[claim["metadata"]["uid"]].error, r
    assert latency < within, f"prepare took {latency:.1f}s during the fault"
    return latency


def unprepare_all(node: Node) -> None:
    r = run(node.unprepare(*node.claims))
    assert all(not e.error for e in r.claims.values()), r
    node.check_clean()


def test_5xx_bursts(api, node, faults):
    converge(api, node, 10)
    for verb in ("list", "create", "update", "delete", "watch"):
        api.fail_next(1, 500, verb=verb)
    api.fail_next(2, 503, verb="list")
    node.unplug(node.hot)
    lat = prepare_works(node, node.claims[0])
    took = converge(api, node, 30)
    node.replug(node.hot)
    converge(api, node, 30)
    unprepare_all(node)
    faults.add("API faults", "5xx bursts (500/503 on list, create, update, delete, watch) during a hot-unplug", 7,
               f"prepare served ({lat * 1000:.0f} ms); slices converged {took:.1f}s after the change")


def test_5xx_on_claim_reads(api, node, faults):
    api.fail_next(2, 500, verb="get")
    uid = node.claims[1]["metadata"]["uid"]
    errors = []
    for _ in range(3):  # the kubelet retries
        r = run(node.prepare(node.claims[1]))
        if not r.claims[uid].error:
            break
        errors.append(r.claims[uid].error)
    assert errors and all("500" in e and "default/c1" in e for e in errors), errors
    assert not r.claims[uid].error
    unprepare_all(node)
    faults.add("API faults", "500 on the ResourceClaim GET", len(errors),
               "per-claim error naming the claim and the status; the kubelet's retry succeeds")


def test_409_storm(api, node, faults):
    converge(api, node, 10)
    api.fail_next(6, 409, verb="update")
    api.fail_next(2, 409, verb="create")
    node.unplug(node.hot)
    lat = prepare_works(node, node.claims[0])
    took = converge(api, node, 30)
    unprepare_all(node)
    faults.add("API faults", "409 storm on update/create during a hot-unplug", 8,
               f"prepare served ({lat * 1000:.0f} ms); converged in {took:.1f}s")


def test_dropped_watches(api, node, faults):
    converge(api, node, 10)
    for _ in range(5):
        api.drop_watches()
        time.sleep(0.1)
    api.compact()
    api.drop_watches()  # resumes from a compacted version: 410 Gone, re-list
    time.sleep(0.5)
    prepare_works(node, node.claims[0])
    api.wipe(NODE)  # the kubelet's DeleteCollection: only the repaired watch can notice
    took = converge(api, node, 20)
    unprepare_all(node)
    faults.add("API faults", "dropped watches (6, one resuming from a compacted version) then a kubelet wipe", 6,
               f"slices republished {took:.1f}s after the wipe")


def test_slice_endpoints_stall(api, node, faults):
    """The one long stall: every ResourceSlice request hangs for STALL seconds."""
    converge(api, node, 10)
    api.delay(STALL, only=SLICES)
    node.unplug(node.hot)
    t0 = time.monotonic()
    lats = []
    while time.monotonic() - t0 < STALL:  # the kubelet keeps being served for the whole stall
        lats += [prepare_works(node, c) for c in node.claims]
        r = run(node.unprepare(*node.claims))
        assert all(not e.error for e in r.claims.values()), r
        time.sleep(1.0)
    stalled = [p for v, p in api.requests if p.startswith(SLICES)]
    api.delay(0)
    took = converge(api, node, STALL + 30)
    unprepare_all(node)
    faults.add("API faults", f"{STALL:.0f} s stall of every ResourceSlice request during a hot-unplug", 1,
               f"{len(lats)} prepares served during the stall (max {max(lats) * 1000:.0f} ms); converged {took:.1f}s "
               "after the server recovered")
    assert stalled, "no ResourceSlice request reached the stalled server"


def test_claim_read_stall(api, node, faults):
    api.delay(3, only="/apis/resource.k8s.io/v1/namespaces/")
    t0 = time.monotonic()
    r = run(node.prepare(node.claims[2]))
    took = time.monotonic() - t0
    api.delay(0)
    assert not r.claims[node.claims[2]["metadata"]["uid"]].error and 3 <= took < 45, (took, r)
    prepare_works(node, node.claims[0])
    unprepare_all(node)
    faults.add("API faults", "3 s stall of the ResourceClaim GET", 1,
               f"prepare answered in {took:.1f}s (< the kubelet's 45 s)")
