"""The floor on the real node (tests/realnode.py): ``tests/peers/draplugin``, a minimal DRA
kubelet plugin on the upstream Go helper (``k8s.io/dynamic-resource-allocation/kubeletplugin``
v0.37.2), registered on the same kubelet beside the agent under a driver name and DeviceClass of
its own. ``make bench`` (bench/bench_realnode.py) measures sysdra against it in one run.

It offers one device, and gives each claim a CDI spec with the edits sysdra gave a one-GPU claim
of the same node (``device_file``), so both write specs of one shape; it runs as a ServiceAccount
of its own (``system:serviceaccount:sysdra:floor``), so the API server's audit log tells its
requests from the agent's.
"""

from __future__ import annotations

import json
import os
import subprocess

from tests.controlplane import peer

DRIVER = "floor.sysdra.test"
DEVICE_CLASS = "gpu.floor.sysdra.test"
USER = "system:serviceaccount:sysdra:floor"
_LABELS = {"app.kubernetes.io/name": "sysdra-floor"}


def objects() -> list[dict]:
    """Its ServiceAccount, what the helper needs (the claim GET, its slices, the Node's UID),
    and its DeviceClass."""
    rules = [
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"],
         "verbs": ["get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"]},
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
    ]  # fmt: skip
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "floor", "namespace": "sysdra", "labels": _LABELS}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "sysdra-floor", "labels": _LABELS},
         "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": "sysdra-floor", "labels": _LABELS},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "sysdra-floor"},
         "subjects": [{"kind": "ServiceAccount", "name": "floor", "namespace": "sysdra"}]},
        {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": DEVICE_CLASS, "labels": _LABELS},
         "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]}},
    ]  # fmt: skip


def device_file(spec: dict, name: str = "gpu-0") -> dict:
    """The floor's device from the CDI spec sysdra wrote for a claim of one GPU: that device's
    edits, and the claim-wide ones without the claim's UID (the floor adds its own claim's)."""
    if len(spec.get("devices") or []) != 1:
        raise ValueError("device_file: a spec of a one-device claim is needed")
    claim_edits = dict(spec.get("containerEdits") or {})
    claim_edits["env"] = [e for e in claim_edits.get("env", []) if not e.startswith("SYSDRA_CLAIM_UID=")]
    device_edits = spec["devices"][0]["containerEdits"]
    bdf = next((e.split("=", 1)[1] for e in device_edits.get("env", []) if e.startswith("SYSDRA_DEVICE_")), "")
    attributes = {"type": {"string": "gpu"}, "resource.kubernetes.io/pciBusID": {"string": bdf}}
    return {"name": name, "attributes": attributes, "deviceEdits": device_edits, "claimEdits": claim_edits}


def start(node, device: dict, *, name: str = "floor", timeout: float = 60.0) -> subprocess.Popen:
    """The floor beside the agent: same kubelet and CDI directories, in the node's mount
    namespace; returns once its slice is published and the kubelet registered it."""
    node.plane.apply(objects())
    path = os.path.join(node.dir, f"{name}-device.json")
    with open(path, "w") as f:
        json.dump(device, f)
    token = node.plane.token("sysdra", "floor", node=node.name, seconds=86400)
    kubeconfig = node.plane.write_kubeconfig(os.path.join(node.dir, f"{name}.kubeconfig"), token=token, namespace="sysdra")
    proc = node._spawn(name, [*node.enter, peer("draplugin"), f"--driver-name={DRIVER}", f"--node-name={node.name}",
                              f"--kubeconfig={kubeconfig}", f"--kubelet-dir={node.kubelet_dir}", f"--cdi-dir={node.cdi_dir}",
                              f"--device={path}"])  # fmt: skip
    node._until(lambda: slices(node) and registered(node, name), "the floor published and registered", timeout, proc, name)
    return proc


def slices(node) -> list[dict]:
    return node.plane.list("ResourceSlice", fields={"spec.nodeName": node.name, "spec.driver": DRIVER})


def registered(node, name: str = "floor") -> bool:
    try:
        with open(os.path.join(node.dir, f"{name}.log"), errors="replace") as f:
            return '"registered with the kubelet" registered=true' in f.read()
    except OSError:
        return False


def spec_path(node, uid: str) -> str:
    return os.path.join(node.cdi_dir, f"k8s.{DRIVER}-claim_{uid}.json")
