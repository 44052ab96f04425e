"""The agent's real customers: kubelet v1.37.2 and containerd v2.4.2 (tests/realnode.py) run
the Pods whose claims sysdra prepares, mirroring the kubelet's own DRA node tests. One node
for the module (it starts in about 10 s warm); tests keep apart by namespace. Root only.

What the stand-ins could not show and this found: the CDI ``hostPath`` was the agent's own
view (``<root>/dev/...``), which the runtime cannot see, so every device node got runc's
default mode (test_pod_with_a_claim_gets_its_devices_env_and_metadata checks the mode).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading

import pytest

from tests.cluster import example_pod
from tests.conftest import REPO, require_tool
from tests.controlplane import load_yaml
from tests.faults import harness
from tests.realnode import DRIVER, RUNNING, RealNode
from tests.realnode_leftovers import HostState
from tests.realnode_pods import (
    GPU_REQUEST, METADATA, allocated, claim_specs, create_pod, delete_pod, device_nodes, module_node, namespace, running_log,
    running_log_until, wait,
)

pytestmark = [pytest.mark.slow, pytest.mark.root]


@pytest.fixture(scope="module")
def realnode(tmp_path_factory):
    yield from module_node(tmp_path_factory, "realnode")


def test_pod_with_a_claim_gets_its_devices_env_and_metadata(realnode):
    ns = namespace(realnode)
    claim = realnode.plane.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                   "metadata": {"name": "gpu", "namespace": ns}, "spec": GPU_REQUEST})  # fmt: skip
    uid = claim["metadata"]["uid"]
    script = ("cat /usr/local/nvidia/lib64/libcuda.so.1 /usr/local/nvidia/lib64/libnvidia-ptxjitcompiler.so.1; echo; "
              "echo LD=$LD_LIBRARY_PATH; ls /usr/bin/nvidia-smi /lib/firmware/nvidia/580.159.04; "
              f"for n in $(ls /dev | grep nvidia); do stat -c '%n %F %t:%T %a' /dev/$n; done; env | grep ^SYSDRA_ | sort; "
              f"echo METADATA; cat {METADATA}/resourceclaims/gpu/gpu/{DRIVER}-metadata.json; echo")  # fmt: skip
    create_pod(realnode, ns, "app", script, claims=[{"name": "gpu", "resourceClaimName": "gpu"}])
    lines = running_log(realnode, ns, "app")

    # written once the pod started (the writer waits for a pause in the kubelet's calls)
    claim = wait(lambda: (c := realnode.plane.get("ResourceClaim", "gpu", ns))["status"].get("devices") and c,
                 "the claim's status.devices", realnode, log="agent")
    (device,) = allocated(claim)
    # the NVIDIA user-space driver of the fixture's kernel module, from the claim's CDI spec (docs/nvidia.md)
    assert lines[:2] == ["fixture: libcuda.so.580.159.04", "fixture: libnvidia-ptxjitcompiler.so.580.159.04"], lines
    assert "LD=/usr/local/nvidia/lib:/usr/local/nvidia/lib64" in lines and "/usr/bin/nvidia-smi" in lines, lines
    assert "gsp_ga10x.bin" in lines, lines
    for n in device_nodes(realnode, device):
        # the fixture's nodes are 0640: the runtime stats the host's node (no hostPath of the agent's view)
        assert f"{n.path} character special file {n.major:x}:{n.minor:x} 640" in lines, lines
    env = lines[lines.index("METADATA") - 4: lines.index("METADATA")]
    assert f"SYSDRA_CLAIM_UID={uid}" in env and f"SYSDRA_DEVICES={device}" in env, lines
    metadata = json.JSONDecoder().raw_decode(lines[lines.index("METADATA") + 1])[0]
    assert metadata["metadata"]["uid"] == uid
    assert [d["name"] for r in metadata["requests"] for d in r["devices"]] == [device]
    (status,) = claim["status"]["devices"]
    assert (status["driver"], status["pool"], status["device"]) == (DRIVER, realnode.name, device)
    assert [c["type"] for c in status["conditions"] if c["status"] == "True"] == ["Ready"]
    for name in claim_specs(realnode, uid):
        with open(os.path.join(realnode.cdi_dir, name)) as f:
            assert realnode.host not in f.read()  # the agent's view of the host is no path for the runtime

    delete_pod(realnode, ns, "app")
    wait(lambda: not claim_specs(realnode, uid), "CDI specs removed by unprepare", realnode)
    wait(lambda: not realnode.plane.get("ResourceClaim", "gpu", ns)["status"].get("devices"), "status.devices removed", realnode)


def test_claims_from_a_template_and_from_an_extended_resource(realnode):
    ns = namespace(realnode)
    realnode.plane.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                           "metadata": {"name": "one-gpu", "namespace": ns}, "spec": {"spec": GPU_REQUEST}})  # fmt: skip
    script = "env | grep ^SYSDRA_GPU_PCI_BUS_IDS="
    create_pod(realnode, ns, "templated", script, claims=[{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])
    create_pod(realnode, ns, "extended", script, limits={"sysdra.io/gpu": "1"})
    got = {}
    for pod in ("templated", "extended"):
        lines = running_log(realnode, ns, pod)
        got[pod] = [line for line in lines if line.startswith("SYSDRA_GPU_PCI_BUS_IDS=")]
        assert len(got[pod]) == 1, lines
    assert got["templated"] != got["extended"]  # two claims, two GPUs
    claims = wait(lambda: (cs := realnode.plane.list("ResourceClaim", ns)) and all(c["status"].get("devices") for c in cs) and cs,
                  "both claims' status.devices", realnode, log="agent")
    assert len(claims) == 2
    for pod in ("templated", "extended"):
        delete_pod(realnode, ns, pod)


def test_agent_killed_and_gone_past_30s_under_a_running_pod(realnode):
    """SIGKILL under a running pod; a pod created meanwhile stays pending; the kubelet wipes the
    driver's slices after 30 s without a connected plugin; the restarted agent republishes,
    the waiting pod runs, and the first pod's claim is unprepared when it goes."""
    ns = namespace(realnode)
    claims = [realnode.plane.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                     "metadata": {"name": name, "namespace": ns}, "spec": GPU_REQUEST})
              for name in ("gpu", "later")]  # fmt: skip
    create_pod(realnode, ns, "app", "true", claims=[{"name": "gpu", "resourceClaimName": "gpu"}])
    running_log(realnode, ns, "app")
    realnode.stop_process("agent", signal.SIGKILL)
    create_pod(realnode, ns, "later", "true", claims=[{"name": "gpu", "resourceClaimName": "later"}])
    wait(lambda: realnode.plane.get("ResourceClaim", "later", ns)["status"].get("reservedFor"), "the later pod scheduled", realnode)
    wait(lambda: not realnode.slices(), "the kubelet wiping the slices of a driver gone for 30 s", realnode, timeout=75)
    assert realnode.plane.get("Pod", "app", ns)["status"]["phase"] == "Running"
    assert realnode.plane.get("Pod", "later", ns)["status"]["phase"] == "Pending"  # no plugin to prepare its claim
    realnode.start_agent()  # waits for its slices
    running_log(realnode, ns, "later")
    assert realnode.plane.get("Pod", "app", ns)["status"]["phase"] == "Running"
    uid = claims[0]["metadata"]["uid"]
    assert claim_specs(realnode, uid)
    for pod in ("app", "later"):
        delete_pod(realnode, ns, pod)
    wait(lambda: not any(claim_specs(realnode, c["metadata"]["uid"]) for c in claims), "unprepare by the restarted agent", realnode)


