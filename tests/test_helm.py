"""The Helm chart (deploy/helm/sysdra) with the real helm (tests/peers/helm) and the real
kube-apiserver: lint, the objects of the default values and of every feature on
(deploy/helm/sysdra/ci/all-values.yaml) accepted by the server's validation (server-side dry run),
the config file accepted by the agent's own settings, deploy/*.yaml not stale."""

from __future__ import annotations

import os
import time

import pytest
import yaml

from agent.cli import publishing
from agent.settings import Settings, load_config_file
from tests.conftest import REPO
from tests.controlplane import APIError, peer_crds, resource_path, wait_until
from tests.helm import CHART, MANIFESTS, render, stale
from tests.helm import helm as run_helm

ALL = os.path.join(CHART, "ci", "all-values.yaml")
DRY_RUN_NS = {"default": "sysdra", "all": "sysdra-all"}


def _objects(*values: str, namespace: str = "sysdra") -> list[dict]:
    return [d for d in yaml.safe_load_all(render(*values, namespace=namespace)) if d]


def _one(objs: list[dict], kind: str) -> dict:
    (obj,) = [o for o in objs if o["kind"] == kind]
    return obj


def _config(objs: list[dict], tmp_path) -> Settings:
    """The ConfigMap's config file through the agent's own loader, as `sysdra run --config` reads it."""
    path = tmp_path / "config.yaml"
    path.write_text(_one(objs, "ConfigMap")["data"]["config.yaml"])
    values = load_config_file(str(path))
    return publishing.checked(Settings.of({**values, "node_name": "node-a"}))


def test_lint():
    for args in ([CHART], ["--values", ALL, CHART]):
        result = run_helm("lint", "--strict", *args, check=False)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "0 chart(s) failed" in result.stdout


def test_deploy_manifests_are_the_charts_output():
    assert stale() == [], "run `make manifests`"
    for name in MANIFESTS:
        assert os.path.exists(os.path.join(REPO, "deploy", f"{name}.yaml"))


def test_default_config_is_the_agents_defaults(tmp_path):
    settings = _config(_objects(), tmp_path)
    defaults = Settings(node_name="node-a")
    assert settings == defaults


