"""A real Kubernetes control plane for the tests: kube-apiserver v1.37.2 + etcd, and the
scheduler's own DRA allocator, all built from upstream Go modules by tests/peers/build.sh
into .peers/bin (docs/control-plane.md).

``ControlPlane`` starts etcd and kube-apiserver on 127.0.0.1 (random free ports, data and
certificates in a temporary directory made at test time, tests/controlplane_pki.py), with
``--authorization-mode=Node,RBAC`` and the DRA feature gates the agent relies on. The session
fixture ``apiserver`` (tests/conftest.py) yields one; tests isolate themselves by node name /
namespace (``unique``). ``allocate`` runs the upstream allocator on slices + classes + claims
(tests/controlplane_allocator.py).

A missing peer binary is a failure, never a skip: run ``tests/peers/build.sh`` (``make peers``;
tests/controlplane_peers.py).
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import re
import signal
import ssl
import subprocess
import tempfile
from dataclasses import dataclass, field

import httpx2
import yaml

# The tests import these from here, beside the control plane's own names.
from tests.controlplane_allocator import Unschedulable, allocate, claim_from, run_allocator, with_allocation  # noqa: F401
from tests.controlplane_peers import (  # noqa: F401
    BUILD_HINT, PEERS_BIN, REPO, PeerMissing, _die_with_parent, free_port, log_tail, peer, peer_crds, unique, wait_until,
)
from tests.controlplane_pki import Pki

# The DRA gates of k8s.io/kubernetes v1.37.2 (pkg/features/kube_features.go) behind what the
# agent can publish, switched on. Gates that are GA and locked in 1.37 (DRAAdminAccess,
# DRAPrioritizedList, DRAResourceClaimDeviceStatus, DRAExtendedResource, NodeDeclaredFeatures)
# are on already and cannot be set; DRAPartitionableDevicesType needs DRAResourcePoolStatus.
FEATURE_GATES = {
    "DRAPartitionableDevices": True,  # beta, on by default
    "DRAPartitionableDevicesType": True,  # alpha
    "DRAResourcePoolStatus": True,  # alpha
    "DRADeviceCompatibilityGroups": True,  # alpha
    "DRAConsumableCapacity": True,  # beta, on by default
    "DRAFractionalCapacityRange": True,  # beta, on by default
    "DRADeviceTaints": True,  # GA, not locked
    "DRADeviceTaintRules": True,  # GA, not locked
    "DRAListTypeAttributes": True,  # alpha
    "DRAOptionalNodeOperations": True,  # alpha
    "DRADeviceBindingConditions": True,  # beta, on by default
    "DRANodeAllocatableResources": True,  # alpha
    "DRADerivedAttributes": True,  # alpha (claim side)
}
# resource.k8s.io/v1 is on by default; the older versions are what other clients may still read.
RUNTIME_CONFIG = "resource.k8s.io/v1beta1=true,resource.k8s.io/v1beta2=true,resource.k8s.io/v1alpha3=true"
ISSUER = "https://kubernetes.default.svc.cluster.local"
ADMIN = "sysdra-test-admin"


# --- REST paths for the kinds the tests write ----------------------------------------------
_KINDS = {
    # kind: (api prefix, plural, namespaced)
    "Namespace": ("/api/v1", "namespaces", False),
    "Node": ("/api/v1", "nodes", False),
    "ServiceAccount": ("/api/v1", "serviceaccounts", True),
    "Secret": ("/api/v1", "secrets", True),
    "ConfigMap": ("/api/v1", "configmaps", True),
    "Service": ("/api/v1", "services", True),
    "Pod": ("/api/v1", "pods", True),
    "Event": ("/api/v1", "events", True),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", True),
    "DaemonSet": ("/apis/apps/v1", "daemonsets", True),
    "DeviceClass": ("/apis/resource.k8s.io/v1", "deviceclasses", False),
    "ResourceSlice": ("/apis/resource.k8s.io/v1", "resourceslices", False),
    "ResourceClaim": ("/apis/resource.k8s.io/v1", "resourceclaims", True),
    "ResourceClaimTemplate": ("/apis/resource.k8s.io/v1", "resourceclaimtemplates", True),
    "DeviceTaintRule": ("/apis/resource.k8s.io/v1", "devicetaintrules", False),
    "ValidatingAdmissionPolicy": ("/apis/admissionregistration.k8s.io/v1", "validatingadmissionpolicies", False),
    "ValidatingAdmissionPolicyBinding": ("/apis/admissionregistration.k8s.io/v1", "validatingadmissionpolicybindings", False),
    "ResourceQuota": ("/api/v1", "resourcequotas", True),
    "CustomResourceDefinition": ("/apis/apiextensions.k8s.io/v1", "customresourcedefinitions", False),
    # prometheus-operator's, for the chart's objects (tests/peers/build.sh crds)
    "ServiceMonitor": ("/apis/monitoring.coreos.com/v1", "servicemonitors", True),
    "PrometheusRule": ("/apis/monitoring.coreos.com/v1", "prometheusrules", True),
}


def resource_path(kind: str, namespace: str | None = None, name: str | None = None) -> str:
    prefix, plural, namespaced = _KINDS[kind]
    path = f"{prefix}/namespaces/{namespace or 'default'}/{plural}" if namespaced else f"{prefix}/{plural}"
    return f"{path}/{name}" if name else path


def load_yaml(path: str) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


class APIError(RuntimeError):
    def __init__(self, response: httpx2.Response):
        self.status = response.status_code
        try:
            self.body = response.json()
        except ValueError:
            self.body = {"message": response.text}
        super().__init__(f"{response.request.method} {response.request.url.path}: {self.status} {self.body.get('message', '')}")


# --- the control plane ------------------------------------------------------------------------
@dataclass
class ControlPlane:
    """etcd + kube-apiserver on 127.0.0.1. Attributes after ``start()``:

    ``url`` (https://127.0.0.1:PORT), ``ca_path``, ``kubeconfig`` (admin, system:masters),
    ``admin_cert`` (cert, key), ``dir`` (data, certs, logs), ``etcd_url``."""

    dir: str = ""
    gates: dict[str, bool] = field(default_factory=lambda: dict(FEATURE_GATES))
    url: str = ""
    ca_path: str = ""
    kubeconfig: str = ""
    admin_cert: tuple[str, str] = ("", "")
    extra_args: list[str] = field(default_factory=list)  # more kube-apiserver flags
    wrap: list[str] = field(default_factory=list)  # a prefix for every peer's command (the real node's nsenter)
    etcd_url: str = ""
    _procs: list = field(default_factory=list)
    _client: httpx2.Client | None = None

    def start(self, timeout: float = 90.0) -> "ControlPlane":
        etcd_bin, apiserver_bin = peer("etcd"), peer("kube-apiserver")
        if not self.dir:
            self.dir = tempfile.mkdtemp(prefix="sysdra-controlplane-")
        pki = self._pki = Pki(os.path.join(self.dir, "pki"))
        self.ca_path = pki.ca_cert
        serving = pki.issue("apiserver", "kube-apiserver", server=True)
        self.admin_cert = pki.issue("admin", ADMIN, orgs=("system:masters",))
        sa_pub, sa_key = pki.service_account_keys()
        try:
            etcd_url = self._start_etcd(etcd_bin, timeout)
            self._start_apiserver(apiserver_bin, etcd_url, serving, sa_pub, sa_key, timeout)
        except BaseException:
            self.stop()
            raise
        self.kubeconfig = self.write_kubeconfig(os.path.join(self.dir, "admin.kubeconfig"), cert=self.admin_cert)
        return self

    # -- processes
    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.dir, f"{name}.log"), "wb")
        proc = subprocess.Popen([*self.wrap, *argv], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent, cwd=self.dir)  # fmt: skip
        log.close()
        proc.name = name  # type: ignore[attr-defined]
        self._procs.append(proc)
        return proc

    def log_tail(self, name: str, lines: int = 40) -> str:
        return log_tail(self.dir, name, lines)

    def _wait(self, proc, name: str, probe, timeout: float) -> None:
        wait_until(probe, timeout, what=name, proc=proc, tail=lambda: self.log_tail(name))

    def _start_etcd(self, etcd_bin: str, timeout: float) -> str:
        client, peer_port = free_port(), free_port()
        url = f"http://127.0.0.1:{client}"
        proc = self._spawn("etcd", [
            etcd_bin, "--name=sysdra-test", f"--data-dir={os.path.join(self.dir, 'etcd')}",
            f"--listen-client-urls={url}", f"--advertise-client-urls={url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer_port}", f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-cluster=sysdra-test=http://127.0.0.1:{peer_port}", "--initial-cluster-state=new",
            "--unsafe-no-fsync", "--log-level=warn", "--quota-backend-bytes=2147483648",
        ])  # fmt: skip
        self._wait(proc, "etcd", lambda: httpx2.get(f"{url}/health", timeout=2).status_code == 200, timeout)
        self.etcd_url = url
        return url

    def _start_apiserver(self, apiserver_bin, etcd_url, serving, sa_pub, sa_key, timeout) -> None:
        port = free_port()
        self.url = f"https://127.0.0.1:{port}"
        gates = ",".join(f"{k}={'true' if v else 'false'}" for k, v in sorted(self.gates.items()))
        proc = self._spawn("kube-apiserver", [
            apiserver_bin, "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={port}",
            f"--etcd-servers={etcd_url}", f"--cert-dir={os.path.join(self.dir, 'pki')}",
            f"--tls-cert-file={serving[0]}", f"--tls-private-key-file={serving[1]}", f"--client-ca-file={self.ca_path}",
            "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
            f"--service-account-issuer={ISSUER}", f"--service-account-key-file={sa_pub}",
            f"--service-account-signing-key-file={sa_key}", "--service-cluster-ip-range=10.96.0.0/24",
            f"--runtime-config={RUNTIME_CONFIG}", f"--feature-gates={gates}",
            "--endpoint-reconciler-type=none", "--profiling=false", "--v=1",
            "--allow-privileged=true",  # as kubeadm runs it: the chart's nvidia.mps pod is privileged
            *self.extra_args,
        ])  # fmt: skip
        self._wait(proc, "kube-apiserver", lambda: self.http().get("/readyz", timeout=5).status_code == 200, timeout)

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        for proc in reversed(self._procs):  # apiserver first, then etcd
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        self._procs.clear()

    def start_scheduler(self, timeout: float = 60.0) -> subprocess.Popen:
        """kube-scheduler v1.37.2 against this server (admin credentials, same gates, no leader
        election); stopped with the control plane."""
        binary = peer("kube-scheduler")
        kubeconfig = self.kubeconfig
        port = free_port()
        gates = ",".join(f"{k}={'true' if v else 'false'}" for k, v in sorted(self.gates.items()))
        proc = self._spawn("kube-scheduler", [
            binary, f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}", "--leader-elect=false", "--bind-address=127.0.0.1",
            f"--secure-port={port}", f"--feature-gates={gates}", "--v=2",
        ])  # fmt: skip
        self._wait(proc, "kube-scheduler",
                   lambda: httpx2.get(f"https://127.0.0.1:{port}/readyz", verify=False, timeout=2).status_code == 200, timeout)  # fmt: skip
        return proc

    def feature_gates(self) -> dict[str, bool]:
        """The gates as the running server reports them (``kubernetes_feature_enabled`` metric)."""
        text = self.request("GET", "/metrics").text
        return {m.group(1): m.group(2) == "1"
                for m in re.finditer(r'^kubernetes_feature_enabled\{name="([^"]+)"[^}]*\} (\d)', text, re.M)}  # fmt: skip

    def compact_etcd(self) -> int:
        """Compact etcd to its current revision (what the server does every 5 minutes):
        watches from older resourceVersions are then answered with 410 Gone."""
        revision = int(httpx2.post(f"{self.etcd_url}/v3/kv/range", json={"key": "AA=="}, timeout=10).json()["header"]["revision"])
        httpx2.post(f"{self.etcd_url}/v3/kv/compaction", json={"revision": revision, "physical": True}, timeout=30).raise_for_status()
        return revision

    def alive(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

    # -- clients
    def http(self, *, token: str | None = None, cert: tuple[str, str] | None = None) -> httpx2.Client:
        """An HTTP client to the server: admin by default, or as a bearer token / client cert."""
        if token is None and cert is None:
            if self._client is None:
                self._client = httpx2.Client(base_url=self.url, verify=self.tls(self.admin_cert), timeout=30)
            return self._client
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx2.Client(base_url=self.url, verify=self.tls(cert), headers=headers, timeout=30)

    def tls(self, cert: tuple[str, str] | None = None) -> ssl.SSLContext:
        """Trusts only our CA; presents ``cert`` (cert, key) when given."""
        ctx = ssl.create_default_context(cafile=self.ca_path)
        if cert:
            ctx.load_cert_chain(*cert)
        return ctx

    def write_kubeconfig(self, path: str, *, token: str | None = None, cert: tuple[str, str] | None = None,
                         namespace: str = "default", server: str | None = None, token_file: str | None = None) -> str:  # fmt: skip
        """A kubeconfig for lightkube / the agent ($KUBECONFIG) as a token (inline, or the file
        ``token_file`` that clients read again on a 401) or a client cert."""
        user: dict = {}
        if token:
            user["token"] = token
        if token_file:
            user["tokenFile"] = token_file
        if cert:
            user["client-certificate"], user["client-key"] = cert
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": server or self.url, "certificate-authority": self.ca_path}}],
            "users": [{"name": "test", "user": user}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test", "namespace": namespace}}],
        }  # fmt: skip
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(config, f)
        return path

    def request(self, method: str, path: str, *, body=None, params=None, client: httpx2.Client | None = None,
                content_type: str | None = None, ok: bool = True) -> httpx2.Response:  # fmt: skip
        client = client or self.http()
        headers = {"Content-Type": content_type} if content_type else None
        # compact with sorted keys, as kubectl sends it (YAML -> Go map -> JSON): the server keeps an
        # opaque config's bytes as sent, and v1.37.2 refuses every later status update of a claim
        # whose allocation copied other bytes than its own re-encoding gives ("status.allocation:
        # Invalid value: null: field cannot be modified once set"; docs/networking.md)
        data = None if body is None else json.dumps(body, separators=(",", ":"), sort_keys=True)
        response = client.request(method, path, content=data, params=params, headers=headers)
        if ok and response.status_code >= 400:
            raise APIError(response)
        return response

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict:
        return self.request("GET", resource_path(kind, namespace, name)).json()

    def create(self, obj: dict, *, client: httpx2.Client | None = None) -> dict:
        kind, ns = obj["kind"], obj["metadata"].get("namespace")
        return self.request("POST", resource_path(kind, ns), body=obj, client=client).json()

    def apply(self, obj: dict | list | str, *, manager: str = "sysdra-tests") -> list[dict]:
        """Server-side apply of one object, a list, or every document of a YAML file."""
        objs = load_yaml(obj) if isinstance(obj, str) else obj if isinstance(obj, list) else [obj]
        out = []
        for o in objs:
            path = resource_path(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])
            r = self.request("PATCH", path, body=o, params={"fieldManager": manager, "force": "true"},
                             content_type="application/apply-patch+yaml")  # fmt: skip
            out.append(r.json())
        return out

    def delete(self, kind: str, name: str, namespace: str | None = None) -> None:
        r = self.request("DELETE", resource_path(kind, namespace, name), ok=False)
        if r.status_code not in (200, 202, 404):
            raise APIError(r)

    def list(self, kind: str, namespace: str | None = None, *, fields: dict | None = None) -> list[dict]:
        params = {"fieldSelector": ",".join(f"{k}={v}" for k, v in fields.items())} if fields else None
        prefix, plural, namespaced = _KINDS[kind]
        path = resource_path(kind, namespace) if (namespaced and namespace) else f"{prefix}/{plural}"
        return self.request("GET", path, params=params).json()["items"]

    # -- cluster objects
    def create_node(self, name: str, labels: dict | None = None, ready: bool = True) -> dict:
        """A Node object (no kubelet behind it); its uid is what ownerReferences name. Ready,
        with room for pods, so kube-scheduler would place pods on it."""
        node = self.create({"apiVersion": "v1", "kind": "Node",
                            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}}})  # fmt: skip
        if ready:
            room = {"cpu": "8", "memory": "16Gi", "pods": "110"}
            status = {"status": {"capacity": room, "allocatable": room,
                                 "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                                 "message": "fake node", "lastHeartbeatTime": _now(), "lastTransitionTime": _now()}]}}  # fmt: skip
            self.request("PATCH", resource_path("Node", None, name) + "/status", body=status,
                         content_type="application/merge-patch+json")  # fmt: skip
            # admission (TaintNodesByCondition) taints a new node not-ready; no node lifecycle
            # controller runs here to take the taint off once it is Ready
            node = self.request("PATCH", resource_path("Node", None, name), body={"spec": {"taints": None}},
                                content_type="application/merge-patch+json").json()  # fmt: skip
        return node

    def create_namespace(self, name: str) -> dict:
        return self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})[0]

    def token(self, namespace: str, service_account: str, *, node: str | None = None, seconds: int = 3600,
              audiences: list[str] | None = None) -> str:  # fmt: skip
        """A TokenRequest token for a ServiceAccount; ``node`` binds it to that Node object
        (the server then adds the node name and uid to the token's claims)."""
        spec: dict = {"expirationSeconds": seconds}
        if audiences:
            spec["audiences"] = audiences
        if node:
            uid = self.get("Node", node)["metadata"]["uid"]
            spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid}
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        path = resource_path("ServiceAccount", namespace, service_account) + "/token"
        return self.request("POST", path, body=body).json()["status"]["token"]

    def node_identity(self, node: str) -> tuple[str, str]:
        """A kubelet client certificate (system:node:<node>, group system:nodes): what the Node
        authorizer and NodeRestriction admission know as that node's kubelet."""
        return self._pki.issue(f"kubelet-{node}", f"system:node:{node}", orgs=("system:nodes",))

    def can_i(self, client: httpx2.Client, verb: str, resource: str, *, group: str = "", namespace: str | None = None,
              name: str | None = None) -> bool:  # fmt: skip
        """SelfSubjectAccessReview as ``client``."""
        attrs = {"verb": verb, "resource": resource, "group": group}
        if namespace:
            attrs["namespace"] = namespace
        if name:
            attrs["name"] = name
        body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview", "spec": {"resourceAttributes": attrs}}
        r = self.request("POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", body=body, client=client)
        return bool(r.json()["status"].get("allowed"))


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def token_claims(token: str) -> dict:
    """The (unverified) JWT payload of a token: the tests read the node binding from it."""
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
