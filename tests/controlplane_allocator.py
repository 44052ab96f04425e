"""The scheduler's own DRA allocator (tests/peers/allocator, k8s.io/dynamic-resource-allocation
v1.37.2): ``allocate`` runs it on slices + classes + claims for a node, as kube-scheduler would
(docs/control-plane.md, "The allocator")."""

from __future__ import annotations

import json
import subprocess
import uuid

from tests.controlplane_peers import peer


class Unschedulable(AssertionError):
    pass


def claim_from(obj: dict, name: str | None = None) -> dict:
    """A ResourceClaim from a ResourceClaim or a ResourceClaimTemplate (what the
    resourceclaim controller would create from it for a pod)."""
    if obj["kind"] == "ResourceClaimTemplate":
        meta = obj["metadata"]
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": name or meta["name"], "namespace": meta.get("namespace", "default"), "uid": str(uuid.uuid4())},
                "spec": obj["spec"]["spec"]}  # fmt: skip
    claim = json.loads(json.dumps(obj))
    claim.setdefault("metadata", {}).setdefault("uid", str(uuid.uuid4()))
    claim.pop("status", None)
    return claim


def allocate(slices: list[dict], classes: list[dict], claims: list[dict] | dict, *, node: str | dict,
             allocated: list[dict] = (), features: dict[str, bool] | None = None, timeout: float = 60) -> list[dict]:  # fmt: skip
    """The allocation results (``status.allocation`` per claim, in order) the scheduler's
    allocator computes for ``claims`` on ``node``. Raises ``Unschedulable`` when they do not fit."""
    doc: dict = {
        "resourceSlices": list(slices), "deviceClasses": list(classes),
        "claims": [claims] if isinstance(claims, dict) else list(claims), "allocatedClaims": list(allocated),
    }  # fmt: skip
    doc["node" if isinstance(node, dict) else "nodeName"] = node
    if features:
        doc["features"] = features
    out = run_allocator(doc, timeout=timeout)
    if out.get("unschedulable"):
        raise Unschedulable(out["reason"])
    return [r["allocation"] for r in out["results"]]


def run_allocator(doc: dict, timeout: float = 60) -> dict:
    proc = subprocess.run([peer("allocator")], input=json.dumps(doc), capture_output=True, text=True, timeout=timeout)
    try:
        out = json.loads(proc.stdout)
    except ValueError:
        raise RuntimeError(f"allocator exited {proc.returncode} without JSON: {proc.stderr[-2000:]}") from None
    if proc.returncode not in (0, 2) or "error" in out:
        raise RuntimeError(f"allocator: {out.get('error')} (exit {proc.returncode}) {proc.stderr[-2000:]}")
    return out


def with_allocation(claim: dict, allocation: dict) -> dict:
    """The claim as the scheduler leaves it: status.allocation set."""
    claim = json.loads(json.dumps(claim))
    claim["status"] = {"allocation": allocation}
    return claim
