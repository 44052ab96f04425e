"""The real node of the chart's tests (tests/test_helm_realnode.py): tests/realnode.py without
deploy/'s manifests and the agent process, which the chart brings, and an API server that admits
system-critical pods as GKE does; the agent's two image tags, the chart's values for the node,
``helm`` against it, and the agent pods, their logs and the claims' pods.

The node's pods reach the API server only on 127.0.0.1 (no kube-proxy, no CNI but loopback):
the DaemonSet runs on the host network here, KUBERNETES_SERVICE_HOST pointed at the server."""

from __future__ import annotations

import os
from urllib.parse import urlparse

import yaml

from tests.controlplane import wait_until
from tests.helm import helm
from tests.podman import build_agent_image
from tests.realnode import RealNode
from tests.realnode_pods import GPU_REQUEST

VERSION, NEXT = "0.1.0", "0.1.0-next"

# GKE's policy for the system-critical priority classes (the ResourceQuota admission's
# limitedResources): their pods only in namespaces with a quota that covers them
CRITICAL_PODS_ONLY_WITH_A_QUOTA = {
    "apiVersion": "apiserver.config.k8s.io/v1", "kind": "AdmissionConfiguration",
    "plugins": [{"name": "ResourceQuota", "configuration": {
        "apiVersion": "apiserver.config.k8s.io/v1", "kind": "ResourceQuotaConfiguration",
        "limitedResources": [{"resource": "pods", "matchScopes": [
            {"scopeName": "PriorityClass", "operator": "In", "values": ["system-node-critical", "system-cluster-critical"]}]}]}}],
}  # fmt: skip


class HelmNode(RealNode):
    """The real node without deploy/'s manifests and the agent process: the chart brings both.
    The runtime's CDI dir is the node's /var/run/cdi (the chart's default), which is ``cdi_dir``
    outside the node's mount namespace. Its API server admits system-critical pods as GKE does."""

    def __post_init__(self):
        super().__post_init__()
        self.cdi_dir = os.path.join(self.dir, "ns", "run", "cdi")
        config = os.path.join(self.dir, "admission.yaml")
        with open(config, "w") as f:
            yaml.safe_dump(CRITICAL_PODS_ONLY_WITH_A_QUOTA, f)
        self.apiserver_args = [*self.apiserver_args, f"--admission-control-config-file={config}"]

    def _apply_deploy(self) -> None:
        pass

    def start_agent(self, *args, **kwargs):
        return None


def build_images(out: str) -> list[str]:
    archives = []
    for tag in (VERSION, NEXT):
        build_agent_image(out, tag)
        archives.append(os.path.join(out, f"sysdra-{tag}.oci.tar"))
    return archives


def write_values(node: RealNode) -> str:
    """The chart's values for this node: the fixture's sysfs and procfs, its NVIDIA driver (the
    fixture root is the driver root, and where the runtime finds the driver files), the host
    network (above)."""
    values = {
        "hostPaths": {"sys": os.path.join(node.root, "sys"), "proc": os.path.join(node.root, "proc"), "dev": "/dev"},
        "nvidia": {"enabled": True, "hostDriverRoot": node.root},
        "config": {"cdiHostRoot": node.root},
        "hostNetwork": True,
        "metrics": {"enabled": False},
        "nri": {"socket": node.nri_socket},  # the node's containerd's; the pods' namespaces at the default
        "extraEnv": [{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
                     {"name": "KUBERNETES_SERVICE_PORT", "value": str(urlparse(node.plane.url).port)}],
    }  # fmt: skip
    path = os.path.join(node.dir, "values.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(values, f)
    return path


def run_helm(node: RealNode, *args: str) -> str:
    result = helm(*args, "--kubeconfig", node.plane.kubeconfig, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def wait(predicate, what: str, node: RealNode, timeout: float = 120.0):
    return wait_until(predicate, timeout, what=what, interval=0.5,
                      tail=lambda: f"--- kubelet:\n{node.log_tail('kubelet', 30)}\n--- agent pods:\n{agent_logs(node)}")


def is_agent(pod: dict) -> bool:
    """The DaemonSet's pods, not the MPS daemons' (which share the namespace)."""
    return (pod["metadata"].get("labels") or {}).get("app.kubernetes.io/name") == "sysdra"


def agent_pods(node: RealNode) -> list[dict]:
    return [p for p in node.plane.list("Pod", "sysdra") if is_agent(p)]


def mps_pods(node: RealNode) -> list[dict]:
    return [p for p in node.plane.list("Pod", "sysdra") if not is_agent(p)]


def agent_logs(node: RealNode, lines: int = 20) -> str:
    out = []
    for pod in agent_pods(node):
        name = pod["metadata"]["name"]
        r = node.plane.request("GET", f"/api/v1/namespaces/sysdra/pods/{name}/log", params={"tailLines": str(lines)}, ok=False)
        out.append(f"{name} ({pod['status'].get('phase')}):\n{r.text}")
    return "\n".join(out)


def running_agents(node: RealNode) -> list[tuple[str, str]]:
    """(pod, image) of the agent pods running and ready."""
    out = []
    for pod in agent_pods(node):
        conds = {c["type"]: c["status"] for c in pod["status"].get("conditions") or []}
        if pod["status"].get("phase") == "Running" and conds.get("Ready") == "True" and not pod["metadata"].get("deletionTimestamp"):
            out.append((pod["metadata"]["name"], pod["spec"]["containers"][0]["image"]))
    return out


def claim_pod(node: RealNode, ns: str, name: str) -> str:
    """A pod with a GPU claim of its own, running: the claim prepared by the agent. -> the claim's UID."""
    claim = node.plane.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                               "metadata": {"name": name, "namespace": ns}, "spec": GPU_REQUEST})  # fmt: skip
    container = {"name": "app", "image": node.image, "imagePullPolicy": "Never",
                 "command": ["sh", "-c", "env | grep ^SYSDRA_CLAIM_UID=; exec sleep 3600"],
                 "resources": {"claims": [{"name": "gpu"}]}}  # fmt: skip
    node.plane.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
                       "spec": {"automountServiceAccountToken": False, "hostNetwork": True, "terminationGracePeriodSeconds": 1,
                                "resourceClaims": [{"name": "gpu", "resourceClaimName": name}], "containers": [container]}})  # fmt: skip
    wait(lambda: node.plane.get("Pod", name, ns)["status"].get("phase") == "Running", f"pod {ns}/{name} running", node)
    return claim["metadata"]["uid"]


def delete_claim_pod(node: RealNode, ns: str, name: str, uid: str) -> None:
    node.plane.delete("Pod", name, ns)
    wait(lambda: node.plane.request("GET", f"/api/v1/namespaces/{ns}/pods/{name}", ok=False).status_code == 404,
         f"pod {ns}/{name} gone", node)  # fmt: skip
    wait(lambda: not [f for f in os.listdir(node.cdi_dir) if uid in f], f"claim {name} unprepared", node)
    node.plane.delete("ResourceClaim", name, ns)


def warnings(node: RealNode, ns: str) -> list[str]:
    return [f"{e['reason']}: {e.get('message')}" for e in node.plane.request("GET", f"/api/v1/namespaces/{ns}/events").json()["items"]
            if e.get("type") == "Warning"]  # fmt: skip
