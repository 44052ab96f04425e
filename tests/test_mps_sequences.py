"""MPS shares over any sequence a node lives through (tests/test_mps_prepare.py has the single
cases): share claims of two GPUs allocated by the scheduler's allocator beside the shares the
node holds, prepared, prepared again, unprepared, the agent restarted, a daemon killed, the
daemon's start refused once (the fixture node's simulated nvidia-cuda-mps-control). Hypothesis
draws the sequences (stateful testing, deterministic).

What must hold after every step: a daemon runs only for a GPU that has a prepared share (none is
left behind: it holds the GPU's memory and, with nvidia_mps_exclusive, its compute mode); and a
GPU with a prepared share has its daemon, but after a kill or a refused start, until the next
start or prepare of one of its shares (the kubelet's retry; the supervisor in the running agent).
At the end, every claim unprepared: no daemon, no daemon process."""

from __future__ import annotations

import os
import shutil
import tempfile

import psutil
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from agent.kubeletplugin.types import ClaimRef
from agent.prepare.checkpoint_format import COMPLETED
from agent.prepare.driver import Driver
from agent.prepare.mps_process import LaunchError
from agent.prepare.mps_records import mounts_below
from agent.publish.sharing import share_plan
from discovery.inventory import scan
from tests.conftest import _unmount_mps_shm, profile_root
from tests.controlplane_allocator import Unschedulable, allocate, with_allocation
from tests.kubelet_standin import settings_for
from tests.test_allocator import CLASSES, NODE, published
from tests.test_sharing_allocator import devices, kind
from tests.test_sharing_prepare import memory_claim

PROFILE = "server-2s-gpu-nic"


def _two_gpus(slices: list[dict]) -> list[dict]:
    keep = sorted(n for n, d in devices(slices).items() if kind(d) == "gpu")[:2]
    for s in slices:
        s["spec"]["devices"] = [d for d in s["spec"].get("devices", []) if kind(d) != "gpu" or d["name"] in keep]
    return slices


class MpsNodeLife(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="sysdra-mps-life-")
        self.settings = settings_for(self.tmp, root=profile_root(PROFILE), node_name=NODE, share=("gpu",))
        self.inv = scan(profile_root(PROFILE))
        self.slices = _two_gpus(published(PROFILE, share=share_plan(("gpu",), None)))
        self.uuids = {d.name: d.gpu.nvidia_uuid for d in self.inv.devices if d.gpu is not None}
        self.driver = self._start()
        self.live: dict[str, dict] = {}  # allocated claims: until their unprepare succeeds
        self.prepared: set[str] = set()
        self.awaiting: set[str] = set()  # GPU UUIDs whose daemon may be down until a start or a prepare
        self.refused = 0
        self.n = 0

    def _start(self) -> Driver:
        d = Driver(self.settings, lambda: self.inv)
        d.recover()
        return d

    def _gpu_of(self, uid: str) -> str:
        (r,) = self.live[uid]["status"]["allocation"]["devices"]["results"]
        return self.uuids[r["device"]]

    def _running(self) -> dict[str, int]:
        mps = self.driver.nvidia.mps
        return {u: r.pid for u, r in mps.state.daemons.items() if mps.alive(r)}

    @rule(memory=st.sampled_from(("4Gi", "16Gi", "40Gi")))
    def prepare_new(self, memory):
        self.n += 1
        c = memory_claim(f"s{self.n}", memory)
        c["metadata"]["uid"] = f"00000000-0000-4000-8000-{self.n:012d}"
        try:
            (a,) = allocate(self.slices, CLASSES, c, node=NODE, allocated=list(self.live.values()))
        except Unschedulable:
            return
        c = with_allocation(c, a)
        self.live[c["metadata"]["uid"]] = c
        self._prepare(c["metadata"]["uid"])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def prepare_again(self, data):
        self._prepare(data.draw(st.sampled_from(list(self.live))))

    def _prepare(self, uid: str) -> None:
        before = self.refused
        res = self.driver.prepare_claims([self.live[uid]])[uid]
        if res.error:
            assert self.refused > before, res.error
            return
        self.prepared.add(uid)
        self.awaiting.discard(self._gpu_of(uid))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def unprepare(self, data):
        uid = data.draw(st.sampled_from(list(self.live)))
        m = self.live[uid]["metadata"]
        errors = self.driver.unprepare_claims([ClaimRef(namespace=m["namespace"], name=m["name"], uid=uid)])
        assert errors == {uid: None}, errors
        del self.live[uid]
        self.prepared.discard(uid)

    @rule()
    def agent_restarts(self):
        self.driver = self._start()
        self.awaiting.clear()

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def a_daemon_dies(self, data):
        uuid, pid = data.draw(st.sampled_from(sorted(self._running().items())))
        p = psutil.Process(pid)
        p.kill()
        p.wait(5)
        self.awaiting.add(uuid)

    @rule()
    def the_next_daemon_start_fails(self):
        launcher = self.driver.nvidia.mps.launcher

        def refuse(*args, **kwargs):
            del launcher.__dict__["launch"]  # once
            self.refused += 1
            raise LaunchError("starting nvidia-cuda-mps-control: refused (test)")  # (the launchers' own error)

        launcher.launch = refuse

    @invariant()
    def no_daemon_without_a_share(self):
        wanted = {self._gpu_of(u) for u in self.prepared
                  if (self.driver.checkpoint.claims.get(u) or {}).get("state") == COMPLETED}
        running = set(self._running())
        assert running <= wanted | {self._gpu_of(u) for u in self.live}, (running, wanted)
        assert wanted - self.awaiting <= running, (wanted, self.awaiting, running)

    def teardown(self):
        try:
            self.driver = self._start()
            for uid, c in list(self.live.items()):
                m = c["metadata"]
                assert self.driver.unprepare_claims([ClaimRef(namespace=m["namespace"], name=m["name"], uid=uid)]) == {uid: None}
            pids = [r.pid for r in self.driver.nvidia.mps.state.daemons.values()]
            assert self._running() == {} and self.driver.checkpoint.claims == {}
            assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
            assert mounts_below(self.tmp) == []  # no daemon's shm tmpfs left
        finally:
            for r in self.driver.nvidia.mps.state.daemons.values():
                if psutil.pid_exists(r.pid):
                    psutil.Process(r.pid).kill()
            _unmount_mps_shm(self.tmp)  # (a failure must not leave mounts on the machine)
            shutil.rmtree(self.tmp, ignore_errors=True)
            assert os.path.isdir(profile_root(PROFILE))


def test_any_life_of_a_node_sharing_gpus_through_mps():
    run_state_machine_as_test(MpsNodeLife, settings=settings(
        max_examples=45, stateful_step_count=16, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
