"""`helm install` on the real node (tests/realnode.py: kubelet v1.37.2, containerd v2.4.2; the
chart's node is tests/helm_node.py): the
agent's image (Containerfile) imported into the node's containerd, the chart's DaemonSet pod
registers with the kubelet, publishes, prepares a workload pod's claim and moves a claimed NIC's
netdev into its pod (NRI, as the chart grants it); `helm upgrade` to
another tag rolls the agent with surge while pods keep being prepared; `helm uninstall` leaves
no slice, socket or CDI spec. With `nvidia.mps` the image's agent runs a shared GPU's MPS daemon
whose shm tmpfs reaches the node's containerd. With the node's own /sys the agent hears the
kernel's uevents. Root, podman and debootstrap (the image's base) needed."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time

import pytest

from tests.conftest import REPO, require_root, require_tool
from tests.controlplane import APIError, load_yaml, peer, unique
from tests.helm import CHART
from tests.helm_node import (
    NEXT, VERSION, HelmNode, agent_logs, agent_pods, build_images, claim_pod, delete_claim_pod, is_agent, mps_pods,
    run_helm, running_agents, wait, warnings, write_values,
)
from tests.realnode import DRIVER, RealNode

pytestmark = [pytest.mark.slow, pytest.mark.root]


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    require_root()
    for tool in ("unshare", "nsenter", "runc", "busybox", "podman", "debootstrap"):
        require_tool(tool)
    archives = build_images(str(tmp_path_factory.mktemp("images")))
    node = HelmNode(str(tmp_path_factory.mktemp("helmnode"))).start()
    # The node's init in the fixture's procfs, as a real node's /proc has it: a root process with
    # every capability in the host's network namespace (this VM's own init refuses even
    # CAP_SYS_PTRACE). The agent (hostPID) opens its /host/proc/1/ns/net as the host's network
    # namespace, which the kernel allows only with the init's capabilities or CAP_SYS_PTRACE.
    init = subprocess.Popen(["sleep", "infinity"])
    os.symlink(f"/proc/{init.pid}", os.path.join(node.root, "proc", "1"))
    try:
        for archive in archives:
            subprocess.run([*node.enter, peer("ctr"), "-a", node.socket, "-n", "k8s.io", "images", "import", archive],
                           check=True, capture_output=True, timeout=300)  # fmt: skip
        node.values = write_values(node)
        yield node
    finally:
        node.stop()
        init.kill()
        init.wait()


def count_running(node: RealNode, seen: set, stop: threading.Event) -> None:
    """How many agent pods run at once, sampled until ``stop``: a surge update runs two."""
    client = node.plane.http(cert=node.plane.admin_cert)  # a client of its own: the test's is busy meanwhile
    while not stop.is_set():
        pods = node.plane.request("GET", "/api/v1/namespaces/sysdra/pods", client=client).json()["items"]
        seen.add(sum(p["status"].get("phase") == "Running" for p in pods if is_agent(p)))
        time.sleep(0.1)
    client.close()


NIC, IFNAME = "nic-0000-3c-00-0", "enp60s0np0"  # the fixture's NIC and its netdev's name


def nic_pod_gets_its_netdev(node: RealNode, ns: str) -> None:
    """A pod with its own network namespace and a claim for the fixture NIC, whose netdev is a
    veth made here: the DaemonSet's agent (its capabilities, hostPID, the NRI socket and
    /var/run/netns as the chart mounts them) moves it in, named by the NicConfig, and back."""
    from agent.prepare import rtnl

    subprocess.run(["ip", "link", "add", IFNAME, "type", "veth", "peer", "name", "sdrhelm0"], check=True)
    try:
        selector = f'device.attributes["{DRIVER}"].interfaceName == "{IFNAME}"'
        node.plane.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "nic", "namespace": ns},
                           "spec": {"devices": {
                               "requests": [{"name": "net1", "exactly": {"deviceClassName": "nic.sysdra.io",
                                                                         "selectors": [{"cel": {"expression": selector}}]}}],
                               "config": [{"opaque": {"driver": DRIVER, "parameters": {
                                   "apiVersion": "sysdra.io/v1alpha1", "kind": "NicConfig", "interfaceName": "data0",
                                   "addresses": ["192.0.2.7/24"]}}}]}}})  # fmt: skip
        container = {"name": "app", "image": node.image, "imagePullPolicy": "Never",
                     "command": ["sh", "-c", "ip -o addr show data0; exec sleep 3600"], "resources": {"claims": [{"name": "nic"}]}}
        node.plane.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "nic", "namespace": ns},
                           "spec": {"automountServiceAccountToken": False, "terminationGracePeriodSeconds": 1,
                                    "dnsPolicy": "Default",  # the node has no cluster DNS: no warning event
                                    "resourceClaims": [{"name": "nic", "resourceClaimName": "nic"}], "containers": [container]}})  # fmt: skip
        wait(lambda: node.plane.get("Pod", "nic", ns)["status"].get("phase") == "Running", f"pod {ns}/nic running", node)
        def log():
            r = node.plane.request("GET", f"/api/v1/namespaces/{ns}/pods/nic/log", ok=False)
            return r.status_code == 200 and "inet " in r.text and r.text

        log = wait(log, f"pod {ns}/nic's log", node)
        assert "data0" in log and "inet 192.0.2.7/24" in log, log
        assert not rtnl.has_link("/proc/self/ns/net", IFNAME)
        node.plane.delete("Pod", "nic", ns)
        wait(lambda: rtnl.has_link("/proc/self/ns/net", IFNAME), f"{IFNAME} back on the host", node)
        node.plane.delete("ResourceClaim", "nic", ns)
    finally:
        subprocess.run(["ip", "link", "del", IFNAME], check=False)


def test_install_upgrade_uninstall(node):
    ns = unique("helm")
    node.plane.create_namespace(ns)
    node.plane.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": ns}})
    # the GKE-like policy is on: a system-node-critical pod where no quota covers it is refused
    critical = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "critical", "namespace": ns},
                "spec": {"priorityClassName": "system-node-critical", "containers": [{"name": "c", "image": "busybox"}]}}
    with pytest.raises(APIError, match="insufficient quota to match these scopes"):
        node.plane.request("POST", f"/api/v1/namespaces/{ns}/pods", body=critical, params={"dryRun": "All"})

    # install: the DaemonSet's pod publishes, registers, and prepares a claim
    run_helm(node, "install", "sysdra", CHART, "--namespace", "sysdra", "--create-namespace", "--values", node.values)
    wait(lambda: running_agents(node), "the agent pod running", node)
    wait(lambda: node.slices(), "the agent pod's ResourceSlices", node)
    uid = claim_pod(node, ns, "first")
    specs = [f for f in os.listdir(node.cdi_dir) if uid in f]
    assert specs
    for name in specs:
        with open(os.path.join(node.cdi_dir, name)) as f:
            assert '"/host/' not in f.read()  # host paths, never the pod's view under --root
    delete_claim_pod(node, ns, "first", uid)
    assert "the host's network namespace" not in agent_logs(node, 10000)  # its init's opened (SYS_PTRACE)
    nic_pod_gets_its_netdev(node, ns)

    # upgrade: surge, two agents side by side, and claims prepared and unprepared throughout
    (old,) = running_agents(node)
    assert old[1].endswith(":" + VERSION)
    seen, stop = set(), threading.Event()
    watch = threading.Thread(target=count_running, args=(node, seen, stop), daemon=True)
    watch.start()
    run_helm(node, "upgrade", "sysdra", CHART, "--namespace", "sysdra", "--values", node.values, "--set", f"image.tag={NEXT}")
    i = 0
    while True:
        now = running_agents(node)
        names = {pod["metadata"]["name"] for pod in agent_pods(node)}
        rolled = any(image.endswith(":" + NEXT) for _, image in now) and old[0] not in names
        i += 1
        uid = claim_pod(node, ns, f"during-{i}")
        delete_claim_pod(node, ns, f"during-{i}", uid)
        if rolled:
            break
        assert i < 30, f"the rollout did not finish: {agent_pods(node)}"
    stop.set()
    watch.join(10)
    assert 2 in seen, "the new agent never ran beside the old one"
    uid = claim_pod(node, ns, "after")
    delete_claim_pod(node, ns, "after", uid)
    assert warnings(node, ns) == []  # no prepare failed, not even once before a retry

    # uninstall: nothing of the driver is left on the node or in the cluster
    run_helm(node, "uninstall", "sysdra", "--namespace", "sysdra", "--wait")
    wait(lambda: not agent_pods(node), "the agent pods gone", node)
    wait(lambda: not node.slices(), "the slices gone (the kubelet wipes a driver gone for 30 s)", node, timeout=90)
    plugin_dir = os.path.join(node.kubelet_dir, "plugins", DRIVER)
    sockets = [f for f in os.listdir(plugin_dir) if f.endswith(".sock")] if os.path.isdir(plugin_dir) else []
    registry = [f for f in os.listdir(os.path.join(node.kubelet_dir, "plugins_registry")) if DRIVER in f]
    cdi = [f for f in os.listdir(node.cdi_dir) if DRIVER.split(".")[0] in f]
    assert (sockets, registry, cdi) == ([], [], [])
    assert not node.plane.list("DeviceClass") and not node.plane.list("ValidatingAdmissionPolicy")


def node_mps_mounts(node: RealNode) -> list[str]:
    """The MPS shm mounts in the node's mount namespace (where containerd binds them): point and
    super options of each."""
    out = subprocess.run([*node.enter, "cat", "/proc/self/mountinfo"], capture_output=True, text=True, check=True).stdout
    return [f"{line.split()[4]} {line.split(' - ', 1)[1].split()[2]}" for line in out.splitlines()
            if f"/plugins/{DRIVER}/mps/" in line.split()[4]]  # fmt: skip


def share_pod(node: RealNode, ns: str, gpus: list[dict]) -> list[str]:
    """A pod with a share of the first shared GPU (deploy/example-sharing.yaml's template) that
    lists its /dev/shm and mounts, then sleeps -> its log's lines."""
    bdf = min(gpus, key=lambda d: d["name"])["attributes"]["resource.kubernetes.io/pciBusID"]["string"]
    template = next(d for d in load_yaml(f"{REPO}/deploy/example-sharing.yaml") if d["metadata"]["name"] == "gpu-share-small")
    template["metadata"]["namespace"] = ns
    template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [
        {"cel": {"expression": f'device.attributes["resource.kubernetes.io"].pciBusID == "{bdf}"'}}]
    node.plane.create(template)
    container = {"name": "app", "image": node.image, "imagePullPolicy": "Never", "resources": {"claims": [{"name": "gpu"}]},
                 "command": ["sh", "-c", "ls /dev/shm; grep ' /dev/shm ' /proc/mounts; echo END; exec sleep 3600"]}
    node.plane.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "share", "namespace": ns},
                       "spec": {"automountServiceAccountToken": False, "hostNetwork": True, "terminationGracePeriodSeconds": 1,
                                "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu-share-small"}],
                                "containers": [container]}})  # fmt: skip

    def log():
        r = node.plane.request("GET", f"/api/v1/namespaces/{ns}/pods/share/log", ok=False)
        return r.status_code == 200 and "END" in r.text.split() and r.text.splitlines()

    return wait(log, f"pod {ns}/share's log", node)


