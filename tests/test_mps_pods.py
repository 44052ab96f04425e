"""MPS control daemons in pods of their own (agent/prepare/mps_pods.py) on the real
kube-apiserver v1.37.2, with the chart's RBAC and admission policy and the settings its
ConfigMap gives the agent: the launcher's pods as the agent's node-bound identity (what the
policy allows and refuses: tests/test_mps_pods_policy.py); a record's pod is told apart
from another of the same name by UID, deletes are conditional on it, orphans go. No kubelet runs
here, so the pods stay Pending and a delete stays pending; their life on a node (started,
adopted by the next agent, deleted) is tests/test_helm_realnode.py's. The pod's /dev/shm guard
runs under a real sh in a mount namespace of its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest
import yaml
from lightkube import AsyncClient, KubeConfig

from agent.kubeletplugin.claimapi import ClaimApi
from agent.prepare import mps_pods
from agent.prepare.mps_pods import PodApi, PodLauncher, pod_name
from agent.prepare.mps_records import MpsRecord
from agent.settings import Settings
from discovery.nvidia_driver import Library
from tests.conftest import require_root, require_tool
from tests.controlplane import unique, wait_until
from tests.helm import render

UUID, OTHER = "GPU-7e3a1c52-0d4b-4f6e-9a81-2b3c4d5e6f70", "GPU-00000000-1111-2222-3333-444444444444"
BINARY = "/run/nvidia/driver/usr/bin/nvidia-cuda-mps-control"
LIBS = (Library("libcuda.so.580.95.05", "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05",
                ("libcuda.so.1", "libcuda.so")),)


class Chart:
    """The chart with nvidia.mps (its default mpsDaemons: pod): RBAC and policies applied, the
    agent's settings from its ConfigMap, the agent's token bound to its node. Its kubeletDir is
    the session's (``kubelet_dir``: one policy for every module that applies it, whatever the
    server's policy informer still has): the policy lets the agent's pods mount host paths under
    ``plugin``/mps only, where the launcher makes the GPU's links (no kubelet runs here)."""

    def __init__(self, plane, tmp, kubelet):
        self.plugin = kubelet / "plugins" / "sysdra.io"
        docs = [d for d in yaml.safe_load_all(render(sets=("nvidia.enabled=true", "nvidia.mps=true", "namespace.create=true",
                                                           "config.nvidiaDriverRoot=/run/nvidia/driver",
                                                           f"kubeletDir={kubelet}")))
                if d]  # fmt: skip
        kinds = ("Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
                 "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
        self.objects = [d for d in docs if d["kind"] in kinds]
        plane.apply(self.objects)
        config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["config.yaml"]
        self.settings = Settings.of({"nvidia_mps_pod": yaml.safe_load(config)["nvidiaMpsPod"]}).nvidia_mps_pod
        self.node = plane.create_node(unique("mps-own"))
        self.name = self.node["metadata"]["name"]
        self.other = plane.create_node(unique("mps-other"))["metadata"]["name"]
        token = plane.token("sysdra", "sysdra", node=self.name)
        self.kubeconfig = plane.write_kubeconfig(str(tmp / "agent.kubeconfig"), token=token, namespace="sysdra")
        self.api = PodApi("sysdra", ClaimApi(AsyncClient(config=KubeConfig.from_file(self.kubeconfig))))
        self.http = plane.http(token=token)

    def launcher(self, tmp, boot: str = "boot-1") -> PodLauncher:
        launcher = PodLauncher(self.settings, str(tmp / "mps"), self.name, "sysdra.io", boot, "/run/nvidia/driver",
                               lambda: (BINARY, LIBS), self.api)
        launcher.stop_timeout = 1.0  # no kubelet confirms a delete here
        return launcher


@pytest.fixture(scope="module")
def chart(apiserver, tmp_path_factory):
    c = Chart(apiserver, tmp_path_factory.mktemp("mpspods"), kubelet_dir(tmp_path_factory))
    yield c
    c.http.close()


def kubelet_dir(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "mps-kubelet"


@pytest.fixture
def plugin(chart):
    """The chart's plugin dir, without what an earlier test's launcher made there."""
    shutil.rmtree(chart.plugin / "mps", ignore_errors=True)
    return chart.plugin


def dirs(tmp, uuid: str) -> dict[str, str]:
    d = tmp / "mps" / uuid
    return {k: str(d / k) for k in ("pipe", "log", "shm")}


def serving(tmp, uuid: str) -> None:
    """The daemon's pipe, as a serving daemon has it."""
    os.makedirs(dirs(tmp, uuid)["pipe"], exist_ok=True)
    open(os.path.join(dirs(tmp, uuid)["pipe"], "control"), "w").close()


def force_delete(plane, uuid: str) -> None:
    plane.request("DELETE", f"/api/v1/namespaces/sysdra/pods/{pod_name(uuid)}", params={"gracePeriodSeconds": "0"}, ok=False)


def test_the_settings_come_from_the_chart(chart):
    s = chart.settings
    assert (s.image, s.namespace, s.host_driver_root, s.priority_class_name) == (
        "ghcr.io/sysdra/sysdra:0.1.0", "sysdra", "/run/nvidia/driver", "system-node-critical")


def test_the_agents_pod_for_its_gpu(apiserver, chart, plugin):
    launcher = chart.launcher(plugin)
    rec = launcher.launch(UUID, dirs(plugin, UUID), {}, "/host/run/nvidia/driver/usr/bin/nvidia-cuda-mps-control")
    try:
        pod = apiserver.get("Pod", pod_name(UUID), "sysdra")
        assert rec == MpsRecord(uuid=UUID, pod_uid=pod["metadata"]["uid"], boot_id="boot-1")
        spec, (container,) = pod["spec"], pod["spec"]["containers"]
        assert (spec["nodeName"], spec["restartPolicy"], spec["hostNetwork"], spec["automountServiceAccountToken"],
                spec["serviceAccountName"]) == (chart.name, "Never", True, False, "sysdra")
        assert pod["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Node", "name": chart.name,
                                                       "uid": chart.node["metadata"]["uid"], "controller": True}]  # fmt: skip
        assert container["image"] == chart.settings.image
        assert container["securityContext"] == {"privileged": True, "runAsUser": 0, "runAsGroup": 0}
        assert container["command"][-2:] == ["/driver-root/usr/bin/nvidia-cuda-mps-control", "-f"]
        env = {e["name"]: e["value"] for e in container["env"]}
        d = dirs(plugin, UUID)
        lib = os.path.join(os.path.dirname(d["pipe"]), "lib")
        assert env == {"CUDA_VISIBLE_DEVICES": UUID, "CUDA_MPS_PIPE_DIRECTORY": d["pipe"], "CUDA_MPS_LOG_DIRECTORY": d["log"],
                       "PATH": "/driver-root/usr/bin:" + mps_pods.DEFAULT_PATH, "LD_LIBRARY_PATH": lib}  # fmt: skip
        # the loader path has the driver's libraries alone, as the pod sees them (never the host's libc)
        assert {n: os.readlink(os.path.join(lib, n)) for n in os.listdir(lib)} == dict.fromkeys(
            ("libcuda.so.580.95.05", "libcuda.so.1", "libcuda.so"), "/driver-root/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05")
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]}
        assert mounts == {"gpu": os.path.dirname(d["pipe"]), "shm": "/dev/shm", "driver-root": "/driver-root"}
        assert paths == {"gpu": os.path.dirname(d["pipe"]), "shm": d["shm"], "driver-root": "/run/nvidia/driver"}
        # Pending (no kubelet) and no pipe: not (yet) the daemon; with its pipe: up. Another pod of
        # the name, another boot, a deleting one: not the record's
        assert not launcher.alive(rec) and launcher.start_failed(rec) is None
        serving(plugin, UUID)
        assert launcher.alive(rec)
        assert not launcher.alive(rec.model_copy(update={"pod_uid": "0000-1111"}))
        assert not chart.launcher(plugin, boot="boot-2").alive(rec)
        chart.api.delete(pod_name(UUID), "0000-1111")  # another UID: a precondition that fails, nothing deleted
        assert launcher.alive(rec)
        launcher.end(rec, quitting=True)
        assert apiserver.get("Pod", pod_name(UUID), "sysdra")["metadata"]["deletionTimestamp"]
        assert not launcher.alive(rec)
        time.sleep(mps_pods.POLL)
        assert launcher.start_failed(rec) == "its pod was deleted"
    finally:
        force_delete(apiserver, UUID)


