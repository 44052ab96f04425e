"""The chart's admission policy for the MPS control daemons' pods (``<fullname>-own-node-mps-pods``,
deploy/helm/sysdra/templates/admission-policy.yaml) on the real kube-apiserver v1.37.2, with the
chart's RBAC, as the agent's node-bound token: the launcher's own pod passes (and one of another
tag of the chart's repository: an agent not yet replaced in a rollout), and each thing a stolen
token could put into a pod of the release namespace is refused, with its message. The fixture
yields once the server's policy informer refuses a known-bad pod; the policy's CEL is
type-checked by kube-controller-manager's policy status controller, without warnings."""

from __future__ import annotations

import copy

import pytest

from tests.controlplane import free_port, peer, unique, wait_until
from tests.test_mps_pods import UUID, Chart, dirs, kubelet_dir

NS = "sysdra"
POLICY = "sysdra-own-node-mps-pods"
PODS = f"/api/v1/namespaces/{NS}/pods"


@pytest.fixture(scope="module")
def chart(apiserver, tmp_path_factory):
    c = Chart(apiserver, tmp_path_factory.mktemp("mpspolicy"), kubelet_dir(tmp_path_factory))
    try:
        bad = c.launcher(c.plugin).manifest(UUID, dirs(c.plugin, UUID))
        bad["metadata"]["name"], bad["spec"]["nodeName"] = unique("sysdra-mps-probe"), c.other
        def refused() -> bool:  # the server's policy informer catches up
            r = c.http.post(PODS, json=bad)
            if r.status_code == 201:
                delete(apiserver, bad["metadata"]["name"])
            return r.status_code == 403

        wait_until(refused, 30, what="the policy refusing a pod on another node")
        yield c
    finally:
        c.http.close()
        for obj in c.objects:  # the policies are cluster-wide: other modules apply their own
            if obj["kind"] in ("ValidatingAdmissionPolicyBinding", "ValidatingAdmissionPolicy"):
                apiserver.delete(obj["kind"], obj["metadata"]["name"])


def delete(plane, name: str) -> None:
    plane.request("DELETE", f"{PODS}/{name}", params={"gracePeriodSeconds": "0"}, ok=False)


def daemon_pod(chart) -> dict:
    """The launcher's own pod for a GPU, a name of its own (no pod of another test in the way)."""
    pod = chart.launcher(chart.plugin).manifest(UUID, dirs(chart.plugin, UUID))
    pod["metadata"]["name"] = unique("sysdra-mps-test")
    return pod


def create(plane, chart, pod: dict) -> tuple[int, str]:
    """POST ``pod`` as the agent: the status and the message; a created pod is deleted again (admin)."""
    r = chart.http.post(PODS, json=pod)
    if r.status_code == 201:
        delete(plane, pod["metadata"]["name"])
    return r.status_code, r.json().get("message", "")


def refused(plane, chart, pod: dict, why: str) -> None:
    status, message = create(plane, chart, pod)
    assert status == 403 and f"ValidatingAdmissionPolicy '{POLICY}'" in message and why in message, (status, message)


def test_the_launchers_own_pod_passes(apiserver, chart):
    pod = daemon_pod(chart)
    assert {v["hostPath"]["path"] for v in pod["spec"]["volumes"]} == {
        f"{chart.plugin}/mps/{UUID}", f"{chart.plugin}/mps/{UUID}/shm", "/run/nvidia/driver"}
    r = chart.http.post(PODS, json=pod)
    try:
        assert r.status_code == 201, r.text
        made = r.json()["spec"]
        assert (made["nodeName"], made["serviceAccountName"], made["automountServiceAccountToken"]) == (chart.name, "sysdra", False)
    finally:
        delete(apiserver, pod["metadata"]["name"])


def test_another_tag_of_the_charts_repository_passes(apiserver, chart):
    """A rollout: the policy has the new tag's chart at once, an agent not yet replaced starts its
    daemons with its own (older) image."""
    for image in ("ghcr.io/sysdra/sysdra:0.0.9", "ghcr.io/sysdra/sysdra@sha256:" + "0" * 64):
        pod = daemon_pod(chart)
        pod["spec"]["containers"][0]["image"] = image
        assert create(apiserver, chart, pod)[0] == 201, image