def running_mps_pods(node: RealNode) -> list[tuple[str, str]]:
    return [(p["metadata"]["name"], p["metadata"]["uid"]) for p in mps_pods(node)
            if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]


def rebooted_with_a_prepared_share(node: RealNode, daemon: tuple[str, str]) -> None:
    """The next agent sees another boot ID (the fixture's procfs gets one): the daemon pod of
    the old boot is deleted, the prepared share's daemon started again in a new pod, on a new
    tmpfs (the old one unmounted)."""
    boot = os.path.join(node.root, "proc", "sys", "kernel", "random", "boot_id")
    os.makedirs(os.path.dirname(boot))
    try:
        with open(boot, "w") as f:
            f.write("rebooted-1\n")
        ((agent, _),) = running_agents(node)
        node.plane.delete("Pod", agent, "sysdra")
        wait(lambda: [a for a, _ in running_agents(node) if a != agent], "the agent after the reboot running", node)
        (now,) = wait(lambda: [p for p in running_mps_pods(node) if p != daemon] or None, "a new daemon pod", node)
        assert now[0] == daemon[0] and running_mps_pods(node) == [now]
        assert len(node_mps_mounts(node)) == 1
    finally:
        shutil.rmtree(os.path.join(node.root, "proc", "sys"))


@pytest.mark.parametrize("daemons", ["pod", "process"])
def test_mps_shares_through_the_chart(node, daemons):
    """``nvidia.mps: true`` with ``config.share: [gpu]``: the DaemonSet's agent, privileged with the
    plugins dir's Bidirectional propagation, mounts the GPU's shm tmpfs where the node's containerd
    binds it, and runs the node's simulated nvidia-cuda-mps-control (python3 of the built image, the
    host's libc beside the driver's libraries never loaded):
    in a pod of its own (``nvidia.mpsDaemons: pod``, the default) or as its own process. A share's
    pod gets the tmpfs as /dev/shm, with what the daemon wrote there; deleting the pod stops the
    daemon (its pod deleted) and unmounts the tmpfs. With pods, the daemon outlives the agent's
    pod: deleted, the DaemonSet's next agent adopts the same daemon pod while the share runs."""
    ns = unique("helm-mps")
    # the host's libc beside the driver's libraries, as on a real node: the image's loader must
    # never load it (agent/prepare/driverlinks.py); this one is no ELF file at all
    libc = os.path.join(node.root, "usr", "lib", "x86_64-linux-gnu", "libc.so.6")
    with open(libc, "w") as f:
        f.write("the host's libc\n")
    node.plane.create_namespace(ns)
    node.plane.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": ns}})
    run_helm(node, "install", "sysdra", CHART, "--namespace", "sysdra", "--create-namespace", "--values", node.values,
             "--set", "nvidia.mps=true", "--set", f"nvidia.mpsDaemons={daemons}", "--set", "config.share={gpu}")  # fmt: skip
    try:
        wait(lambda: running_agents(node), "the agent pod running", node)
        gpus = wait(lambda: [d for s in node.slices() for d in s["spec"].get("devices", [])
                             if d["name"].startswith("gpu-") and d.get("allowMultipleAllocations")],
                    "the agent pod's shared GPUs", node)  # fmt: skip
        lines = share_pod(node, ns, gpus)
        assert len([x for x in lines if x.startswith("fake-mps-")]) == 1, lines  # written by the daemon
        assert any(x.split()[1:3] == ["/dev/shm", "tmpfs"] and "size=1048576k" in x for x in lines), lines
        mounts = node_mps_mounts(node)
        assert len(mounts) == 1 and mounts[0].endswith("/shm rw,size=1048576k"), mounts
        if daemons == "pod":
            (daemon,) = running_mps_pods(node)
            assert daemon[0].startswith("sysdra-mps-gpu-"), daemon
            (agent, _), = running_agents(node)
            node.plane.delete("Pod", agent, "sysdra")
            wait(lambda: [a for a, _ in running_agents(node) if a != agent], "the next agent pod running", node)
            assert running_mps_pods(node) == [daemon]  # the same pod served throughout, adopted
            assert node.plane.get("Pod", "share", ns)["status"]["phase"] == "Running"
            assert len(node_mps_mounts(node)) == 1
            rebooted_with_a_prepared_share(node, daemon)
        else:
            assert mps_pods(node) == []
        node.plane.delete("Pod", "share", ns)
        wait(lambda: not node_mps_mounts(node), "the shm tmpfs unmounted on the node", node)
        wait(lambda: not mps_pods(node), "the MPS daemon's pod deleted", node)
        assert warnings(node, ns) == []
    finally:  # a failure halfway leaves nothing to the next test: the share unprepared, the daemon gone
        node.plane.delete("Pod", "share", ns)
        wait(lambda: node.plane.request("GET", f"/api/v1/namespaces/{ns}/pods/share", ok=False).status_code == 404,
             "the share's pod gone", node)  # fmt: skip
        run_helm(node, "uninstall", "sysdra", "--namespace", "sysdra", "--wait")
        wait(lambda: not agent_pods(node), "the agent pods gone", node)
        for pod in mps_pods(node):
            node.plane.delete("Pod", pod["metadata"]["name"], "sysdra")
        wait(lambda: not mps_pods(node), "no daemon pod left", node)
        os.unlink(libc)


