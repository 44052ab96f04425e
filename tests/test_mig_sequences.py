"""Dynamic MIG over any sequence a node lives through: claims allocated by the scheduler's
allocator around the ones it still holds, prepared, prepared again, unprepared, the agent
restarted, the node rebooted, and NVML refusing one call anywhere (tests/simnvml_mig.py, the
H200's real profile table). Hypothesis draws the sequences (stateful testing, deterministic).
The agent manages MIG mode (``nvidia_mig_enable``): a claim of the whole GPU turns it off.

What must hold after every step: each GPU instance on the GPU is one a checkpoint entry
records (nothing made is left without an owner); each prepared claim's instances exist and its
CDI spec is on disk (but for one whose instance a start could not make again, or whose unprepare
failed half-way: the kubelet's retry or re-prepare makes it whole); a claim the model calls prepared is
``PrepareCompleted``. And at the end,
NVML working again and every claim unprepared, as the kubelet does when its pods are gone: no
instance, no spec, no entry."""

from __future__ import annotations

import os
import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from agent.prepare.checkpoint_format import COMPLETED
from tests.controlplane_allocator import Unschedulable
from tests.mig_node import MigNode, profile, req, whole
from tests.simnvml import NVMLError
from tests.test_mig_prepare import driver_for, ref

PROFILES = ("1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb", "whole")
# the NVML calls a prepare, an unprepare or a start-up makes to the GPU
REFUSABLE = ("nvmlDeviceCreateGpuInstanceWithPlacement", "nvmlGpuInstanceCreateComputeInstance",
             "nvmlGpuInstanceDestroy", "nvmlComputeInstanceDestroy")


class MigNodeLife(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="sysdra-mig-life-")
        self.node = MigNode(self.tmp, nvidia_mig_enable=True)
        self.driver = driver_for(self.node)
        self.driver.recover()
        self.live: dict[str, dict] = {}  # allocated claims: until their unprepare succeeds
        self.prepared: dict[str, list[str]] = {}  # uid -> the devices its last successful prepare gave
        self.awaiting: set[str] = set()  # prepared claims a start or an unprepare left half: until their next prepare
        self.refusals = 0  # NVML calls refused so far
        self.boots = 0
        self.n = 0

    def _refuse_next(self, method: str) -> None:
        sim = self.node.sim
        real = getattr(type(sim), method)

        def refuse(*args, **kwargs):
            del sim.__dict__[method]  # once
            self.refusals += 1
            raise NVMLError(999)  # NVML_ERROR_UNKNOWN

        setattr(sim, method, refuse)
        assert real is not None

    def _may_fail(self, call):
        """``call()``'s result, and whether an NVML refusal happened meanwhile (an error is then allowed)."""
        before = self.refusals
        return call(), self.refusals > before

    # --- the kubelet's calls ---

    @rule(kind=st.sampled_from(PROFILES), count=st.integers(1, 2))
    def prepare_new(self, kind, count):
        self.n += 1
        request = req("m", whole() if kind == "whole" else profile(kind), count=1 if kind == "whole" else count)
        try:
            c = self.node.allocated(f"c{self.n}", request, prepared=list(self.live.values()))
        except Unschedulable:
            return  # no room beside the claims the node holds
        uid = c["metadata"]["uid"]
        self.live[uid] = c
        self._prepare(uid)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def prepare_again(self, data):
        self._prepare(data.draw(st.sampled_from(list(self.live))))

    def _prepare(self, uid: str) -> None:
        res, refused = self._may_fail(lambda: self.driver.prepare_claims([self.live[uid]])[uid])
        if res.error:
            assert refused, res.error
            assert uid not in self.prepared or self.driver.checkpoint.claims[uid]["state"] == COMPLETED, res.error
            return
        self.awaiting.discard(uid)
        devices = sorted(r.device for r in res.devices)
        assert self.prepared.get(uid, devices) == devices  # prepared again: the same devices
        self.prepared[uid] = devices

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def unprepare(self, data):
        uid = data.draw(st.sampled_from(list(self.live)))
        errors, refused = self._may_fail(lambda: self.driver.unprepare_claims([ref(self.live[uid])]))
        if errors[uid]:
            assert refused, errors[uid]
            self.awaiting.add(uid)  # half undone: its unprepare is retried (or a re-prepare makes it whole)
            return
        del self.live[uid]
        self.prepared.pop(uid, None)
        self.awaiting.discard(uid)

    # --- the node ---

    @rule(method=st.sampled_from(REFUSABLE))
    def nvml_refuses_its_next_call(self, method):
        self._refuse_next(method)

    @rule()
    def agent_restarts(self):
        self._start(self.driver.boot_id)

    @rule()
    def node_reboots(self):
        self.node.sim.reboot()
        self.boots += 1
        self._start(f"boot-{self.boots}")

    def _start(self, boot_id: str) -> None:
        self.driver = driver_for(self.node)
        self.driver.boot_id = boot_id
        _, refused = self._may_fail(self.driver.recover)
        if refused:
            self.awaiting |= set(self.prepared)

    # --- what holds after every step ---

    def _recorded(self) -> set[tuple[int, int]]:
        return {(m["profile"], m["start"]) for e in self.driver.checkpoint.claims.values() for m in e.get("mig") or ()}

    @invariant()
    def every_instance_has_an_owner(self):
        made = {(g["profile"], g["start"]) for g in self.node.sim.instances().values()}
        assert made <= self._recorded(), (made, self.driver.checkpoint.claims)

    @invariant()
    def prepared_claims_have_their_instances_and_specs(self):
        made = {(g["profile"], g["start"]) for g in self.node.sim.instances().values()}
        for uid in self.prepared:
            entry = self.driver.checkpoint.claims.get(uid)
            if uid in self.awaiting:
                continue
            if entry is None or entry["state"] != COMPLETED:
                # a prepare again refused half-way may undo the claim: then it is not prepared (the kubelet retries)
                assert uid in self.live
                continue
            assert {(m["profile"], m["start"]) for m in entry.get("mig") or ()} <= made, (uid, entry, made)
            assert os.path.exists(self.driver._spec_path(uid))

    def teardown(self):
        try:
            for method in REFUSABLE:
                self.node.sim.__dict__.pop(method, None)  # NVML works again
            self.driver = driver_for(self.node)
            self.driver.recover()
            for uid, c in list(self.live.items()):
                assert self.driver.unprepare_claims([ref(c)]) == {uid: None}
            assert self.node.sim.instances() == {}
            assert self.driver.checkpoint.claims == {}
            cdi = self.node.settings.cdi_dir
            assert not os.path.isdir(cdi) or not [n for n in os.listdir(cdi) if "claim_" in n]
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


def test_any_life_of_a_dynamic_mig_node():
    run_state_machine_as_test(MigNodeLife, settings=settings(
        max_examples=100, stateful_step_count=25, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
