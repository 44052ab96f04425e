"""AMD compute modes across a node reboot, on the simulated amdgpu (fixtures/simkernel/amdgpu.py).

amdgpu does not keep a compute mode across boots: the GPU comes up in its default (SPX). A claim
prepared before the reboot in another mode (DPX partitions) is still prepared after it, and the
kubelet re-prepares it for the pod it restarts: the GPU must be in the claim's mode again before
that pod runs. Left in SPX, partition 0's render node is the whole GPU (every XCC, the other
partitions' claims' compute too) and the other partitions' render nodes are gone."""

from __future__ import annotations

import os

from agent.prepare.driver import Driver
from agent.prepare.partitions import memory_refusal
from tests.partition_node import SPX_GPU, Node, mode_of, part_of
from tests.test_partitions_allocator import gpu_bdf
from tests.test_partitions_nps import _reloaded_in, _settle, _write
from tests.test_partitions_prepare import driver_for, node, prepare, ref, spec_nodes  # noqa: F401 - node: a fixture

BDF = gpu_bdf(SPX_GPU)


def _rebooted(node: Node) -> Driver:
    """The node rebooted: the GPU back in amdgpu's default mode, a new boot ID; the agent's start."""
    _write(node, "current_compute_partition", "SPX")
    _settle(node, "SPX/NPS1")
    node.rescan()
    d = driver_for(node)
    d.boot_id = "another-boot"
    return d


def _two_dpx_claims(node: Node) -> tuple[Driver, dict, dict]:
    d = driver_for(node)
    a = node.allocated("a", part_of(SPX_GPU, "DPX/NPS1"))
    assert not prepare(d, a).error
    b = node.allocated("b", part_of(SPX_GPU, "DPX/NPS1"), prepared=[a])
    assert not prepare(d, b).error
    assert mode_of(node.root, BDF) == "DPX/NPS1"
    return d, a, b


def test_a_claims_mode_is_back_after_a_reboot(node):
    """Recovery puts the GPU in the mode its prepared claims run it in (one switch for both), so
    each claim's spec names its partition again; the kubelet's re-prepare then answers as before."""
    before, a, b = _two_dpx_claims(node)
    specs = {c["metadata"]["uid"]: spec_nodes(before, c["metadata"]["uid"]) for c in (a, b)}
    d = _rebooted(node)
    report = d.recover()
    assert report.boot_changed and report.kernel_changed and report.not_rebuilt == []
    _settle(node, "DPX/NPS1")  # (the simulator records a switch once its partitions are up)
    assert [s[1:] for s in node.sim.switches] == [("DPX", "NPS1"), ("SPX", "NPS1"), ("DPX", "NPS1")]
    for c in (a, b):
        uid = c["metadata"]["uid"]
        assert spec_nodes(d, uid) == specs[uid]
        for path in (p for ps in specs[uid].values() for p in ps if "render" in p):
            assert os.path.exists(os.path.join(node.root, path.lstrip("/"))), f"{path} is not there after the reboot"
        res = prepare(d, c)  # the kubelet's, for the pod it restarts
        assert not res.error, res.error
    assert len(node.sim.switches) == 3


def test_the_kubelets_re_prepare_puts_the_mode_back(node):
    """The mode switched under a prepared claim without a restart of the agent (by hand, or by a
    reboot the agent's recovery could not act on): the kubelet's re-prepare switches it back first."""
    d, a, _ = _two_dpx_claims(node)
    _write(node, "current_compute_partition", "SPX")
    _settle(node, "SPX/NPS1")
    node.rescan()
    assert not prepare(d, a).error
    assert mode_of(node.root, BDF) == "DPX/NPS1"


def test_a_mode_that_cannot_come_back_fails_the_re_prepare(node):
    """The GPU came back in another memory mode (the operator's request applied at the reboot's
    driver load): the claim's DPX/NPS1 cannot run there, so its pod is not started on the GPU as
    it is; its unprepare still goes, the GPU left as the operator set it."""
    d, a, b = _two_dpx_claims(node)
    _reloaded_in(node, "QPX", "NPS4")
    d = driver_for(node)
    d.boot_id = "another-boot"
    d.recover()
    assert mode_of(node.root, BDF) == "QPX/NPS4"
    err = prepare(d, a).error
    assert err and memory_refusal(BDF, "NPS4", "DPX/NPS1") in err, err
    uids = [c["metadata"]["uid"] for c in (a, b)]
    assert d.unprepare_claims([ref(a), ref(b)]) == dict.fromkeys(uids)
    assert mode_of(node.root, BDF) == "QPX/NPS4" and d.checkpoint.claims == {}