def test_prepare_fails_then_succeeds_on_the_kubelets_retry(realnode):
    """The allocated GPU is gone at prepare time (hot-unplugged after allocation): the prepare
    fails, the pod waits; the GPU comes back and the kubelet's retry prepares it."""
    ns = namespace(realnode)
    claim = realnode.plane.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                   "metadata": {"name": "gpu", "namespace": ns}, "spec": GPU_REQUEST})  # fmt: skip
    devices = sorted({d["name"] for s in realnode.slices() for d in s["spec"].get("devices", []) if d["name"].startswith("gpu-")})
    gone = devices[-1]
    # bound and allocated as the scheduler would, to a device that goes before the kubelet prepares
    pod = create_pod(realnode, ns, "app", "env | grep ^SYSDRA_DEVICES=", claims=[{"name": "gpu", "resourceClaimName": "gpu"}],
                     scheduler="nobody")  # fmt: skip
    hotplug = harness.Node(realnode.dir, copy_root=False)
    hotplug.unplug(gone)
    try:
        wait(lambda: gone not in {d["name"] for s in realnode.slices() for d in s["spec"].get("devices", [])},
             "the agent's rescan without the unplugged GPU", realnode, log="agent")  # fmt: skip
        where = {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [realnode.name]}]}]}
        status = {"allocation": {"devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": realnode.name, "device": gone}]},
                                 "nodeSelector": where},
                  "reservedFor": [{"resource": "pods", "name": "app", "uid": pod["metadata"]["uid"]}]}  # fmt: skip
        realnode.plane.request("PUT", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/gpu/status",
                               body=dict(claim, status=status))  # fmt: skip
        realnode.plane.request("POST", f"/api/v1/namespaces/{ns}/pods/app/binding", body={
            "apiVersion": "v1", "kind": "Binding", "metadata": {"name": "app"}, "target": {"kind": "Node", "name": realnode.name}})  # fmt: skip
        failed = wait(lambda: [e for e in realnode.plane.list("Event", ns) if e.get("reason") == "FailedPrepareDynamicResources"],
                      "the kubelet's failed prepare", realnode)  # fmt: skip
        assert gone in failed[0]["message"], failed[0]["message"]
        assert realnode.plane.get("Pod", "app", ns)["status"]["phase"] == "Pending"
    finally:
        hotplug.replug(gone)
    assert f"SYSDRA_DEVICES={gone}" in running_log(realnode, ns, "app")
    delete_pod(realnode, ns, "app")


