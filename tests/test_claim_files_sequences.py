"""A claim's files over any sequence a node lives through, for GPUs and NICs together (no host
change: the files are the whole prepare here): claims of one or two free devices prepared,
prepared again, unprepared, the agent restarted, its checkpoint lost (a damaged file, a wiped
plugin dir), the CDI spec of a claim removed by hand. Hypothesis draws the sequences
(stateful testing, deterministic).

What must hold after every step: a prepared claim has its CDI spec, whose devices are the claim's,
and its KEP-5304 metadata; the kubelet's prepare of a prepared claim answers the same CDI IDs as
its first. At the end, every claim unprepared: no spec, no metadata, no entry."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from agent.kubeletplugin.types import ClaimRef
from agent.prepare.driver import Driver
from discovery.inventory import scan
from tests.conftest import profile_root
from tests.kubelet_standin import claim, settings_for

PROFILE = "server-2s-gpu-nic"
DEVICES = ("gpu-0000-18-00-0", "gpu-0000-19-00-0", "nic-0000-1a-00-0", "nic-0000-3c-00-0")


def _ref(c: dict) -> ClaimRef:
    m = c["metadata"]
    return ClaimRef(namespace=m["namespace"], name=m["name"], uid=m["uid"])


def _files(base: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), base) for d, _, fs in os.walk(base) for f in fs) if os.path.isdir(base) else []


class ClaimFilesLife(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="sysdra-files-life-")
        self.settings = settings_for(self.tmp, root=profile_root(PROFILE))
        self.inv = scan(profile_root(PROFILE))
        self.driver = self._start()
        self.claims: dict[str, dict] = {}  # prepared: uid -> claim
        self.ids: dict[str, list[str]] = {}  # uid -> the CDI IDs its first prepare answered
        self.removed: set[str] = set()  # claims whose spec was removed by hand: until a start or their prepare again
        self.n = 0

    def _start(self) -> Driver:
        d = Driver(self.settings, lambda: self.inv)
        d.recover()
        return d

    def _held(self) -> set[str]:
        return {r["device"] for c in self.claims.values() for r in c["status"]["allocation"]["devices"]["results"]}

    @rule(data=st.data())
    def prepare_new(self, data):
        free = [d for d in DEVICES if d not in self._held()]
        if not free:
            return
        picked = data.draw(st.lists(st.sampled_from(free), min_size=1, max_size=2, unique=True))
        self.n += 1
        c = claim(f"c{self.n}", [(f"r{i}", d) for i, d in enumerate(picked)], namespace=data.draw(st.sampled_from(("ml", "web"))))
        res = self.driver.prepare_claims([c])[c["metadata"]["uid"]]
        assert not res.error, res.error
        uid = c["metadata"]["uid"]
        self.claims[uid] = c
        self.ids[uid] = sorted(i for r in res.devices for i in r.cdi_ids)

    @precondition(lambda self: self.claims)
    @rule(data=st.data())
    def prepare_again(self, data):
        uid = data.draw(st.sampled_from(list(self.claims)))
        res = self.driver.prepare_claims([self.claims[uid]])[uid]
        assert not res.error, res.error
        assert sorted(i for r in res.devices for i in r.cdi_ids) == self.ids[uid]
        self.removed.discard(uid)

    @precondition(lambda self: self.claims)
    @rule(data=st.data())
    def unprepare(self, data):
        uid = data.draw(st.sampled_from(list(self.claims)))
        assert self.driver.unprepare_claims([_ref(self.claims.pop(uid))]) == {uid: None}
        self.ids.pop(uid)
        self.removed.discard(uid)

    @rule()
    def agent_restarts(self):
        self.driver = self._start()
        self.removed.clear()

    @precondition(lambda self: self.claims)
    @rule(data=st.data())
    def spec_removed_by_hand(self, data):
        uid = data.draw(st.sampled_from(list(self.claims)))
        os.remove(self.driver._spec_path(uid)) if os.path.exists(self.driver._spec_path(uid)) else None
        self.removed.add(uid)

    @rule(how=st.sampled_from(("damaged", "wiped")))
    def checkpoint_lost_then_restart(self, how):
        if how == "wiped":
            shutil.rmtree(self.settings.plugin_dir, ignore_errors=True)
        else:
            os.makedirs(self.settings.plugin_dir, exist_ok=True)
            with open(os.path.join(self.settings.plugin_dir, "checkpoint.json"), "wb") as f:
                f.write(b'{"v": [truncated')
        self.driver = self._start()  # (a claim whose spec went too is known no more: the kubelet's prepare again makes it anew)

    @invariant()
    def prepared_claims_have_their_files(self):
        for uid, c in self.claims.items():
            if uid in self.removed:
                continue
            with open(self.driver._spec_path(uid)) as f:
                spec = json.load(f)
            named = sorted(d["name"] for d in spec["devices"])
            wanted = sorted(f"{uid}-{r['device']}" for r in c["status"]["allocation"]["devices"]["results"])
            assert named == wanted, (named, wanted)
        metadata = " ".join(_files(self.settings.plugin_dir) + _files(self.settings.cdi_dir))
        for uid, c in self.claims.items():
            assert uid in self.removed or f"{c['metadata']['namespace']}_{c['metadata']['name']}" in metadata or uid in metadata

    def teardown(self):
        try:
            self.driver = self._start()
            for uid, c in list(self.claims.items()):
                assert self.driver.unprepare_claims([_ref(c)]) == {uid: None}
            assert self.driver.checkpoint.claims == {}
            left = [f for f in _files(self.settings.cdi_dir) + _files(self.settings.plugin_dir)
                    if "claim" in f or "metadata" in f]
            assert not left, left
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


def test_any_life_of_a_claims_files():
    run_state_machine_as_test(ClaimFilesLife, settings=settings(
        max_examples=80, stateful_step_count=20, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
