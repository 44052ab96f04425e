"""The real node (tests/realnode.py, docs/real-node.md): what a claim costs a pod, and the API
requests the agent makes, counted by the real kube-apiserver's audit log (the agent's
ServiceAccount only). Needs root and the peers (``make peers``).

``realnode_pod_start_claim_p50`` / ``_p95``: a pod with a one-GPU ResourceClaim, from its create
to phase Running as the API reports it (polled every 20 ms), against the same pod without a claim
(the floor), ``PODS`` of each, alternating. Goal: a claim adds <= 100 ms at p50.
``realnode_prepare_claim_gets`` / ``realnode_prepare_status_writes``: the agent's GETs of the
claim and its writes of the claim's status between the pod's create and its Running, per pod.
Goal: one GET and at most one status apply per prepare.
``realnode_unprepare_requests``: the agent's requests about the claim from the pod's delete until
it is gone and the agent quiet, per pod. ``realnode_idle_writes``: the agent's writes in an idle
minute (goal 0); ``realnode_idle_requests`` all its requests in that minute (reported)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time

from bench.report import Figure, progress

PODS = 10
IDLE = 60.0
AGENT = "system:serviceaccount:sysdra:sysdra"
POLICY = f"""apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
- level: Metadata
  users: ["{AGENT}"]
- level: None
"""
WRITES = {"create", "update", "patch", "delete", "deletecollection"}


class Audit:
    """The audit log's events of the agent's requests, one per request (by auditID)."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0

    def mark(self) -> None:
        self.offset = os.path.getsize(self.path) if os.path.exists(self.path) else 0

    def since_mark(self) -> list[dict]:
        seen: dict[str, dict] = {}
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            for line in f:
                event = json.loads(line)
                seen.setdefault(event["auditID"], event)
        return list(seen.values())


def _claim_requests(events: list[dict], claim: str) -> tuple[int, int]:
    """(GETs of the claim, writes of its status)."""
    mine = [e for e in events if (e.get("objectRef") or {}).get("resource") == "resourceclaims" and e["objectRef"].get("name") == claim]
    gets = sum(1 for e in mine if e["verb"] == "get" and not e["objectRef"].get("subresource"))
    writes = sum(1 for e in mine if e["verb"] in WRITES)
    return gets, writes


def _pod(node, ns: str, name: str, claim: str | None) -> dict:
    container = {"name": "app", "image": node.image, "imagePullPolicy": "Never", "command": ["sleep", "3600"]}
    spec = {"automountServiceAccountToken": False, "hostNetwork": True, "terminationGracePeriodSeconds": 0, "containers": [container]}
    if claim:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
        container["resources"] = {"claims": [{"name": "gpu"}]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns}, "spec": spec}


def _wait(probe, timeout: float = 60.0, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if probe():
            return
        time.sleep(interval)
    raise RuntimeError("bench_realnode: timed out")


def _start_to_running(node, ns: str, name: str, claim: str | None) -> float:
    t0 = time.monotonic()
    node.plane.create(_pod(node, ns, name, claim))
    _wait(lambda: node.plane.get("Pod", name, ns)["status"].get("phase") == "Running")
    return (time.monotonic() - t0) * 1000


def _delete(node, ns: str, name: str) -> None:
    node.plane.delete("Pod", name, ns)
    _wait(lambda: node.plane.request("GET", f"/api/v1/namespaces/{ns}/pods/{name}", ok=False).status_code == 404)


def _measure(node, audit: Audit) -> dict:
    ns = "bench"
    node.plane.create_namespace(ns)
    node.plane.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": ns}})
    request = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.sysdra.io"}}]}}
    out = {"claim": [], "plain": [], "gets": [], "status": [], "unprepare": []}
    for i in range(PODS):
        out["plain"].append(_start_to_running(node, ns, f"plain-{i}", None))
        _delete(node, ns, f"plain-{i}")
        claim = f"gpu-{i}"
        node.plane.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": claim, "namespace": ns},
                           "spec": request})  # fmt: skip
        audit.mark()
        out["claim"].append(_start_to_running(node, ns, f"claim-{i}", claim))
        time.sleep(1.0)  # the status writer writes after a pause in the kubelet's calls
        gets, writes = _claim_requests(audit.since_mark(), claim)
        out["gets"].append(gets)
        out["status"].append(writes)
        audit.mark()
        _delete(node, ns, f"claim-{i}")
        time.sleep(1.0)
        out["unprepare"].append(sum(_claim_requests(audit.since_mark(), claim)))
        node.plane.delete("ResourceClaim", claim, ns)
        progress(f"real node: pod {i + 1}/{PODS}: claim {out['claim'][-1]:.0f} ms, plain {out['plain'][-1]:.0f} ms")
    audit.mark()
    progress(f"real node: idle for {IDLE:.0f} s")
    time.sleep(IDLE)
    idle = audit.since_mark()
    out["idle_writes"] = sum(1 for e in idle if e["verb"] in WRITES)
    out["idle_requests"] = len(idle)
    return out


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def run() -> list[Figure]:
    if os.geteuid() != 0:
        progress("bench_realnode: needs root (the real node): not measured")
        return []
    from tests.realnode import RealNode

    tmp = tempfile.mkdtemp(prefix="sysdra-bench-realnode-")
    policy = os.path.join(tmp, "audit-policy.yaml")
    with open(policy, "w") as f:
        f.write(POLICY)
    log = os.path.join(tmp, "audit.log")
    node = RealNode(os.path.join(tmp, "node"), apiserver_args=[f"--audit-policy-file={policy}", f"--audit-log-path={log}"])
    try:
        node.start()
        m = _measure(node, Audit(log))
    finally:
        node.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    p50, p95 = _p(m["claim"], 50), _p(m["claim"], 95)
    f50, f95 = _p(m["plain"], 50), _p(m["plain"], 95)
    gets, status = statistics.mean(m["gets"]), statistics.mean(m["status"])
    return [
        Figure("realnode_pod_start_claim_p50", p50, "ms", f50, "claim adds <= 100 ms", p50 - f50 <= 100),
        Figure("realnode_pod_start_claim_p95", p95, "ms", f95, "reported", True),
        Figure("realnode_prepare_claim_gets", gets, "per prepare", None, "1", max(m["gets"]) <= 1),
        Figure("realnode_prepare_status_writes", status, "per prepare", None, "<= 1", max(m["status"]) <= 1),
        Figure("realnode_unprepare_requests", statistics.mean(m["unprepare"]), "per unprepare", None, "reported", True),
        Figure("realnode_idle_writes", m["idle_writes"], "per minute", None, "0", m["idle_writes"] == 0),
        Figure("realnode_idle_requests", m["idle_requests"], "per minute", None, "reported", True),
    ]