def test_every_feature_reaches_the_agent(tmp_path):
    objs = _objects(ALL)
    s = _config(objs, tmp_path)
    assert s.share == ("nic",) and s.partitions and s.compatibility_groups and s.list_attributes
    assert s.pf_vf_exclusive and s.taint_unhealthy and s.publish_uplink
    assert s.skip_node_operations == {"accelerator": ["*"]} and s.nvidia_driver_root == "/run/nvidia/driver"
    assert (s.log_level, s.log_format, s.resync_interval, s.health_interval) == ("debug", "json", 120, 5)
    ds = _one(objs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    # the driver root under --root, read-only; /sys writable for vfio and partition switches
    assert mounts["/host/run/nvidia/driver"]["readOnly"] is True
    assert volumes[mounts["/host/run/nvidia/driver"]["name"]]["hostPath"]["path"] == "/run/nvidia/driver"
    # a driver container mounts the driver there (again at each upgrade) after the agent started
    assert mounts["/host/run/nvidia/driver"]["mountPropagation"] == "HostToContainer"
    assert mounts["/host/sys"]["readOnly"] is False
    # config.nicIpam: the node's CNI plugins under --root, read-only, where the agent runs them
    assert s.nic_ipam["data"]["type"] == "host-local" and s.cni_bin_dir == "/usr/libexec/cni"
    assert mounts["/host/usr/libexec/cni"]["readOnly"] is True
    assert volumes[mounts["/host/usr/libexec/cni"]["name"]]["hostPath"]["path"] == "/usr/libexec/cni"
    # nvidia.mps: the MPS daemons' shm tmpfs, mounted by a privileged agent, reaches the host
    assert mounts["/var/lib/kubelet/plugins"]["mountPropagation"] == "Bidirectional"
    assert c["securityContext"]["privileged"] is True and c["securityContext"]["allowPrivilegeEscalation"] is True
    assert "--cdi-dir=/etc/cdi" in c["args"] and "/etc/cdi" in mounts
    assert "--metrics-address=$(POD_IP):9500" in c["args"]
    assert c["image"] == "registry.example.com/sysdra/sysdra:0.1.0-rc1"
    assert pod["serviceAccountName"] == "sysdra-agent"
    assert pod["nodeSelector"] and pod["tolerations"] and pod["affinity"]
    classes = {o["metadata"]["name"]: o["spec"].get("extendedResourceName") for o in objs if o["kind"] == "DeviceClass"}
    assert classes == {"gpu.sysdra.io": "example.com/gpu", "gpu-partition.sysdra.io": "example.com/gpu-partition",
                       "nic.sysdra.io": None, "nic-share.sysdra.io": None, "accelerator.sysdra.io": "sysdra.io/accelerator",
                       "vfio.sysdra.io": "example.com/vfio"}
    selectors = {o["metadata"]["name"]: o["spec"]["selectors"][0]["cel"]["expression"] for o in objs if o["kind"] == "DeviceClass"}
    assert selectors["gpu-partition.sysdra.io"].endswith('.gpuVendor == "nvidia"')
    monitor = _one(objs, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics" and monitor["metadata"]["labels"]["release"] == "prometheus"
    # the alerts name the node: the scraped pod's node as `node`
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in monitor["spec"]["endpoints"][0]["relabelings"]
    rule = _one(objs, "PrometheusRule")  # the rule file as it is (tests/test_alerts.py tests the file)
    with open(os.path.join(CHART, "files", "alerts.yaml")) as f:
        assert rule["spec"] == yaml.safe_load(f) and rule["metadata"]["labels"]["release"] == "prometheus"
    policies = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ValidatingAdmissionPolicy"}
    assert sorted(policies) == ["sysdra-own-node-mps-pods", "sysdra-own-node-slices"]
    for policy in policies.values():
        assert "system:serviceaccount:sysdra:sysdra-agent" in policy["spec"]["matchConditions"][0]["expression"]
    # nvidia.mps with the default mpsDaemons: the daemons' pods, of the chart's image, the agent's account
    mps = s.nvidia_mps_pod
    assert (mps.image, mps.namespace, mps.pull_policy, mps.image_pull_secrets, mps.service_account_name) == (
        "registry.example.com/sysdra/sysdra:0.1.0-rc1", "sysdra", "Always", ("registry-credentials",), "sysdra-agent")
    assert (mps.host_driver_root, mps.priority_class_name) == ("/run/nvidia/driver", "system-node-critical")
    role = _one(objs, "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "create", "delete"]}]
    # the daemons' pods: the image's repository (any tag: agents not yet replaced in a rollout), the
    # host paths under the kubelet plugin dir's mps/ and the driver root, the agent's account
    variables = {v["name"]: v["expression"] for v in policies["sysdra-own-node-mps-pods"]["spec"]["variables"]}
    assert (variables["repository"], variables["mpsDir"], variables["driverRoot"]) == (
        '"registry.example.com/sysdra/sysdra"', '"/var/lib/kubelet/plugins/sysdra.io/mps/"', '"/run/nvidia/driver"')
    assert "0.1.0-rc1" not in str(policies["sysdra-own-node-mps-pods"])
    assert "serviceAccountName.orValue('') == 'sysdra-agent'" in str(policies["sysdra-own-node-mps-pods"])


def test_default_daemonset():
    objs = _objects()
    pod = _one(objs, "DaemonSet")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    hostpaths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    for path in ("/host/sys", "/host/proc", "/host/dev"):
        assert mounts[path]["readOnly"] is True and hostpaths[mounts[path]["name"]] == path.removeprefix("/host")
    # the kubelet's dirs and the CDI dir at the host's own paths: what the agent writes there names host paths
    for path in ("/var/lib/kubelet/plugins", "/var/lib/kubelet/plugins_registry", "/var/run/cdi"):
        assert hostpaths[mounts[path]["name"]] == path and not mounts[path].get("readOnly")
    assert not any(m.startswith("/host/run") or m == "/host" for m in mounts)  # no driver root unless asked
    assert c["image"] == "ghcr.io/sysdra/sysdra:0.1.0" and not {"ServiceMonitor", "PrometheusRule"} & {o["kind"] for o in objs}
    # the pods' system-critical priority is admitted where a quota covers it (GKE; tests/test_helm_realnode.py)
    (scope,) = _one(objs, "ResourceQuota")["spec"]["scopeSelector"]["matchExpressions"]
    assert scope == {"scopeName": "PriorityClass", "operator": "In", "values": [pod["priorityClassName"]]}
    # netdevs into pods (docs/networking.md): the runtime's NRI socket, the pods' namespaces as they
    # come (propagated), the host's init for its namespace, and what moving netdevs needs
    assert "--nri-socket=/var/run/nri/nri.sock" in c["args"] and pod["hostPID"] is True
    assert hostpaths[mounts["/var/run/nri"]["name"]] == "/var/run/nri" and not mounts["/var/run/nri"].get("readOnly")
    netns = mounts["/var/run/netns"]
    assert hostpaths[netns["name"]] == "/var/run/netns" and netns["mountPropagation"] == "HostToContainer"
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["DAC_OVERRIDE", "NET_ADMIN", "SYS_ADMIN", "SYS_PTRACE"]}
    assert c["securityContext"]["appArmorProfile"] == {"type": "Unconfined"}  # the default profile refuses the init's ns
    # not privileged, no propagation back to the host, unless nvidia.mps asks
    assert c["securityContext"]["privileged"] is False and c["securityContext"]["allowPrivilegeEscalation"] is False
    assert "mountPropagation" not in mounts["/var/lib/kubelet/plugins"]
    assert pod["tolerations"] == [{"operator": "Exists"}]  # tainted GPU pools get their agent too
    # the host's own driver root: no propagation from the whole host
    (c,) = _one(_objects_set("nvidia.enabled=true"), "DaemonSet")["spec"]["template"]["spec"]["containers"]
    assert [m.get("mountPropagation") for m in c["volumeMounts"] if m["name"] == "nvidia-driver-root"] == [None]


def test_without_nri_the_agent_keeps_dac_override_alone():
    pod = _one(_objects_set("nri.enabled=false"), "DaemonSet")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert "--nri-socket=" in c["args"] and "hostPID" not in pod and "appArmorProfile" not in c["securityContext"]
    assert not {"/var/run/nri", "/var/run/netns"} & {m["mountPath"] for m in c["volumeMounts"]}
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["DAC_OVERRIDE"]}


def test_sysfs_writable_adds_sys_ptrace_without_nri():
    """VFIO looks for processes holding a device open before unbinding it: other users'
    /proc/<pid>/fd need CAP_SYS_PTRACE (docs/vfio.md)."""
    (c,) = _one(_objects_set("nri.enabled=false", "sysfsWritable=true"), "DaemonSet")["spec"]["template"]["spec"]["containers"]
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["DAC_OVERRIDE", "SYS_PTRACE"]}