def test_a_deleted_pods_record_is_not_alive_and_a_stray_of_the_name_goes(apiserver, chart, plugin):
    launcher = chart.launcher(plugin)
    rec = launcher.launch(UUID, dirs(plugin, UUID), {}, "")
    force_delete(apiserver, UUID)
    assert not launcher.alive(rec)
    stray = launcher.launch(UUID, dirs(plugin, UUID), {}, "")  # say, made by an agent killed before it saved
    try:
        launcher.end_strays(UUID, dirs(plugin, UUID)["pipe"], rec)
        assert apiserver.get("Pod", pod_name(UUID), "sysdra")["metadata"].get("deletionTimestamp")
        assert not launcher.alive(stray)
    finally:
        force_delete(apiserver, UUID)


def test_orphans_go_and_the_needed_stay(apiserver, chart, plugin):
    launcher = chart.launcher(plugin)
    keep = launcher.launch(UUID, dirs(plugin, UUID), {}, "")
    orphan = launcher.launch(OTHER, dirs(plugin, OTHER), {}, "")
    serving(plugin, UUID)
    serving(plugin, OTHER)
    try:
        launcher.end_orphans({UUID})
        assert launcher.alive(keep) and not launcher.alive(orphan)
    finally:
        force_delete(apiserver, UUID)
        force_delete(apiserver, OTHER)


