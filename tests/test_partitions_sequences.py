"""AMD compute partitions over any sequence a node lives through (tests/test_partitions_*.py have
the single cases): claims of partitions in any compute mode, or of the whole GPU, allocated by
the scheduler's allocator beside the claims the node holds, prepared (switching the GPU's mode
on the simulated amdgpu, fixtures/simkernel/amdgpu.py), prepared again, unprepared, the agent
restarted, the node rebooted (amdgpu comes up in SPX). Hypothesis draws the sequences
(stateful testing, deterministic).

What must hold after every step: a GPU with prepared claims is in their mode (the one their
partitions' render nodes are of), and each such claim's CDI spec is on disk. At the end, every
claim unprepared: no entry, no spec."""

from __future__ import annotations

import os
import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from agent.prepare.checkpoint_format import COMPLETED
from tests.controlplane_allocator import Unschedulable
from tests.partition_node import SPX_GPU, Node, mode_of, part_of, whole
from tests.test_partitions_allocator import gpu_bdf
from tests.test_partitions_nps import _settle, _write
from tests.test_partitions_prepare import driver_for, prepare, ref

MODES = ("SPX/NPS1", "DPX/NPS1", "QPX/NPS1", "CPX/NPS1", "whole")
BDF = gpu_bdf(SPX_GPU)


class PartitionNodeLife(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="sysdra-amd-life-")
        self.node = Node(self.tmp)
        self.node.sim.start()
        self.driver = self._start("boot-0")
        self.live: dict[str, dict] = {}  # allocated claims: until their unprepare succeeds
        self.mode: dict[str, str] = {}  # prepared claim -> the mode it needs
        self.boots = 0
        self.n = 0

    def _start(self, boot_id: str):
        self.node.rescan()
        d = driver_for(self.node)
        d.boot_id = boot_id
        d.recover()
        return d

    @rule(mode=st.sampled_from(MODES), count=st.integers(1, 2))
    def prepare_new(self, mode, count):
        self.n += 1
        selectors = whole(SPX_GPU) if mode == "whole" else part_of(SPX_GPU, mode)
        try:
            c = self.node.allocated(f"c{self.n}", selectors, count=1 if mode == "whole" else count,
                                    prepared=list(self.live.values()))
        except Unschedulable:
            return  # not beside the claims the node holds
        self.live[c["metadata"]["uid"]] = c
        self._prepare(c["metadata"]["uid"], "SPX/NPS1" if mode == "whole" else mode)

    @precondition(lambda self: self.mode)
    @rule(data=st.data())
    def prepare_again(self, data):
        uid = data.draw(st.sampled_from(list(self.mode)))
        self._prepare(uid, self.mode[uid])

    def _prepare(self, uid: str, mode: str) -> None:
        res = prepare(self.driver, self.live[uid])
        assert not res.error, res.error
        self.mode[uid] = mode

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def unprepare(self, data):
        uid = data.draw(st.sampled_from(list(self.live)))
        assert self.driver.unprepare_claims([ref(self.live[uid])]) == {uid: None}
        del self.live[uid]
        self.mode.pop(uid, None)

    @rule()
    def agent_restarts(self):
        self.driver = self._start(self.driver.boot_id)

    @rule()
    def node_reboots(self):
        if mode_of(self.node.root, BDF) != "SPX/NPS1":  # amdgpu's mode at boot
            _write(self.node, "current_compute_partition", "SPX")
            _settle(self.node, "SPX/NPS1")
        self.boots += 1
        self.driver = self._start(f"boot-{self.boots}")

    @invariant()
    def the_gpu_is_in_its_claims_mode(self):
        modes = {m for u, m in self.mode.items()
                 if (self.driver.checkpoint.claims.get(u) or {}).get("state") == COMPLETED}
        assert len(modes) <= 1, self.mode  # the allocator never mixes modes on one GPU
        if modes:
            assert mode_of(self.node.root, BDF) == next(iter(modes)), (self.mode, mode_of(self.node.root, BDF))
        for uid in self.mode:
            assert os.path.exists(self.driver._spec_path(uid))

    def teardown(self):
        try:
            self.driver = self._start(self.driver.boot_id)
            for uid, c in list(self.live.items()):
                assert self.driver.unprepare_claims([ref(c)]) == {uid: None}
            assert self.driver.checkpoint.claims == {}
            cdi = self.node.settings.cdi_dir
            assert not os.path.isdir(cdi) or not [n for n in os.listdir(cdi) if "claim_" in n]
        finally:
            self.node.sim.stop()
            shutil.rmtree(self.tmp, ignore_errors=True)


def test_any_life_of_a_node_partitioning_its_gpus():
    run_state_machine_as_test(PartitionNodeLife, settings=settings(
        max_examples=30, stateful_step_count=12, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