@pytest.mark.parametrize("image", [
    "busybox:1.36", "ghcr.io/sysdra/sysdra-evil:0.1.0", "ghcr.io/sysdra/sysdra", "ghcr.io/other/sysdra:0.1.0",
    "evil.example.com/ghcr.io/sysdra/sysdra:0.1.0",
    "ghcr.io/sysdra/sysdra:5000/evil",  # a repository without a path ("sysdra") would be a registry's host:port here
])  # fmt: skip
def test_another_repositorys_image_is_refused(apiserver, chart, image):
    pod = daemon_pod(chart)
    pod["spec"]["containers"][0]["image"] = image
    refused(apiserver, chart, pod, f"the chart's image repository ghcr.io/sysdra/sysdra (any tag or digest), not {image}")


def test_a_pod_on_another_node_is_refused(apiserver, chart):
    pod = daemon_pod(chart)
    pod["spec"]["nodeName"] = chart.other
    refused(apiserver, chart, pod, f"the sysdra agent on {chart.name} may only create and delete pods bound to its own node")


def test_a_pod_without_the_daemons_label_is_refused(apiserver, chart):
    pod = daemon_pod(chart)
    pod["metadata"]["labels"]["app.kubernetes.io/component"] = "shell"
    refused(apiserver, chart, pod, "may only create and delete MPS control daemon pods")


def test_another_service_account_is_refused(apiserver, chart):
    for account in ("powerful", "default"):  # kube-controller-manager makes a namespace's default; none runs here
        apiserver.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account, "namespace": NS}})
    pod = daemon_pod(chart)
    pod["spec"]["serviceAccountName"] = "powerful"
    refused(apiserver, chart, pod, "run as its ServiceAccount sysdra, not powerful")
    del pod["spec"]["serviceAccountName"]  # the namespace's default
    refused(apiserver, chart, pod, "run as its ServiceAccount sysdra, not default")


def test_a_mounted_token_is_refused(apiserver, chart):
    pod = daemon_pod(chart)
    pod["spec"]["automountServiceAccountToken"] = True
    refused(apiserver, chart, pod, "mount no ServiceAccount token (automountServiceAccountToken: false)")
    del pod["spec"]["automountServiceAccountToken"]  # the ServiceAccount's default: mounted
    refused(apiserver, chart, pod, "mount no ServiceAccount token")


def test_a_second_container_is_refused(apiserver, chart):
    pod = daemon_pod(chart)
    (container,) = pod["spec"]["containers"]
    pod["spec"]["containers"].append({**copy.deepcopy(container), "name": "second"})
    refused(apiserver, chart, pod, "have exactly one container, not 2")


def test_an_init_container_is_refused(apiserver, chart):
    pod = daemon_pod(chart)
    pod["spec"]["initContainers"] = [{**copy.deepcopy(pod["spec"]["containers"][0]), "name": "init"}]
    refused(apiserver, chart, pod, "have no init or ephemeral containers")


