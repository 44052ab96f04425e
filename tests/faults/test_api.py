"""API faults: the real agent in API mode (``--cluster kube``) against the real kube-apiserver
v1.37.2 (the session's ``apiserver``), through tests/faultproxy.py for what the server does not
do on demand: 5xx bursts, 409 storms, dropped watches and stalls. The agent runs with its own
ServiceAccount token (deploy/rbac.yaml, bound to its Node); its ResourceClaims are real objects,
allocated by the scheduler's allocator from the slices the agent published. The agent keeps
answering the kubelet during the fault and its slices converge once the server recovers.

``SYSDRA_FAULT_STALL`` (default 30) is the length of the one long stall of the ResourceSlice
endpoints the issue asks for."""

from __future__ import annotations

import os
import time

import pytest

from tests.conftest import REPO
from tests.controlplane import allocate, resource_path, unique
from tests.faultproxy import FaultProxy
from tests.faults.harness import DRIVER, Node, run

pytestmark = pytest.mark.slow

STALL = float(os.environ.get("SYSDRA_FAULT_STALL", "30"))
SLICES = "/apis/resource.k8s.io/v1/resourceslices"


@pytest.fixture
def proxy(apiserver):
    p = FaultProxy(apiserver).start()  # one per test: a fault armed but not taken does not leak
    yield p
    p.stop()


@pytest.fixture
def node(apiserver, proxy, tmp_path):
    name = unique("faults")
    node_obj = apiserver.create_node(name)
    for manifest in ("namespace.yaml", "rbac.yaml", "deviceclasses.yaml"):
        apiserver.apply(f"{REPO}/deploy/{manifest}")
    kubeconfig = proxy.write_kubeconfig(str(tmp_path / "kubeconfig"), token=apiserver.token("sysdra", "sysdra", node=name))
    n = Node(tmp_path, node_name=name)
    n.plane = apiserver
    n.namespace = unique("faults")
    apiserver.create_namespace(n.namespace)
    n.start(env={"KUBECONFIG": kubeconfig}, cluster="kube")
    try:
        converge(n, 30)
        n.claims = allocated_claims(apiserver, n, node_obj, 3)
        allocated = {r["device"] for c in n.claims for r in c["status"]["allocation"]["devices"]["results"]}
        n.hot = [d for d in n.devices() if d.startswith("gpu-") and d not in allocated][-1]
        yield n
    finally:
        n.stop()


def allocated_claims(plane, node: Node, node_obj: dict, count: int) -> list[dict]:
    """``count`` one-GPU claims, created on the server, allocated by the scheduler's allocator from
    the slices the agent published, their status written as the scheduler does."""
    claims = [plane.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                            "metadata": {"name": f"c{i}", "namespace": node.namespace},
                            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.sysdra.io"}}]}}})
              for i in range(count)]  # fmt: skip
    allocations = allocate(server_slices(node), plane.list("DeviceClass"), claims, node=node_obj)
    out = []
    for claim, allocation in zip(claims, allocations):
        path = resource_path("ResourceClaim", node.namespace, claim["metadata"]["name"]) + "/status"
        out.append(plane.request("PUT", path, body=dict(claim, status={"allocation": allocation})).json())
    assert len({r["device"] for c in out for r in c["status"]["allocation"]["devices"]["results"]}) == count
    return out


def server_slices(node: Node) -> list[dict]:
    return node.plane.list("ResourceSlice", fields={"spec.nodeName": node.name, "spec.driver": DRIVER})


def converge(node: Node, timeout: float) -> float:
    """The server holds exactly the scanned devices in one complete pool (read as admin, not
    through the proxy)."""
    t0 = time.monotonic()
    want = node.expected_devices()
    while True:
        mine = server_slices(node)
        names = sorted(d["name"] for s in mine for d in s["spec"].get("devices", []))
        if names == want and {s["spec"]["pool"]["resourceSliceCount"] for s in mine} == {len(mine)}:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"slices did not converge in {timeout}s: {names} != {want}\n{node.log_tail()}")
        time.sleep(0.1)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def wipe_as_kubelet(node: Node) -> int:
    """The kubelet's DeleteCollection of this node's slices, as system:node:<name>."""
    kubelet = node.plane.http(cert=node.plane.node_identity(node.name))
    try:
        r = kubelet.request("DELETE", SLICES, params={"fieldSelector": f"spec.nodeName={node.name},spec.driver={DRIVER}"})
        assert r.status_code == 200, r.text
        return len(r.json()["items"])
    finally:
        kubelet.close()


def prepare_works(node: Node, claim: dict) -> float:
    """NodePrepareResources answers successfully (within the kubelet's call deadline); returns
    its latency for the report."""
    t0 = time.monotonic()
    r = run(node.prepare(claim))
    latency = time.monotonic() - t0
    assert not r.claims[claim["metadata"]["uid"]].error, r
    return latency


def unprepare_all(node: Node) -> None:
    r = run(node.unprepare(*node.claims))
    assert all(not e.error for e in r.claims.values()), r
    node.check_clean()


