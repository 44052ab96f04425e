"""Pods on the real node (tests/realnode.py) for the tests of tests/test_realnode*.py: a module's
node (root and tools required, the host's state taken before it starts), namespaces, pods with
claims and their logs read through the API, and waits that show the node's logs when they fail."""

from __future__ import annotations

import os

from tests.conftest import require_root, require_tool
from tests.controlplane import unique, wait_until
from tests.realnode import RealNode
from tests.realnode_leftovers import HostState

METADATA = "/var/run/kubernetes.io/dra-device-attributes"
GPU_REQUEST = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.sysdra.io"}}]}}


def module_node(tmp_path_factory, name: str, *tools: str):
    """A module fixture's real node: root and the tools required, the host's state taken before
    it starts (``before``, for the module's leftover test), stopped after the module."""
    require_root()
    for tool in ("unshare", "nsenter", "runc", "busybox", *tools):
        require_tool(tool)
    before = HostState.take()
    node = RealNode(str(tmp_path_factory.mktemp(name))).start()
    node.before = before
    yield node
    node.stop()


def wait(predicate, what: str, node: RealNode, timeout: float = 90.0, log: str = "kubelet"):
    tail = lambda: f"--- {log}:\n{node.log_tail(log, 30)}\n--- agent:\n{node.log_tail('agent', 20)}"  # noqa: E731
    return wait_until(predicate, timeout, what=what, tail=tail, interval=0.25)


def namespace(node: RealNode) -> str:
    ns = unique("rn")
    node.plane.create_namespace(ns)
    node.plane.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": ns}})
    return ns


def create_pod(node: RealNode, ns: str, name: str, script: str, *, claims: list[dict] = (), limits: dict | None = None,
               scheduler: str = "default-scheduler", host_network: bool = True, annotations: dict | None = None) -> dict:  # fmt: skip
    container = {"name": "app", "image": node.image, "imagePullPolicy": "Never",
                 "command": ["sh", "-c", f"{script}; echo END; exec sleep 3600"]}  # fmt: skip
    if claims:
        container["resources"] = {"claims": [{"name": c["name"]} for c in claims]}
    if limits:
        container["resources"] = {"limits": limits}
    meta = {"name": name, "namespace": ns, **({"annotations": annotations} if annotations else {})}
    return node.plane.create({"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                              "spec": {"automountServiceAccountToken": False, "hostNetwork": host_network, "terminationGracePeriodSeconds": 1,
                                       "schedulerName": scheduler,
                                       "resourceClaims": list(claims), "containers": [container]}})  # fmt: skip


def running_log(node: RealNode, ns: str, name: str) -> list[str]:
    """The pod's log through the API (kube-apiserver → kubelet), once the script has ended."""
    return running_log_until(node, ns, name, "END")


def running_log_until(node: RealNode, ns: str, name: str, marker: str) -> list[str]:
    def log():
        pod = node.plane.get("Pod", name, ns)
        assert pod["status"].get("phase") not in ("Failed", "Succeeded"), pod["status"]
        if pod["status"].get("phase") != "Running":
            return None
        r = node.plane.request("GET", f"/api/v1/namespaces/{ns}/pods/{name}/log", ok=False)
        lines = r.text.splitlines() if r.status_code == 200 else []
        return any(line.startswith(marker) for line in lines) and lines

    return wait(log, f"pod {ns}/{name} running with its log", node)


def delete_pod(node: RealNode, ns: str, name: str) -> None:
    node.plane.delete("Pod", name, ns)
    wait(lambda: node.plane.request("GET", f"/api/v1/namespaces/{ns}/pods/{name}", ok=False).status_code == 404,
         f"pod {ns}/{name} gone", node)  # fmt: skip


def claim_specs(node: RealNode, uid: str) -> list[str]:
    return [f for f in os.listdir(node.cdi_dir) if uid in f]


def allocated(claim: dict) -> list[str]:
    return [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]]


def device_nodes(node: RealNode, device: str) -> list:
    from discovery.inventory import scan

    return next(d for d in scan(node.root).devices if d.name == device).device_nodes

