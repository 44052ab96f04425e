"""Full disk: CDI and state dirs on a 96 KiB tmpfs (private mount namespace) that fills up."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, require_root, require_tool

pytestmark = pytest.mark.slow


def test_prepare_on_a_full_disk(tmp_path, faults):
    require_root()
    unshare = require_tool("unshare")
    proc = subprocess.run([unshare, "-m", "--propagation", "private", sys.executable, "-m", "tests.faults.fulldisk_scenario",
                           str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=180)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    assert lines, f"no result (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    out = json.loads(lines[-1])
    assert proc.returncode == 0, f"{out.get('failure')}\n{out.get('log', '')}\nsteps: {out['steps']}"
    failed = len(out["errors"])
    assert failed >= 3, out["steps"]  # the failure moved through several writes
    kinds = sorted({e.split(":")[0] for e in out["errors"]})
    assert out["survived_restart"], "a claim the kubelet was told is prepared was rolled back at the restart"
    assert out["unprepare_retry_recorded"], f"unprepared claims came back at the restart: {out['resurrected']}"
    faults.add("Full disk", "prepare with the CDI + state tmpfs full, freed one page at a time",
               len(out["steps"]), f"{failed} clean per-claim 'disk full' errors ({', '.join(kinds)}), no partial file; "
               "succeeded once space was back and survived a restart")
    faults.add("Full disk", "unprepare with the disk full, then with space back", 2,
               ("error names the disk" if out["unprepare_full"] else "succeeded") + "; clean after the retry and the restart")


# --- checkpoint saves that fail, made deterministic -----------------------------------------------
def _failing_save(driver, fail_on: int):
    """Checkpoint.save raises ENOSPC on its ``fail_on``-th call (1-based), like a full disk."""
    import errno

    from agent.fsutil import WriteError

    real, calls = driver.checkpoint.save, {"n": 0}

    def save(**kw):
        calls["n"] += 1
        if calls["n"] == fail_on:
            raise WriteError(errno.ENOSPC, f"cannot write {driver.checkpoint_path}: disk full")
        real(**kw)
    driver.checkpoint.save = save


def test_checkpoint_save_failure_then_retry(tmp_path, faults):
    from agent.prepare import cdifiles
    from tests.test_checkpoint import assert_consistent, claim, make_env, new_driver

    s, state = make_env(tmp_path)
    c = claim("c", [("a", "gpu-0000-1b-00-0")])
    uid = c["metadata"]["uid"]
    d = new_driver(s, state)
    _failing_save(d, fail_on=2)  # save 1: PrepareStarted; save 2: PrepareCompleted fails
    first = d.prepare_claims([c])[uid]
    assert first.error and "disk full" in first.error  # a per-claim error, files undone
    assert cdifiles.list_claim_specs(s.cdi_dir, s.driver_name) == {}
    assert d.prepare_claims([c])[uid].error is None  # the kubelet's retry: success
    d2 = new_driver(s, state)  # restart
    assert_consistent(s, d2)
    assert uid in d2.checkpoint.claims, "a claim the kubelet was told is prepared was rolled back"
    faults.add("Full disk", "final checkpoint save fails (ENOSPC), kubelet retries, agent restarts", 1,
               "per-claim 'disk full' error with the files undone; the retry succeeds and survives the restart")


def test_unprepare_checkpoint_save_failure_then_retry(tmp_path, faults):
    from agent.kubeletplugin.types import ClaimRef
    from agent.prepare import cdifiles
    from tests.test_checkpoint import claim, make_env, new_driver

    s, state = make_env(tmp_path)
    c = claim("c", [("a", "gpu-0000-1b-00-0")])
    uid = c["metadata"]["uid"]
    ref = ClaimRef("default", "c", uid)
    d = new_driver(s, state)
    assert d.prepare_claims([c])[uid].error is None
    _failing_save(d, fail_on=1)
    first = d.unprepare_claims([ref])[uid]
    assert first and "disk full" in first  # files kept until the checkpoint says the claim is gone
    assert d.unprepare_claims([ref]) == {uid: None}  # the kubelet's retry: success
    d2 = new_driver(s, state)  # restart
    assert uid not in d2.checkpoint.claims, "an unprepared claim came back from the checkpoint"
    assert cdifiles.list_claim_specs(s.cdi_dir, s.driver_name) == {}
    faults.add("Full disk", "unprepare's checkpoint save fails (ENOSPC), kubelet retries, agent restarts", 1,
               "per-claim 'disk full' error, files kept; the retry cleans up and nothing comes back at the restart")
