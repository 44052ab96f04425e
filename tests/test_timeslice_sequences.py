"""NVIDIA time slices over any sequence a node lives through (tests/test_timeslice.py has the
single cases): claims of one or two free GPUs with a GpuConfig time slice, prepared, prepared
again, unprepared, the agent restarted, the node rebooted (the driver forgets every slice:
Default), nvidia-smi failing for a while. Hypothesis draws the sequences (stateful testing,
deterministic).

A GPU's slice is what the last nvidia-smi call that succeeded on it set (the simulated
nvidia-smi logs every call; a marker file makes it fail). What must hold after every step
while nvidia-smi works: a GPU a prepared claim holds runs the claim's slice, every other GPU
Default. At the end, every claim unprepared: every GPU Default, no entry."""

from __future__ import annotations

import os
import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from agent.kubeletplugin.types import ClaimRef
from agent.prepare.checkpoint_format import COMPLETED
from tests.test_timeslice import GPU, GPU2, claim, driver, node, uuid

GPUS = (GPU, GPU2, "gpu-0000-3a-00-0")
CODES = {"Default": "0", "Short": "1", "Medium": "2", "Long": "3"}


class TimeSliceLife(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="sysdra-ts-life-")
        self.path = type("P", (), {"__truediv__": lambda _, n: os.path.join(self.tmp, n)})()
        self.root = node(self.path)
        self.uuids = {g: uuid(self.root, g) for g in GPUS}
        self.boot = 0
        self.driver = self._start()
        self.claims: dict[str, tuple[dict, str]] = {}  # prepared: uid -> (claim, interval)
        self.live: dict[str, dict] = {}  # allocated: until their unprepare succeeds
        self.slices: dict[str, str] = {}  # GPU UUID -> what the driver runs (the log's last successful call)
        self.logged = 0
        self.failing = False
        self.awaiting = False  # a call failed: until a start or a prepare that succeeds with nvidia-smi working
        self.n = 0

    def _start(self):
        d = driver(self.path, self.root)
        d.boot_id = f"boot-{self.boot}"
        d.recover()
        self._read_log() if hasattr(self, "slices") else None
        return d

    def _read_log(self) -> None:
        """The calls since the last look: those made while nvidia-smi worked took."""
        try:
            with open(os.path.join(self.root, "usr/bin/smi.log")) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            lines = []
        for line in lines[self.logged:]:
            _, _, gpu, _, code = line.split()
            if not self.failing:
                self.slices[gpu] = code
        self.logged = len(lines)

    def _held(self) -> set[str]:
        return {r["device"] for c in self.live.values() for r in c["status"]["allocation"]["devices"]["results"]}

    @rule(data=st.data(), interval=st.sampled_from(("Short", "Medium", "Long")))
    def prepare_new(self, data, interval):
        free = [g for g in GPUS if g not in self._held()]
        if not free:
            return
        gpus = data.draw(st.lists(st.sampled_from(free), min_size=1, max_size=2, unique=True))
        self.n += 1
        c = claim(gpus, interval)
        c["metadata"].update(name=f"ts{self.n}", uid=f"00000000-0000-4000-8000-{self.n:012d}")
        self.live[c["metadata"]["uid"]] = c
        self._prepare(c["metadata"]["uid"], interval)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def prepare_again(self, data):
        uid = data.draw(st.sampled_from(list(self.live)))
        slice_ = self.live[uid]["status"]["allocation"]["devices"]["config"][0]["opaque"]["parameters"]["sharing"]
        self._prepare(uid, slice_["timeSlicingConfig"]["interval"])

    def _prepare(self, uid: str, interval: str) -> None:
        res = self.driver.prepare_claims([self.live[uid]])[uid]
        self._read_log()
        if res.error:
            assert self.failing, res.error
            self.awaiting = True
            return
        self.claims[uid] = (self.live[uid], interval)
        if not self.failing:
            self.awaiting = False

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def unprepare(self, data):
        uid = data.draw(st.sampled_from(list(self.live)))
        m = self.live[uid]["metadata"]
        errors = self.driver.unprepare_claims([ClaimRef(m["namespace"], m["name"], uid)])
        self._read_log()
        if errors[uid]:
            assert self.failing, errors[uid]
            self.awaiting = True
            return
        del self.live[uid]
        self.claims.pop(uid, None)

    @rule(on=st.booleans())
    def nvidia_smi_fails(self, on):
        for code in CODES.values():  # "fail-<last argument>": every call setting that slice fails
            path = os.path.join(self.root, "usr/bin", f"fail-{code}")
            if on:
                open(path, "w").close()
            elif os.path.exists(path):
                os.remove(path)
        self.failing = on
        self.awaiting = self.awaiting or on

    @rule()
    def agent_restarts(self):
        self.driver = self._start()
        if not self.failing:
            self.awaiting = False

    @rule()
    def node_reboots(self):
        self.slices = {}  # the driver forgets every slice
        self.boot += 1
        self.driver = self._start()
        if not self.failing:
            self.awaiting = False

    @invariant()
    def every_gpu_runs_its_claims_slice(self):
        if self.failing or self.awaiting:
            return
        wanted = {self.uuids[g]: "0" for g in GPUS}
        for uid, (c, interval) in self.claims.items():
            if (self.driver.checkpoint.claims.get(uid) or {}).get("state") != COMPLETED:
                continue
            for r in c["status"]["allocation"]["devices"]["results"]:
                wanted[self.uuids[r["device"]]] = CODES[interval]
        running = {u: self.slices.get(u, "0") for u in wanted}
        assert running == wanted, (running, wanted)

    def teardown(self):
        try:
            self.nvidia_smi_fails(False)
            self.driver = self._start()
            for uid, c in list(self.live.items()):
                m = c["metadata"]
                assert self.driver.unprepare_claims([ClaimRef(m["namespace"], m["name"], uid)]) == {uid: None}
            self._read_log()
            assert self.driver.checkpoint.claims == {}
            assert {u: self.slices.get(u, "0") for u in self.uuids.values()} == {u: "0" for u in self.uuids.values()}
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


def test_any_life_of_a_node_time_slicing_its_gpus():
    run_state_machine_as_test(TimeSliceLife, settings=settings(
        max_examples=20, stateful_step_count=12, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