def test_kubelet_restart_under_a_running_pod(realnode):
    """At start the kubelet deletes the node's slices; the agent's slice watch republishes. The
    pod that kept running keeps its claim; a pod deleted while the kubelet was down is
    unprepared after it returns."""
    ns = namespace(realnode)
    claims = {pod: realnode.plane.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                          "metadata": {"name": pod, "namespace": ns}, "spec": GPU_REQUEST})
              for pod in ("app", "gone")}  # fmt: skip
    for pod in claims:
        create_pod(realnode, ns, pod, "true", claims=[{"name": "gpu", "resourceClaimName": pod}])
        running_log(realnode, ns, pod)
    before = {s["metadata"]["uid"] for s in realnode.slices()}
    realnode.stop_process("kubelet")
    # deleted for good while no kubelet runs (grace 0: the API forgets it at once)
    realnode.plane.request("DELETE", f"/api/v1/namespaces/{ns}/pods/gone", params={"gracePeriodSeconds": "0"})
    realnode.start_kubelet()
    wait(lambda: (now := {s["metadata"]["uid"] for s in realnode.slices()}) and not now & before,
         "slices deleted by the kubelet's start and published again", realnode)  # fmt: skip
    wait(lambda: not claim_specs(realnode, claims["gone"]["metadata"]["uid"]), "the deleted pod's claim unprepared", realnode)
    assert realnode.plane.get("Pod", "app", ns)["status"]["phase"] == "Running"
    assert claim_specs(realnode, claims["app"]["metadata"]["uid"])
    delete_pod(realnode, ns, "app")


@pytest.fixture
def nic_netdevs(realnode):
    """A real netdev (a veth) under each fixture NIC's interface name, on the host: the NRI plugin
    moves the claimed one into the pod."""
    from discovery.inventory import scan

    require_tool("ip")
    names = [d.nic.interfaces[0].name for d in scan(realnode.root).devices if d.nic and d.nic.interfaces]
    made = []
    for i, name in enumerate(names):
        if subprocess.run(["ip", "link", "add", name, "type", "veth", "peer", "name", f"sdrex{i}"]).returncode == 0:
            made.append(name)
    yield
    for name in made:
        subprocess.run(["ip", "link", "del", name], check=False)