@pytest.mark.parametrize("sets, privileged", [
    (("nvidia.enabled=true",), True),  # NVML opens the GPUs' device nodes, which only a privileged container has
    (("nvidia.enabled=true", "config.nvml=false"), False),  # facts from the PCI ID table: no need
    (("nvidia.mps=true", "config.nvml=false"), True),  # the MPS daemons' mounts
    ((), False),
])
def test_the_agent_is_privileged_only_for_what_needs_it(sets, privileged):
    objs = _objects_set(*sets)
    (c,) = _one(objs, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    assert c["securityContext"]["privileged"] is privileged
    assert c["securityContext"]["allowPrivilegeEscalation"] is privileged  # the API refuses privileged without it
    config = yaml.safe_load(_one(objs, "ConfigMap")["data"]["config.yaml"])
    assert config["nvml"] is ("config.nvml=false" not in sets)


@pytest.mark.parametrize("daemons", ["pod", "process"])
def test_mps_daemons_in_pods_bring_their_settings_role_and_policy(daemons, tmp_path):
    objs = _objects_set("nvidia.enabled=true", "nvidia.mps=true", f"nvidia.mpsDaemons={daemons}")
    pods = daemons == "pod"
    assert (_config(objs, tmp_path).nvidia_mps_pod is not None) is pods
    assert [o["metadata"]["name"] for o in objs if o["kind"] in ("Role", "RoleBinding")] == ["sysdra-mps"] * 2 * pods
    policies = [o["metadata"]["name"] for o in objs if o["kind"] == "ValidatingAdmissionPolicy"]
    assert ("sysdra-own-node-mps-pods" in policies) is pods


def test_a_misspelt_mps_daemons_value_is_refused():
    result = run_helm("template", "x", CHART, "--kube-version", "1.37.0", "--set", "nvidia.mpsDaemons=pods", check=False)
    assert result.returncode != 0 and 'nvidia.mpsDaemons must be pod or process, not "pods"' in result.stderr


def test_the_mps_pods_policy_allows_the_agents_own_paths_and_repository(tmp_path):
    """The policy's host paths are the agent's: its plugin dir's mps/ (--kubelet-dir, driverName) and
    the driver root as it reads hostDriverRoot (normalized); the image's repository, any tag."""
    objs = _objects_set("nvidia.enabled=true", "nvidia.mps=true", "kubeletDir=/data/kubelet/", "driverName=gpu.example.com",
                        "nvidia.hostDriverRoot=/opt/nvidia//driver/", "image.repository=registry.local:5000/sysdra",
                        "image.tag=1.2.3")  # fmt: skip
    (policy,) = [o for o in objs if o["metadata"]["name"] == "sysdra-own-node-mps-pods" and o["kind"] == "ValidatingAdmissionPolicy"]
    variables = {v["name"]: yaml.safe_load(v["expression"]) for v in policy["spec"]["variables"]}  # CEL's string literals
    s = _config(objs, tmp_path)
    (c,) = _one(objs, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    (kubelet_dir,) = [a.split("=", 1)[1] for a in c["args"] if a.startswith("--kubelet-dir=")]
    agent = Settings(node_name="node-a", kubelet_dir=kubelet_dir, driver_name=s.driver_name)
    assert variables["mpsDir"] == agent.plugin_dir + "/mps/" == "/data/kubelet/plugins/gpu.example.com/mps/"
    assert variables["driverRoot"] == s.nvidia_mps_pod.host_driver_root == "/opt/nvidia/driver"
    assert variables["repository"] == "registry.local:5000/sysdra" and s.nvidia_mps_pod.image == "registry.local:5000/sysdra:1.2.3"


def _objects_set(*sets: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(render(sets=sets)) if d]


def _prometheus_operator_crds(apiserver) -> None:
    """prometheus-operator's CRDs of the chart's ServiceMonitor and PrometheusRule (their schemas
    validate those objects), established on the server."""
    for path in peer_crds():
        (crd,) = apiserver.apply(path)
        name = crd["metadata"]["name"]
        wait_until(lambda: any(c["type"] == "Established" and c["status"] == "True" for c in
                               (apiserver.get("CustomResourceDefinition", name).get("status") or {}).get("conditions") or []),
                   30, what=f"CRD {name} established")  # fmt: skip


def _dry_run(apiserver, obj: dict, path: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            apiserver.request("PATCH", path, body=obj, content_type="application/apply-patch+yaml",
                              params={"fieldManager": "helm-dry-run", "force": "true", "dryRun": "All"})  # fmt: skip
            return
        except APIError as err:
            # a CRD just established may not be served for a moment yet
            if err.status != 404 or obj["kind"] not in ("ServiceMonitor", "PrometheusRule") or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.parametrize("sets", [("criticalPodsQuota=false",), ("priorityClassName=",),
                                  ("priorityClassName=sysdra-high",)])
def test_no_quota_where_no_critical_priority_needs_one(sets):
    assert "ResourceQuota" not in {o["kind"] for o in yaml.safe_load_all(render(sets=sets)) if o}


@pytest.mark.parametrize("values", ["default", "all"])
def test_server_accepts_every_object(apiserver, values):
    """Each rendered object through the real kube-apiserver's admission and validation
    (dryRun=All), the ServiceMonitor and PrometheusRule against prometheus-operator's CRDs:
    nothing is stored but the namespace the namespaced objects need (and those CRDs)."""
    _prometheus_operator_crds(apiserver)
    ns = DRY_RUN_NS[values]
    objs = _objects(*([ALL] if values == "all" else []), namespace=ns)
    namespaces = [o for o in objs if o["kind"] == "Namespace"]  # only with namespace.create (all)
    assert [n["metadata"]["name"] for n in namespaces] == ([ns] if values == "all" else [])
    # for real: helm keeps its release in the namespace first; a dry-run namespace would not exist for the objects
    apiserver.apply(namespaces or [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}])
    checked = set()
    for obj in objs:
        if obj["kind"] == "Namespace":
            continue
        path = resource_path(obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])
        try:
            _dry_run(apiserver, obj, path)
        except APIError as err:
            pytest.fail(f"{values} values: {obj['kind']} {obj['metadata']['name']}: {err}")
        checked.add(obj["kind"])
    assert checked >= {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet", "DeviceClass",
                       "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "ResourceQuota"}  # fmt: skip
    if values == "all":
        assert {"Service", "ServiceMonitor", "PrometheusRule"} <= checked


def test_a_snake_case_config_value_reaches_the_agent_and_the_daemonset(tmp_path):
    """values.yaml and docs/install.md: a config key "written as here or in snake_case". A
    snake_case key of a setting the chart has a default for must win over that camelCase default
    (the agent's loader takes one spelling of a setting), and the DaemonSet's mounts follow it."""
    objs = _objects_set("config.log_level=debug", "config.resync_interval=60", "config.nvidia_driver_root=/run/nvidia/driver",
                        "nvidia.enabled=true", "config.nic_ipam.data.type=host-local", "config.cni_bin_dir=/usr/libexec/cni")
    s = _config(objs, tmp_path)
    assert (s.log_level, s.resync_interval, s.nvidia_driver_root) == ("debug", 60, "/run/nvidia/driver")
    assert s.nic_ipam == {"data": {"type": "host-local"}} and s.cni_bin_dir == "/usr/libexec/cni"
    pod = _one(objs, "DaemonSet")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/host/run/nvidia/driver"]["name"]]["hostPath"]["path"] == "/run/nvidia/driver"
    assert volumes[mounts["/host/usr/libexec/cni"]["name"]]["hostPath"]["path"] == "/usr/libexec/cni"


@pytest.mark.parametrize("key, value", [("kubeletDir", "kubeletDir"), ("kubelet_dir", "kubeletDir"), ("cdiDir", "cdiDir"),
                                        ("driverName", "driverName"), ("nriSocket", "nri.socket"),
                                        ("metricsAddress", "metrics.port"), ("root", "hostPaths")])
def test_a_config_setting_the_daemonsets_flags_override_is_refused(key, value):
    """`config.<any setting>` (docs/install.md): the DaemonSet's flags set the paths, the cluster and
    the sockets, and driverName is the chart's own value; such a setting in config would be ignored
    (or contradict the classes and RBAC) without a word: the render names the value to use."""
    result = run_helm("template", "x", CHART, "--kube-version", "1.37.0", "--set", f"config.{key}=/x", check=False)
    assert result.returncode != 0 and f"config.{key}" in result.stderr and value in result.stderr, result.stderr
