"""One claim's failure stays its own (issue 42 item 3): a failure injected at each stage of
preparing one claim of a batch of three (decoding it, planning, each host-change step, its
spec, its metadata, its status) is that claim's error; the other two are prepared, and nothing
of the failed one is left: no spec, no checkpoint entry, its VF back on its driver."""

from __future__ import annotations

import pytest

from agent.prepare import cdifiles, claimstatus, planner
from agent.prepare import driver as driver_mod
from agent.prepare.metadata import store as metadata
from agent.prepare.steps.vfio import VfioStep
from tests.kubelet_standin import claim
from tests.test_vfio import PF, VF, VF2, VF_BDF, node, vfio_claim  # noqa: F401 - node is a fixture

BAD = "00000000-0000-4000-8000-0000000bad00"
GOOD = ("00000000-0000-4000-8000-00000000600d", "00000000-0000-4000-8000-00000001600d")

# (where, function name, is it the bad claim's call?)
STAGES = {
    "decoding the allocation": (driver_mod, "our_results", lambda a, k: a[0]["metadata"]["uid"] == BAD),
    "decoding the config": (driver_mod, "opaque_configs", lambda a, k: a[0]["metadata"]["uid"] == BAD),
    "planning the VFIO step": (VfioStep, "plan", lambda a, k: a[1].uid == BAD),
    "mapping devices": (planner, "devices_and_spec", lambda a, k: a[3] == BAD),
    "planning metadata": (metadata, "plan", lambda a, k: a[1]["metadata"]["uid"] == BAD),
    "building the status": (claimstatus, "build_for", lambda a, k: BAD in a[1][0].cdi_ids[0]),
    "applying the VFIO step": (VfioStep, "apply", lambda a, k: a[1].uid == BAD),
    "writing the spec": (cdifiles, "write_spec", lambda a, k: BAD in a[0]),
    "writing metadata": (metadata, "write_claim", lambda a, k: a[1] == BAD),
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_failure_at_any_stage_is_that_claims_error(node, monkeypatch, stage):  # noqa: F811
    s, sim, state, driver = node
    where, name, mine = STAGES[stage]
    real = getattr(where, name)
    hit = []

    def failing(*args, **kwargs):
        if mine(args, kwargs):
            hit.append(stage)
            raise RuntimeError(f"injected at {stage}")
        return real(*args, **kwargs)

    monkeypatch.setattr(where, name, failing)
    d = driver()
    claims = [claim("good-a", [("net", VF2)], uid=GOOD[0]), vfio_claim("bad", [VF], BAD), claim("good-b", [("net", PF)], uid=GOOD[1])]
    out = d.prepare_claims(claims)
    assert hit == [stage], "the failure was not injected: the test shows nothing"
    assert out[BAD].error and f"injected at {stage}" in out[BAD].error and "internal error" in out[BAD].error
    for uid in GOOD:
        assert out[uid].error is None, out[uid].error
        assert uid in d.checkpoint.claims
        cdifiles.read_spec(cdifiles.claim_spec_path(s.cdi_dir, s.driver_name, uid))
    assert BAD not in d.checkpoint.claims
    assert not any(BAD in f for f in cdifiles.list_claim_specs(s.cdi_dir, s.driver_name).values())
    assert sim.driver(VF_BDF) == "mlx5_core" and sim.override(VF_BDF) is None
    monkeypatch.undo()
    assert d.prepare_claims([vfio_claim("bad", [VF], BAD)])[BAD].error is None  # the retry works
    assert sim.driver(VF_BDF) == "vfio-pci"