def test_5xx_bursts(node, proxy, faults):
    for method, watch in (("GET", False), ("POST", None), ("PUT", None), ("DELETE", None), ("GET", True)):  # list, create, update, delete, watch
        proxy.fail_next(1, 500, method=method, path=SLICES, watch=watch)
    proxy.fail_next(2, 503, method="GET", path=SLICES, watch=False)
    node.unplug(node.hot)
    lat = prepare_works(node, node.claims[0])
    took = converge(node, 30)
    node.replug(node.hot)
    converge(node, 30)
    unprepare_all(node)
    assert proxy.injected >= 1, "no 5xx reached the agent"
    faults.add("API faults", "5xx bursts (500/503 on list, create, update, delete, watch) during a hot-unplug", proxy.injected,
               f"prepare served ({lat * 1000:.0f} ms); slices converged {took:.1f}s after the change")


def test_5xx_on_claim_reads(node, proxy, faults):
    proxy.fail_next(2, 500, method="GET", path=f"/namespaces/{node.namespace}/resourceclaims/c1")
    uid = node.claims[1]["metadata"]["uid"]
    errors = []
    for _ in range(3):  # the kubelet retries
        r = run(node.prepare(node.claims[1]))
        if not r.claims[uid].error:
            break
        errors.append(r.claims[uid].error)
    assert errors and all("500" in e and f"{node.namespace}/c1" in e for e in errors), errors
    assert not r.claims[uid].error
    unprepare_all(node)
    faults.add("API faults", "500 on the ResourceClaim GET", len(errors),
               "per-claim error naming the claim and the status; the kubelet's retry succeeds")


def test_409_storm(node, proxy, faults):
    proxy.fail_next(6, 409, method="PUT", path=SLICES)
    proxy.fail_next(2, 409, method="POST", path=SLICES)
    node.unplug(node.hot)
    lat = prepare_works(node, node.claims[0])
    took = converge(node, 30)
    unprepare_all(node)
    assert proxy.injected >= 1, "no 409 reached the agent"
    faults.add("API faults", "409 storm on update/create during a hot-unplug", proxy.injected,
               f"prepare served ({lat * 1000:.0f} ms); converged in {took:.1f}s")


def test_dropped_watches(node, proxy, faults, apiserver):
    dropped = 0
    for i in range(6):
        wait_for(lambda: proxy.open_watches() >= 1, 30, "the agent's slice watch")
        if i == 5:  # the last one resumes across an etcd compaction
            for _ in range(2):
                apiserver.create_namespace(unique("bump"))
            apiserver.compact_etcd()
        dropped += proxy.drop_watches()
    wait_for(lambda: proxy.open_watches() >= 1, 30, "the agent's slice watch to come back")
    prepare_works(node, node.claims[0])
    assert wipe_as_kubelet(node) >= 1  # the kubelet's DeleteCollection: only the repaired watch can notice
    t0 = time.monotonic()
    converge(node, 20)
    took = time.monotonic() - t0
    unprepare_all(node)
    assert dropped >= 6
    faults.add("API faults", "dropped watches (6, the last across an etcd compaction) then a kubelet wipe", dropped,
               f"slices republished {took:.1f}s after the wipe")


def test_slice_endpoints_stall(node, proxy, faults):
    """The one long stall: every ResourceSlice request hangs for STALL seconds."""
    seen = len(proxy.requests)
    proxy.delay(STALL, path=SLICES)
    node.unplug(node.hot)
    t0 = time.monotonic()
    lats = []
    while time.monotonic() - t0 < STALL:  # the kubelet keeps being served for the whole stall
        lats += [prepare_works(node, c) for c in node.claims]
        r = run(node.unprepare(*node.claims))
        assert all(not e.error for e in r.claims.values()), r
        time.sleep(1.0)
    stalled = [t for _m, t in proxy.requests[seen:] if t.startswith(SLICES)]
    proxy.delay(0)
    took = converge(node, STALL + 30)
    unprepare_all(node)
    faults.add("API faults", f"{STALL:.0f} s stall of every ResourceSlice request during a hot-unplug", 1,
               f"{len(lats)} prepares served during the stall (max {max(lats) * 1000:.0f} ms); converged {took:.1f}s "
               "after the server recovered")
    assert stalled, "no ResourceSlice request reached the stalled server"


def test_claim_read_stall(node, proxy, faults):
    proxy.delay(3, path=f"/namespaces/{node.namespace}/resourceclaims/")
    t0 = time.monotonic()
    r = run(node.prepare(node.claims[2]))
    took = time.monotonic() - t0
    proxy.delay(0)
    assert not r.claims[node.claims[2]["metadata"]["uid"]].error, (took, r)  # within the kubelet's deadline
    prepare_works(node, node.claims[0])
    unprepare_all(node)
    faults.add("API faults", "3 s stall of the ResourceClaim GET", 1,
               f"prepare answered in {took:.1f}s (< the kubelet's 45 s)")
