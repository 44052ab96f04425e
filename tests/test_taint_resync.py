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