def test_the_deploy_example_runs(realnode, tmp_path, nic_netdevs):
    """deploy/example-claim.yaml as `make cluster` offers it (a GPU and a NIC from a template)."""
    ns = namespace(realnode)
    docs = load_yaml(example_pod(str(tmp_path / "example.yaml"), realnode.image))
    for doc in docs:
        doc["metadata"]["namespace"] = ns
        realnode.plane.create(doc)
    lines = running_log_until(realnode, ns, "gpu-nic-demo", "SYSDRA_CLAIM_UID=")
    devices = next(line for line in lines if line.startswith("SYSDRA_DEVICES=")).split("=", 1)[1].split(",")
    assert [d.split("-", 1)[0] for d in devices] == ["gpu", "nic"], lines
    delete_pod(realnode, ns, "gpu-nic-demo")


def test_two_pods_share_one_gpu(realnode):
    """``--share gpu``: two pods, each with a claim for a share of the same GPU (deploy/
    example-sharing.yaml's template pinned to one GPU), run at once with their own share, as
    clients of the GPU's MPS daemon: their /dev/shm (containerd's CDI mount) is the daemon's shm
    tmpfs, where the simulated daemon wrote a file through its own /dev/shm."""
    ns = namespace(realnode)
    template = next(d for d in load_yaml(f"{REPO}/deploy/example-sharing.yaml") if d["metadata"]["name"] == "gpu-share-small")
    template["metadata"]["namespace"] = ns
    realnode.stop_process("agent")
    realnode.start_agent("--share", "gpu", propagation="shared")  # the chart's nvidia.mps
    try:
        gpu = min((d for s in realnode.slices() for d in s["spec"].get("devices", []) if d["name"].startswith("gpu-")),
                  key=lambda d: d["name"])  # fmt: skip
        assert gpu.get("allowMultipleAllocations"), gpu
        bdf = gpu["attributes"]["resource.kubernetes.io/pciBusID"]["string"]
        template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [
            {"cel": {"expression": f'device.attributes["resource.kubernetes.io"].pciBusID == "{bdf}"'}}]
        realnode.plane.create(template)
        for pod in ("one", "two"):
            create_pod(realnode, ns, pod, "env | grep ^SYSDRA_ | sort; ls /dev/shm; grep ' /dev/shm ' /proc/mounts",
                       claims=[{"name": "gpu", "resourceClaimTemplateName": "gpu-share-small"}])
        logs = {pod: running_log(realnode, ns, pod) for pod in ("one", "two")}
        for lines in logs.values():
            assert f"SYSDRA_GPU_PCI_BUS_IDS={bdf}" in lines, lines
            assert len([x for x in lines if x.startswith("fake-mps-")]) == 1, lines  # one daemon for the GPU
            assert any(x.split()[1:3] == ["/dev/shm", "tmpfs"] and "size=1048576k" in x for x in lines), lines
        results = [r for c in realnode.plane.list("ResourceClaim", ns) for r in c["status"]["allocation"]["devices"]["results"]]
        assert len(results) == 2 and {r["device"] for r in results} == {gpu["name"]}
        assert len({r["shareID"] for r in results}) == 2, results
        for pod in ("one", "two"):
            delete_pod(realnode, ns, pod)
    finally:
        realnode.stop_process("agent")
        realnode.start_agent()