@pytest.mark.parametrize("volume", [
    {"secret": {"secretName": "registry-credentials"}},
    {"configMap": {"name": "sysdra"}},
    {"projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}},
    {"emptyDir": {}},
    {"hostPath": {"path": "/etc"}},
    {"hostPath": {"path": "{kubelet}/plugins/other.io/mps/x"}},
    {"hostPath": {"path": "{kubelet}/plugins/sysdra.io/mps"}},  # the dir itself: only what is under it
    {"hostPath": {"path": "/run/nvidia/driver/etc"}},  # the driver root itself only
], ids=["secret", "configMap", "projected", "emptyDir", "etc", "another-driver", "mps-dir-itself", "under-driver-root"])  # fmt: skip
def test_a_volume_other_than_the_daemons_host_paths_is_refused(apiserver, chart, volume):
    pod = daemon_pod(chart)
    if "hostPath" in volume:  # the chart's kubeletDir (the module's own)
        volume = {"hostPath": {"path": volume["hostPath"]["path"].format(kubelet=chart.plugin.parent.parent)}}
    pod["spec"]["volumes"].append({"name": "extra", **volume})
    refused(apiserver, chart, pod, f"mount only hostPaths under {chart.plugin}/mps/ or the driver root "
                                   "/run/nvidia/driver: not volume extra")  # fmt: skip


def test_env_from_and_value_from_are_refused(apiserver, chart):
    pod = daemon_pod(chart)
    pod["spec"]["containers"][0]["envFrom"] = [{"secretRef": {"name": "registry-credentials"}}]
    refused(apiserver, chart, pod, "plain env values, no envFrom or valueFrom: container mps-control-daemon")
    pod = daemon_pod(chart)
    pod["spec"]["containers"][0]["env"].append(
        {"name": "STOLEN", "valueFrom": {"secretKeyRef": {"name": "registry-credentials", "key": "x"}}})
    refused(apiserver, chart, pod, "plain env values, no envFrom or valueFrom: container mps-control-daemon")


def test_delete_only_daemon_pods_on_its_own_node(apiserver, chart):
    elsewhere = daemon_pod(chart)
    elsewhere["spec"]["nodeName"] = chart.other
    plain = daemon_pod(chart)
    plain["metadata"]["labels"] = {"app": "not-a-daemon"}
    own = daemon_pod(chart)
    made = [apiserver.create(p)["metadata"]["name"] for p in (elsewhere, plain, own)]  # the admin's: no policy
    try:
        gone = lambda name: chart.http.request("DELETE", f"{PODS}/{name}", params={"gracePeriodSeconds": "0"})  # noqa: E731
        r = gone(made[0])
        assert r.status_code == 403 and f"the sysdra agent on {chart.name} may only create and delete pods bound to its own node" \
            in r.json()["message"], r.text
        r = gone(made[1])
        assert r.status_code == 403 and "may only create and delete MPS control daemon pods" in r.json()["message"], r.text
        r = gone(made[2])  # its own daemon pod: the launcher's delete
        assert r.status_code == 200, r.text
    finally:
        for name in made:
            delete(apiserver, name)


def test_another_namespace_is_refused_by_rbac(chart):
    pod = daemon_pod(chart)
    pod["metadata"]["namespace"] = "default"
    r = chart.http.post("/api/v1/namespaces/default/pods", json=pod)
    assert r.status_code == 403 and "ValidatingAdmissionPolicy" not in r.text, r.text  # RBAC: its namespace only


def test_the_policys_cel_type_checks_without_warnings(apiserver, chart):
    """kube-controller-manager's ValidatingAdmissionPolicy status controller type-checks each
    expression against the Pod's schema (the server only compiles them at creation): a field
    that does not exist, or a type that does not fit, is a warning in status.typeChecking."""
    kubeconfig, port = apiserver.kubeconfig, free_port()
    proc = apiserver._spawn("kube-controller-manager", [
        peer("kube-controller-manager"), f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}", "--leader-elect=false", "--bind-address=127.0.0.1",
        f"--secure-port={port}", "--controllers=validatingadmissionpolicy-status-controller", "--v=1",
    ])  # fmt: skip
    try:
        names = [o["metadata"]["name"] for o in chart.objects if o["kind"] == "ValidatingAdmissionPolicy"]
        assert POLICY in names
        def checked(name: str) -> dict | None:
            policy = apiserver.get("ValidatingAdmissionPolicy", name)
            status = policy.get("status") or {}
            done = status.get("observedGeneration") == policy["metadata"]["generation"] and "typeChecking" in status
            return status if done else None

        for name in names:
            status = wait_until(lambda: checked(name), 60, what=f"{name}'s type check", proc=proc,
                                tail=lambda: apiserver.log_tail("kube-controller-manager"))
            assert not status["typeChecking"].get("expressionWarnings"), (name, status["typeChecking"])
    finally:
        proc.terminate()
        proc.wait(15)
        apiserver._procs.remove(proc)