class CountedApi(PodApi):
    """The chart's pod requests, each counted by what it asks."""

    def __init__(self, api: PodApi):
        super().__init__(api.namespace, api.api)
        self.asked: list[str] = []

    def get(self, name):
        self.asked.append("get")
        return super().get(name)

    def on_node(self, node, driver, cached=False):
        self.asked.append("list cached" if cached else "list")
        return super().on_node(node, driver, cached)


def test_the_supervisors_round_is_one_listing_of_the_nodes_pods(apiserver, chart, plugin):
    """However many GPUs' daemons the supervisor looks at, a round asks the server once (from
    its watch cache); a pod deleted, another boot's or another UID's record: not alive."""
    launcher = chart.launcher(plugin)
    launcher.api = counted = CountedApi(chart.api)
    one, two = (launcher.launch(u, dirs(plugin, u), {}, "") for u in (UUID, OTHER))
    serving(plugin, UUID)
    serving(plugin, OTHER)
    recs = {UUID: one, OTHER: two, "GPU-none": None}
    try:  # the watch cache has the pods a moment after they are made
        wait_until(lambda: launcher.alive_all(recs) == {UUID: True, OTHER: True, "GPU-none": False}, 30, what="the pods listed")
        counted.asked.clear()
        assert launcher.alive_all(recs) == {UUID: True, OTHER: True, "GPU-none": False}
        assert counted.asked == ["list cached"]
        assert launcher.alive_all({UUID: one.model_copy(update={"pod_uid": "0000-1111"})}) == {UUID: False}
        assert chart.launcher(plugin, boot="boot-2").alive_all({UUID: one}) == {UUID: False}
        force_delete(apiserver, OTHER)
        wait_until(lambda: launcher.alive_all(recs)[OTHER] is False, 30, what="the deleted pod unlisted")
        assert launcher.alive_all(recs) == {UUID: True, OTHER: False, "GPU-none": False}
        counted.asked.clear()
        assert launcher.alive(one) and not launcher.alive(two)  # prepare's and a death's look: the pod itself
        assert counted.asked == ["get", "get"]
    finally:
        force_delete(apiserver, UUID)
        force_delete(apiserver, OTHER)


def test_a_supervisor_round_over_pods_lists_once_and_confirms_a_death(apiserver, chart, plugin):
    """The supervisor (agent/prepare/mps_watch.py) over the launcher's pods: a round of serving
    daemons is one listing and no fault; a daemon whose pod is gone is read once more (its
    pod, from etcd) before it counts as dead and the GPU as unhealthy."""
    from agent.prepare.mps import MpsDaemons
    from agent.prepare.mps_watch import MpsSupervisor

    launcher = chart.launcher(plugin)
    launcher.api = counted = CountedApi(chart.api)
    daemons = MpsDaemons(str(plugin), None, boot_id="boot-1", launcher=launcher)
    faults: list = []
    sup = MpsSupervisor(daemons, lambda uuid, fault: faults.append((uuid, fault)))
    for uuid in (UUID, OTHER):
        daemons.state.daemons[uuid] = launcher.launch(uuid, dirs(plugin, uuid), {}, "")  # as reconcile records them
        serving(plugin, uuid)
    daemons.wanted = {UUID, OTHER}
    try:
        wait_until(lambda: all(launcher.alive_all(daemons.watched()).values()), 30, what="the pods listed")
        counted.asked.clear()
        sup.check()
        assert (counted.asked, faults) == (["list cached"], [])
        force_delete(apiserver, OTHER)
        os.unlink(os.path.join(dirs(plugin, OTHER)["pipe"], "control"))
        wait_until(lambda: not launcher.alive_all(daemons.watched())[OTHER], 30, what="the deleted pod unlisted")
        counted.asked.clear()
        sup.check()  # the restart's own look (a get) finds no daemon binary here: test_mps_supervise restarts
        assert counted.asked == ["list cached", "get", "get"] and [(u, f[0]) for u, f in faults] == [(OTHER, "mps-daemon-down")]
    finally:
        force_delete(apiserver, UUID)
        force_delete(apiserver, OTHER)