def test_rolling_update_without_a_failed_prepare(realnode):
    """Two instances with ``--rolling-update-uid`` (the DaemonSet's surge): pods created before,
    during and after the switch all run, the kubelet never fails a prepare, and the new instance
    unprepares what the old one prepared."""
    ns = namespace(realnode)
    claims = [realnode.plane.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                     "metadata": {"name": pod, "namespace": ns}, "spec": GPU_REQUEST})
              for pod in ("before", "during", "after")]  # fmt: skip
    realnode.stop_process("agent")
    try:
        realnode.start_agent("--rolling-update-uid", "old", name="agent-old")
        create_pod(realnode, ns, "before", "true", claims=[{"name": "gpu", "resourceClaimName": "before"}])
        running_log(realnode, ns, "before")
        realnode.start_agent("--rolling-update-uid", "new", name="agent-new")
        create_pod(realnode, ns, "during", "true", claims=[{"name": "gpu", "resourceClaimName": "during"}])
        running_log(realnode, ns, "during")
        realnode.stop_process("agent-old")
        create_pod(realnode, ns, "after", "true", claims=[{"name": "gpu", "resourceClaimName": "after"}])
        running_log(realnode, ns, "after")
        for pod in ("before", "during", "after"):
            delete_pod(realnode, ns, pod)
        wait(lambda: not any(claim_specs(realnode, c["metadata"]["uid"]) for c in claims), "unprepared by the new instance", realnode)
        failed = [e["message"] for e in realnode.plane.list("Event", ns) if e.get("reason") == "FailedPrepareDynamicResources"]
        assert not failed, failed
    finally:
        for name in ("agent-old", "agent-new"):
            realnode.stop_process(name)
        realnode.start_agent()


def test_the_first_published_slice_already_carries_the_health_taint(realnode):
    """``--taint-unhealthy``: the fixture's NIC with its link down is tainted in every version of
    the slice the server ever holds, the first included (the first health check at start was
    missed: for one interval the scheduler could allocate the unhealthy NIC)."""
    realnode.stop_process("agent")
    for s in realnode.slices():
        realnode.plane.delete("ResourceSlice", s["metadata"]["name"])
    rv = realnode.plane.request("GET", "/apis/resource.k8s.io/v1/resourceslices").json()["metadata"]["resourceVersion"]
    events: list[dict] = []

    def watch():
        params = {"watch": "true", "resourceVersion": rv, "timeoutSeconds": "15", "fieldSelector": f"spec.nodeName={realnode.name}"}
        with realnode.plane.http().stream("GET", "/apis/resource.k8s.io/v1/resourceslices", params=params, timeout=40) as r:
            events.extend(json.loads(line) for line in r.iter_lines() if line.strip())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        realnode.start_agent("--taint-unhealthy")
        watcher.join(30)
    finally:
        realnode.stop_process("agent")
        realnode.start_agent()

    def tainted(obj: dict) -> set[str]:
        return {d["name"] for d in obj["spec"].get("devices", []) if d.get("taints")}

    versions = [e["object"] for e in events if e["type"] in ("ADDED", "MODIFIED")]
    assert versions and tainted(versions[-1]), events  # the down NIC is tainted by the end
    assert [tainted(v) for v in versions] == [tainted(versions[-1])] * len(versions)


def agent_says(node: RealNode, text: str) -> bool:
    return text in node.log_tail("agent", 2000)


def test_the_agents_nri_plugin_registers_and_sees_pod_sandboxes(realnode):
    """containerd's NRI calls the agent's plugin (agent/nri/) over its socket: registration,
    synchronization, and RunPodSandbox/StopPodSandbox/RemovePodSandbox of a kubelet's pod."""
    def synced() -> bool:  # this run's: an earlier agent's line may be in the log too
        text = realnode.log_tail("agent", 2000)
        return text.rfind("NRI: synchronized with") > text.rfind(RUNNING) >= 0

    wait(synced, "the agent's NRI plugin registered and synchronized", realnode, log="agent")
    assert agent_says(realnode, "NRI: configured by containerd")
    ns = namespace(realnode)
    create_pod(realnode, ns, "nri", "true")
    running_log(realnode, ns, "nri")
    assert agent_says(realnode, f"NRI: pod sandbox {ns}/nri started (host network)")
    delete_pod(realnode, ns, "nri")
    for event in ("stopped", "removed"):
        wait(lambda: agent_says(realnode, f"NRI: pod sandbox {ns}/nri {event}"), f"RemovePodSandbox of {ns}/nri", realnode,
             log="agent")  # fmt: skip


def test_zz_the_node_leaves_nothing_behind(realnode):
    """Last in the module: stop the node; no process, mount, socket or file of it is left
    outside its directory, and the host's sysctls are as they were."""
    realnode.stop()
    problems = realnode.before.compare(HostState.take(), node_dir=realnode.dir, cgroup_root=realnode.cgroup_root)
    assert not problems, "\n".join(problems)
