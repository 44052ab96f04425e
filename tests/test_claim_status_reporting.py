"""Claim-status write results are visible to an operator, not only in the log: the whole agent
(`sysdra run`, offline `dir:` cluster) prepares a claim for the kubelet stand-in, the claim is
replaced in the store, and the unprepare's removal is refused. `/metrics` counts it under
`sysdra_claim_status_writes_total{result="refused"}` and `sysdra status` (text and JSON) names
the claim and the reason. The real-server side (retries exhausted) is in tests/test_claim_status_writes.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from agent.cli.status import render_text
from agent.kubeletplugin import statuswriter
from agent.service.metrics import CLAIM_STATUS_RESULTS
from discovery.inventory import scan
from tests.conftest import REPO, profile_root
from tests.kubelet_standin import KubeletStandIn, claim
from tests.test_agent_service import _agent, _free_port, _stop

PROFILE = "server-2s-gpu-nic"


def _claim_status_writes(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.labels["result"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "sysdra_claim_status_writes" for s in f.samples if s.name.endswith("_total")}  # fmt: skip


def _wait_for_writes(port: int, want: dict[str, float], proc) -> dict[str, float]:
    deadline = time.monotonic() + 30
    while (got := _claim_status_writes(port)) != want:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, f"claim status writes {got}, expected {want}"
        time.sleep(0.05)
    return got


def _store(path: str, obj: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.rename(path + ".tmp", path)  # the agent never reads half a claim


def _status(kubelet_dir, *flags: str) -> str:
    out = subprocess.run([sys.executable, "-m", "agent", "status", "--kubelet-dir", str(kubelet_dir), *flags],
                         cwd=REPO, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_refused_claim_status_write_shows_in_metrics_and_sysdra_status(tmp_path):
    gpu = next(d.name for d in scan(profile_root(PROFILE)).devices if d.kind == "gpu")
    config = tmp_path / "config.yaml"
    port = _free_port()
    config.write_text(f"metrics_address: 127.0.0.1:{port}\n")
    kubelet_dir = tmp_path / "kubelet"
    cluster = str(tmp_path / "cluster")
    c = claim("train-0", [("gpu", gpu)], namespace="ml", pool="node-a")
    path = os.path.join(cluster, "resourceclaims", "ml", "train-0.json")
    zero = dict.fromkeys(CLAIM_STATUS_RESULTS, 0.0)
    proc = _agent(tmp_path, str(config), {})
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(kubelet_dir / "plugins_registry" / "sysdra.io-reg.sock"):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "no socket"
            time.sleep(0.05)
        _store(path, c)
        kubelet = KubeletStandIn(str(kubelet_dir / "plugins_registry"))

        async def call(method):
            if kubelet.info is None:
                await kubelet.register()
            resp = await getattr(kubelet, method)(c)
            assert resp.claims[c["metadata"]["uid"]].error == ""

        assert _claim_status_writes(port) == zero  # every result present from the start
        asyncio.run(call("prepare"))
        _wait_for_writes(port, dict(zero, written=1), proc)
        asyncio.run(call("prepare"))  # the kubelet's retry: the same entries, the file is not rewritten
        _wait_for_writes(port, dict(zero, written=1, unchanged=1), proc)
        assert [e["device"] for e in json.load(open(path))["status"]["devices"]] == [gpu]
        before = _status(kubelet_dir)
        assert "claim status: 1 written, 1 unchanged, 0 failed\n" in before, before

        # deleted and created again under the same name: the unprepare's removal must not touch it
        replaced = claim("train-0", [("gpu", gpu)], namespace="ml", pool="node-a")
        _store(path, replaced)
        asyncio.run(call("unprepare"))
        _wait_for_writes(port, dict(zero, written=1, unchanged=1, refused=1), proc)
        text = _status(kubelet_dir)
        doc = json.loads(_status(kubelet_dir, "-o", "json"))
    finally:
        err = _stop(proc)
    assert proc.returncode == 0, err
    assert "ml/train-0: removing status.devices not written" in err  # the log line is still there
    assert json.load(open(path)) == replaced  # nothing written to the new claim
    assert "claim status: 1 written, 1 unchanged, 1 failed (refused 1)\n" in text, text
    assert "  ml/train-0 refused " in text and "has another UID: it was replaced" in text, text
    assert "last error:   claim status: ml/train-0: ResourceClaim ml/train-0 has another UID" in text, text
    cs = doc["claimStatus"]
    assert cs["enabled"] is True and cs["failed"] == 1
    assert cs["writes"] == {"written": 1, "unchanged": 1, "refused": 1}
    (failure,) = cs["recentFailures"]
    assert (failure["namespace"], failure["name"], failure["uid"], failure["result"]) == (
        "ml", "train-0", c["metadata"]["uid"], "refused")
    assert "replaced" in failure["reason"] and doc["now"] - 30 < failure["time"] <= doc["now"]


def test_the_metric_labels_are_the_writers_results():
    assert CLAIM_STATUS_RESULTS == statuswriter.RESULTS
    assert statuswriter.FAILURES == set(CLAIM_STATUS_RESULTS) - {"written", "unchanged"}


def test_status_text_keeps_a_failure_on_one_line_and_reads_older_agents():
    doc = {"now": 1000.0, "registration": {}, "lastPublish": {},
           "claimStatus": {"enabled": True, "writes": {"written": 3, "failed": 1, "invalid": 1}, "failed": 2,
                           "recentFailures": [{"time": 990.0, "namespace": "ns", "name": "c", "result": "failed",
                                               "reason": "ConnectionError:\nreset\n\tby peer (after 8 attempts)"}]}}  # fmt: skip
    text = render_text(doc)
    assert "claim status: 3 written, 0 unchanged, 2 failed (retries exhausted 1, invalid entries 1)\n" in text
    assert "  ns/c failed 10s ago: ConnectionError: reset by peer (after 8 attempts)\n" in text
    assert "claim status: off" in render_text(dict(doc, claimStatus={"enabled": False}))
    assert "claim status" not in render_text({k: v for k, v in doc.items() if k != "claimStatus"})