def test_the_nodes_own_sysfs_is_watched_by_uevents(node):
    """``hostPaths.sys`` at the node's own /sys, as on any real node (the other tests give a fixture
    tree): the agent's /host/sys is then the kernel's sysfs, where inotify sees no change, so it
    listens to the kernel's uevents, and a change to one of this machine's PCI functions reaches it."""
    bdf = sorted(os.listdir("/sys/bus/pci/devices"))[0]
    run_helm(node, "install", "sysdra", CHART, "--namespace", "sysdra", "--create-namespace", "--values", node.values,
             "--set", "hostPaths.sys=/sys", "--set", "config.logLevel=debug")  # fmt: skip
    try:
        wait(lambda: running_agents(node), "the agent pod running", node)
        wait(lambda: "watching kernel uevents for pci" in agent_logs(node, 10000), "the agent on kernel uevents", node)
        with open(f"/sys/bus/pci/devices/{bdf}/uevent", "w") as f:
            f.write("change")
        wait(lambda: f"uevent change /devices/" in (logs := agent_logs(node, 10000)) and f"{bdf} (pci)" in logs,
             f"the uevent of {bdf} in the agent's log", node)  # fmt: skip
        assert "watching file events" not in agent_logs(node, 10000)
    finally:
        run_helm(node, "uninstall", "sysdra", "--namespace", "sysdra", "--wait")
        wait(lambda: not agent_pods(node), "the agent pods gone", node)
        wait(lambda: not node.slices(), "the slices gone", node, timeout=90)
