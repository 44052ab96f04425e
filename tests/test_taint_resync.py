"""Found on the real node (issue 37, defect 2): with ``--taint-unhealthy`` every resync rewrote
the slice of a tainted device. The agent sends no ``timeAdded``; kube-apiserver v1.37 stamps
the time of the write on such a taint, so the slice read back never equalled the one the agent
wanted. Against the real server: a resync with an unchanged taint writes nothing."""

from __future__ import annotations

import pytest

from tests.test_apiserver_publish import Node, Running, run

TAINT = {"key": "sysdra.io/unhealthy", "value": "link-down", "effect": "NoSchedule"}


@pytest.fixture
def node(apiserver, tmp_path):
    return Node(apiserver, tmp_path)


def test_unchanged_taint_is_not_rewritten_by_a_resync(node):
    tainted = node.pool(3).slices[0]["devices"][1]["name"]
    pool = node.pool(3, taints={tainted: [dict(TAINT)]})

    async def scenario():
        async with Running(node) as r:
            r.pub.set_pool(pool)
            await r.pub.wait_synced(lambda p: p.total.created == 1)
            versions = [o["metadata"]["resourceVersion"] for o in node.slices()]
            for _ in range(2):
                syncs = r.pub.syncs
                r.pub.request_sync()
                await r.pub.wait_synced(lambda p: p.syncs > syncs)
            return versions, dict(r.store.writes)

    versions, writes = run(scenario())
    (stored,) = node.slices()
    taint = next(d for d in stored["spec"]["devices"] if d["name"] == tainted)["taints"][0]
    assert taint["timeAdded"]  # the server's stamp
    assert {k: v for k, v in taint.items() if k != "timeAdded"} == TAINT
    assert writes == {"create": 1, "update": 0, "delete": 0}
    assert [stored["metadata"]["resourceVersion"]] == versions


def test_a_rewrite_keeps_the_time_an_unchanged_taint_was_added(node):
    """The server stamps ``timeAdded`` on a taint sent without one, so a rewrite of the slice (for
    another device's change) made every taint in it look new: a NoExecute toleration's
    ``tolerationSeconds`` would start again. The old stamp is set directly (as the server keeps
    it) so the test needs no wait for the clock to move."""
    names = [d["name"] for d in node.pool(3).slices[0]["devices"]]
    pool = node.pool(3, taints={names[1]: [dict(TAINT)]})
    later = node.pool(3, taints={names[1]: [dict(TAINT)], names[2]: [dict(TAINT)]})
    old = "2020-01-02T03:04:05Z"

    async def scenario():
        async with Running(node) as r:
            r.pub.set_pool(pool)
            await r.pub.wait_synced(lambda p: p.total.created == 1)
            (stored,) = node.slices()
            next(d for d in stored["spec"]["devices"] if d["name"] == names[1])["taints"][0]["timeAdded"] = old
            node.plane.request("PUT", f"/apis/resource.k8s.io/v1/resourceslices/{stored['metadata']['name']}", body=stored)
            r.pub.set_pool(later)
            await r.pub.wait_synced(lambda p: p.total.updated >= 1 and p.pool is later)

    run(scenario())
    (stored,) = node.slices()
    taints = {d["name"]: d.get("taints") for d in stored["spec"]["devices"]}
    assert taints[names[2]] and taints[names[2]][0]["timeAdded"] != old  # the new taint: stamped now
    assert taints[names[1]] == [{**TAINT, "timeAdded": old}]


def test_a_taint_without_a_value_beside_one_with_a_value_is_not_rewritten(node):
    """A NIC the host uses is tainted without a value where its netdev's name is no label value
    (agent/service/hostnics.py). The server does not keep an empty ``value``: the agent took that for
    a dropped field (a feature gate off), compared every taint without its value, so the slice of any
    taint with one differed at each sync, and its rewrite took the field back: a write at every sync,
    each one's watch event asking for the next, for ever."""
    names = [d["name"] for d in node.pool(3).slices[0]["devices"]]
    bare = {"key": "sysdra.io/host-in-use", "value": "", "effect": "NoSchedule"}
    pool = node.pool(3, taints={names[1]: [dict(bare)], names[2]: [dict(TAINT)]})

    async def scenario():
        async with Running(node) as r:
            r.pub.set_pool(pool)
            await r.pub.wait_synced(lambda p: p.total.created == 1)
            for _ in range(3):
                syncs = r.pub.syncs
                r.pub.request_sync()
                await r.pub.wait_synced(lambda p: p.syncs > syncs)
            return dict(r.store.writes), sorted(r.pub.reconciler.dropped.paths)

    writes, dropped = run(scenario())
    assert dropped == []  # nothing was dropped: an empty value is no value
    assert writes == {"create": 1, "update": 0, "delete": 0}
    (stored,) = node.slices()
    taints = {d["name"]: d.get("taints") for d in stored["spec"]["devices"]}
    assert [{k: v for k, v in t.items() if k != "timeAdded"} for t in taints[names[1]]] == [{"key": bare["key"], "effect": "NoSchedule"}]