@pytest.mark.root
@pytest.mark.parametrize("case", ["the gpu's tmpfs", "a plain directory", "the runtime's tmpfs"])
def test_the_pods_guard_runs_the_daemon_only_on_the_gpus_tmpfs(tmp_path, case):
    """The pod's /dev/shm must be the GPU's shm tmpfs: a pod the kubelet runs again after a
    reboot, before the agent mounted the tmpfs, finds a plain directory there; a runtime that
    kept its own /dev/shm gives another tmpfs. Either exits, saying why, instead of serving."""
    require_root()
    require_tool("unshare")
    gpu = tmp_path / "gpu"
    (gpu / "shm").mkdir(parents=True)
    setup = {"the gpu's tmpfs": 'mount -t tmpfs tmpfs "$1/shm" && mount --bind "$1/shm" /dev/shm',
             "a plain directory": 'mount --bind "$1/shm" /dev/shm',
             "the runtime's tmpfs": 'mount -t tmpfs tmpfs "$1/shm" && mount -t tmpfs tmpfs /dev/shm'}[case]
    guard = ["sh", "-c", mps_pods._GUARD, str(gpu), "echo", "serving"]
    ran = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", setup + ' && shift && exec "$@"',
                          "x", str(gpu), *guard], capture_output=True, text=True)  # fmt: skip
    if case == "the gpu's tmpfs":
        assert (ran.returncode, ran.stdout) == (0, "serving\n"), ran
    else:
        assert ran.returncode == 1 and f"not the MPS shm tmpfs at {gpu}/shm" in ran.stderr, ran


def test_doctor_checks_the_pods_permissions_as_the_agent(apiserver, chart, monkeypatch, tmp_path):
    """``sysdra doctor`` with ``nvidia_mps_pod``: SelfSubjectAccessReviews in the pods' namespace,
    allowed by the chart's Role, refused in another namespace (no Role there)."""
    from agent.tools.doctor import check_api

    monkeypatch.setenv("KUBECONFIG", chart.kubeconfig)
    found = {f.check: f for f in check_api("kube", chart.name, mps_namespace="sysdra")}
    assert found["rbac"].level == "ok" and found["rbac-mps"].level == "ok", found
    found = {f.check: f for f in check_api("kube", chart.name, mps_namespace="default")}
    assert found["rbac-mps"].level == "fail" and "create pods" in found["rbac-mps"].message


def test_without_the_api_a_daemons_pipe_says_whether_it_serves(chart, tmp_path):
    """The API server away (nothing listens at its address): the supervisor neither restarts a
    daemon whose pipe is there nor trusts one whose pipe is gone."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    config = yaml.safe_load(open(chart.kubeconfig))
    config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{port}"
    path = tmp_path / "away.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    away = PodApi("sysdra", ClaimApi(AsyncClient(config=KubeConfig.from_file(str(path)))))
    launcher = PodLauncher(chart.settings, str(tmp_path / "mps"), chart.name, "sysdra.io", "boot-1", "/",
                           lambda: (BINARY, LIBS), away)  # fmt: skip
    rec = MpsRecord(uuid=UUID, pod_uid="1234-abcd", boot_id="boot-1")
    assert not launcher.alive(rec) and launcher.alive_all({UUID: rec}) == {UUID: False}
    pipe = tmp_path / "mps" / UUID / "pipe"
    pipe.mkdir(parents=True)
    (pipe / "control").touch()
    assert launcher.alive(rec) and launcher.alive_all({UUID: rec}) == {UUID: True}
