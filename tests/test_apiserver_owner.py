"""The Node deleted and re-created (``kubectl delete node``, the kubelet registering it again):
kube-controller-manager's garbage collector deletes the slices owned by the old Node. The agent
read the Node's UID once, so it re-created them with the same stale owner reference, and the
collector deleted them again, until the agent restarted. On a private kube-apiserver with a
real kube-controller-manager (only its garbage collector): the slices end up owned by the new
Node and stay."""

from __future__ import annotations

import httpx2
import pytest

from tests.controlplane import ControlPlane, free_port, peer, wait_until
from tests.test_apiserver_publish import Node, Running, run


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    """A server of its own (the collector acts on every object of the server it watches)."""
    plane = ControlPlane(dir=str(tmp_path_factory.mktemp("gc"))).start()
    port = free_port()
    kubeconfig = plane.kubeconfig
    proc = plane._spawn("kube-controller-manager", [
        peer("kube-controller-manager"), f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}", "--leader-elect=false", "--bind-address=127.0.0.1",
        f"--secure-port={port}", "--controllers=garbagecollector", "--v=1",
        "--feature-gates=" + ",".join(f"{k}={str(v).lower()}" for k, v in sorted(plane.gates.items())),
    ])  # fmt: skip
    try:
        wait_until(lambda: httpx2.get(f"https://127.0.0.1:{port}/healthz", verify=False, timeout=2).status_code == 200,
                   60, what="kube-controller-manager", proc=proc, tail=lambda: plane.log_tail("kube-controller-manager"))
        yield plane
    finally:
        plane.stop()


def _owners(node: Node) -> list[list[str]]:
    return [[r["uid"] for r in o["metadata"].get("ownerReferences", [])] for o in node.slices()]


def test_slices_follow_a_recreated_node(collected, tmp_path):
    node = Node(collected, tmp_path)
    pool = node.pool(300)
    count = len(pool.slices)

    async def scenario():
        async with Running(node) as r:
            r.pub.set_pool(pool)
            await r.pub.wait_synced(lambda p: p.total.created == count)
            assert _owners(node) == [[node.uid]] * count
            old = node.uid
            collected.delete("Node", node.name)
            node.uid = collected.create_node(node.name)["metadata"]["uid"]
            assert node.uid != old
            # the collector deleted what the old Node owned; the agent published them again, owned by the new one
            await r.settle(lambda: _owners(node) == [[node.uid]] * count, timeout=40)
            # and they stay: a resync after the collector has seen them writes nothing
            writes = dict(r.store.writes)
            syncs = r.pub.syncs
            r.pub.request_sync()
            await r.pub.wait_synced(lambda p: p.syncs > syncs)
            return writes, dict(r.store.writes)

    before, after = run(scenario())
    assert before == after
    assert _owners(node) == [[node.uid]] * count
