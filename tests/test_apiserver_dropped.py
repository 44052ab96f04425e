"""A field the API server drops (its feature gate off) must not make the agent rewrite its pool
forever. kube-apiserver v1.37.2 with DRADeviceTaints off stores slices without the devices'
taints, silently: compared with what it keeps, every slice differed, so every sync bumped the
generation and rewrote the pool, and each write's watch event asked for the next sync. The agent
learns the drop from its own writes (agent/publish/dropped.py) and compares without it."""

from __future__ import annotations

import logging

import pytest

from tests.controlplane import FEATURE_GATES, ControlPlane
from tests.test_apiserver_publish import Node, Running, run

TAINT = {"key": "sysdra.io/unhealthy", "value": "link-down", "effect": "NoSchedule"}


@pytest.fixture(scope="module")
def without_taints(tmp_path_factory):
    """A server like the session's, with DRADeviceTaints (and the rules built on it) off."""
    gates = {**FEATURE_GATES, "DRADeviceTaints": False, "DRADeviceTaintRules": False}
    plane = ControlPlane(dir=str(tmp_path_factory.mktemp("notaints")), gates=gates).start()
    yield plane
    plane.stop()


def _state(node: Node) -> list[tuple[str, str, int]]:
    return [(o["metadata"]["name"], o["metadata"]["resourceVersion"], o["spec"]["pool"]["generation"])
            for o in node.slices()]


async def _resyncs(r: Running, n: int = 2) -> None:
    for _ in range(n):
        syncs = r.pub.syncs
        r.pub.request_sync()
        await r.pub.wait_synced(lambda p: p.syncs > syncs)


def test_dropped_taints_do_not_make_the_pool_rewrite_itself(without_taints, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="sysdra.publish")
    node = Node(without_taints, tmp_path)
    plain = node.pool(300)
    pool = node.pool(300, taints={d["name"]: [dict(TAINT)] for s in plain.slices for d in s["devices"]})
    assert len(pool.slices) >= 2  # a difference in two slices or more is what bumped the generation

    dry_runs: list[str] = []

    async def scenario(pub_pool, created):
        async with Running(node) as r:
            real = r.store.store.dry_run_update
            r.store.store.dry_run_update = lambda obj: dry_runs.append(obj["metadata"]["name"]) or real(obj)
            r.pub.set_pool(pub_pool)
            await r.pub.wait_synced(lambda p: p.total.writes >= created)
            before = (_state(node), dict(r.store.writes))
            await _resyncs(r)
            return before, (_state(node), dict(r.store.writes))

    (state, writes), after = run(scenario(pool, len(pool.slices)))
    assert writes == {"create": len(pool.slices), "update": 0, "delete": 0}
    assert not any(d.get("taints") for o in node.slices() for d in o["spec"]["devices"])  # the server dropped them
    assert after == (state, writes)  # the syncs the watch and the requests made wrote nothing
    assert {g for _, _, g in state} == {1}
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 1 and "spec.devices[].taints" in dropped[0] and "DRADeviceTaints" in dropped[0], dropped

    # a restarted agent (a rolling update) learns the drop from a dry run first: nothing written.
    # It rewrote the whole pool with a generation bump at every restart (learned from its writes).
    dry_runs.clear()
    (again, writes), after = run(scenario(pool, 0))
    assert again == state and writes == {"create": 0, "update": 0, "delete": 0} and after == (state, writes)
    assert len(dry_runs) == 1  # (the periodic recheck's waits its 10 minutes)


def test_what_a_write_kept_again_is_compared_again():
    """The gate turned on later: the next write that keeps the field ends leaving it out."""
    from agent.publish.dropped import Dropped

    device = {"name": "d0", "taints": [dict(TAINT)],
              "capacity": {"memory": {"value": "1Gi", "requestPolicy": {"default": {"value": "1Gi"}}}}}
    sent = {"spec": {"devices": [device], "skipNodeOperations": {"prepare": True}}}
    got = {"spec": {"devices": [{"name": "d0", "capacity": {"memory": {"value": "1Gi"}}}]}}
    d = Dropped()
    d.learn(sent, got)
    assert d.paths == {("devices", "*", "taints"), ("devices", "*", "capacity", "memory", "requestPolicy"),
                       ("skipNodeOperations",)}
    assert d.strip(sent) == got
    d.learn(sent, sent)
    assert d.paths == set() and d.strip(sent) == sent
