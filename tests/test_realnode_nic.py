"""A claimed NIC's netdev in its pod on the real node (tests/realnode.py: kubelet v1.37.2,
containerd v2 with NRI, the CNI bridge): the agent's NRI plugin moves a real netdev (a veth the
test creates under the fixture NIC's interface name) into the pod's own network namespace,
configured from the claim's ``NicConfig``, writes the device metadata (generation 2, with the
IPs) and ``status.devices[].networkData`` before the app container starts, and gives the netdev
back when the pod goes. Crashes: the agent SIGKILLed between the move and the metadata write,
containerd restarted under a running pod. Root only.

A veth is a virtual link: it dies with a namespace the runtime destroys while it is inside, where
a physical NIC comes back to the host (docs/networking.md). The tests keep to what both do.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading

import psutil
import pytest

from tests.conftest import REPO
from tests.controlplane import peer
from tests.realnode import DRIVER, RealNode
from tests.realnode_leftovers import HostState
from tests.realnode_pods import allocated, create_pod, delete_pod, module_node, namespace, running_log, wait

pytestmark = [pytest.mark.slow, pytest.mark.root]
METADATA = "/var/run/kubernetes.io/dra-device-attributes"
NIC, IFNAME = "nic-0000-3c-00-0", "enp60s0np0"  # the fixture's NIC and its netdev's name
HOST_NET = "/proc/self/ns/net"
CONFIG = {"interfaceName": "data0", "mtu": 1400, "addresses": ["192.0.2.5/24", "2001:db8::5/64"],
          "routes": [{"destination": "198.51.100.0/24", "gateway": "192.0.2.1"}]}


@pytest.fixture(scope="module")
def realnode(tmp_path_factory):
    yield from module_node(tmp_path_factory, "realnode", "ip")


@pytest.fixture
def veth():
    """A real netdev under the fixture NIC's interface name, on the host."""
    subprocess.run(["ip", "link", "add", IFNAME, "type", "veth", "peer", "name", "sdrpeer0"], check=True)
    yield
    subprocess.run(["ip", "link", "del", IFNAME], check=False)


def nic_pod(node: RealNode, script: str, config: dict | None = None, annotations: dict | None = None) -> str:
    """A pod with its own network namespace and a claim for the fixture NIC (request ``net1``,
    ``config`` as its NicConfig); its namespace."""
    ns = namespace(node)
    selector = f'device.attributes["{DRIVER}"].interfaceName == "{IFNAME}"'
    devices = {"requests": [{"name": "net1", "exactly": {"deviceClassName": "nic.sysdra.io",
                                                         "selectors": [{"cel": {"expression": selector}}]}}]}  # fmt: skip
    if config:
        devices["config"] = [{"requests": ["net1"], "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "sysdra.io/v1alpha1", "kind": "NicConfig", **config}}}]
    node.plane.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "nic", "namespace": ns},
                       "spec": {"devices": devices}})  # fmt: skip
    create_pod(node, ns, "app", script, claims=[{"name": "nic", "resourceClaimName": "nic"}], host_network=False,
               annotations=annotations)
    return ns


def agent_count(node: RealNode, text: str) -> int:
    return node.log_tail("agent", 100000).count(text)


def moves(node: RealNode) -> list[dict]:
    """The netdev records of the prepared claims (the step's, in the checkpoint)."""
    from agent.prepare.checkpoint import Checkpoint

    cp = Checkpoint.load(os.path.join(node.kubelet_dir, "plugins", DRIVER, "checkpoint.json"), move_corrupt=False)
    return [m for e in cp.claims.values() for m in e.get("netdevs") or ()]


def host_metadata(node: RealNode, ns: str) -> dict:
    from agent.prepare.metadata import layout

    with open(layout.host_file(os.path.join(node.kubelet_dir, "plugins", DRIVER), ns, "nic", "net1")) as f:
        return json.JSONDecoder().raw_decode(f.read())[0]


def nri_status(node: RealNode) -> dict:
    """The NRI plugin's state as `sysdra status` reports it."""
    out = subprocess.run([sys.executable, "-m", "agent", "status", "-o", "json", "--kubelet-dir", node.kubelet_dir],
                         cwd=REPO, capture_output=True, text=True, timeout=30, check=True)
    return json.loads(out.stdout)["nri"]


def network_status(node: RealNode, ns: str) -> dict | None:
    devices = node.plane.get("ResourceClaim", "nic", ns)["status"].get("devices") or []
    return next((d.get("networkData") for d in devices if d.get("networkData", {}).get("ips")), None)


def test_the_netdev_is_in_the_pod_configured_with_its_metadata_and_status(realnode, veth):
    """Name, MTU, addresses and route from the claim's NicConfig inside the pod (``ip`` in the
    pod's log), the metadata rewritten (generation 2, IPs) before the container started,
    ``networkData`` in the claim's status; back on the host under its name once the pod is gone."""
    from agent.prepare import rtnl

    script = (f"ip -o link show data0; ip -o addr show data0; ip route show dev data0; echo METADATA; "
              f"cat {METADATA}/resourceclaims/nic/net1/{DRIVER}-metadata.json; echo")
    ns = nic_pod(realnode, script, CONFIG)
    lines = running_log(realnode, ns, "app")
    assert any(re.match(r"\d+: data0[@:].*mtu 1400", line) and ",UP" in line for line in lines), lines
    assert any("inet 192.0.2.5/24" in line for line in lines) and any("inet6 2001:db8::5/64" in line for line in lines), lines
    assert any(line.startswith("198.51.100.0/24 via 192.0.2.1") for line in lines), lines
    metadata = json.JSONDecoder().raw_decode(lines[lines.index("METADATA") + 1])[0]
    assert metadata["metadata"]["generation"] == 2, metadata  # rewritten by the NRI hook, before the container
    (device,) = [d for r in metadata["requests"] for d in r["devices"]]
    net = device["networkData"]
    assert net["interfaceName"] == "data0" and net["ips"] == ["192.0.2.5/24", "2001:db8::5/64"] and net["hardwareAddress"]
    status = wait(lambda: network_status(realnode, ns), "status.devices[].networkData with the IPs", realnode, log="agent")
    assert status["interfaceName"] == "data0" and status["hardwareAddress"] == net["hardwareAddress"]
    assert sorted(status["ips"]) == ["192.0.2.5/24", "2001:db8::5/64"]
    assert not rtnl.has_link(HOST_NET, IFNAME) and [m["state"] for m in moves(realnode)] == ["in-pod"]
    assert allocated(realnode.plane.get("ResourceClaim", "nic", ns)) == [NIC]
    delete_pod(realnode, ns, "app")
    wait(lambda: rtnl.has_link(HOST_NET, IFNAME), f"{IFNAME} back on the host", realnode, log="agent")
    assert not rtnl.has_link(HOST_NET, "data0")


def test_a_netdev_holding_the_hosts_address_stays_with_the_host_until_it_no_longer_does(realnode, veth):
    """The host's address on the NIC's netdev (a storage network, say): the kubelet's prepare fails
    with why (prepare/hostuse.py), the pod waits and the netdev keeps its address on the host. Once
    the host no longer uses it, the kubelet's retry prepares the claim and the pod gets it."""
    from agent.prepare import rtnl

    subprocess.run(["ip", "addr", "add", "198.18.0.1/24", "dev", IFNAME], check=True)
    ns = nic_pod(realnode, "ip -o link show net1")
    failed = wait(lambda: [e for e in realnode.plane.list("Event", ns) if e.get("reason") == "FailedPrepareDynamicResources"],
                  "the kubelet's failed prepare", realnode, log="agent")  # fmt: skip
    message = failed[0]["message"]
    assert f"the host uses it: netdev {IFNAME} (0000:3c:00.0): it holds the host's address 198.18.0.1/24" in message, message
    assert "allow_host_in_use_nics is off" in message, message
    assert realnode.plane.get("Pod", "app", ns)["status"]["phase"] == "Pending"
    assert rtnl.has_link(HOST_NET, IFNAME) and not moves(realnode)
    subprocess.run(["ip", "addr", "del", "198.18.0.1/24", "dev", IFNAME], check=True)
    lines = running_log(realnode, ns, "app")  # the kubelet's retry
    assert any(re.match(r"\d+: net1[@:]", line) for line in lines), lines
    delete_pod(realnode, ns, "app")
    wait(lambda: rtnl.has_link(HOST_NET, IFNAME), f"{IFNAME} back on the host", realnode, log="agent")


def test_a_pods_netdev_gets_a_lease_from_the_nodes_ipam_pool(realnode, veth):
    """An agent with an IPAM pool (Debian's host-local, the node's CNI plugin under the root's
    /opt/cni/bin): the claim's NicConfig names the pool, the pod's netdev has the leased address
    and the pool's default route in its sandbox before the app starts, its status and metadata say
    it, and the lease is given back when the pod goes."""
    from agent.prepare import rtnl

    cni = os.path.join(realnode.root, "opt", "cni")
    os.makedirs(cni, exist_ok=True)
    if not os.path.islink(os.path.join(cni, "bin")):
        os.symlink("/usr/lib/cni", os.path.join(cni, "bin"))
    pool = {"type": "host-local", "ranges": [[{"subnet": "10.77.0.0/24", "rangeStart": "10.77.0.10", "gateway": "10.77.0.1"}]],
            "routes": [{"dst": "0.0.0.0/0"}]}  # fmt: skip
    store = os.path.join(realnode.kubelet_dir, "plugins", DRIVER, "ipam", "sysdra-data")
    realnode.stop_process("agent")
    realnode.start_agent(env={"SYSDRA_NIC_IPAM": json.dumps({"data": pool})})
    try:
        ns = nic_pod(realnode, "ip -o addr show net1; ip route show default", {"ipamPool": "data"})
        lines = running_log(realnode, ns, "app")
        assert any("inet 10.77.0.10/24" in line for line in lines), lines
        assert any(line.startswith("default via 10.77.0.1 dev net1") for line in lines), lines
        status = wait(lambda: network_status(realnode, ns), "status.devices[].networkData with the lease", realnode, log="agent")
        assert status["ips"] == ["10.77.0.10/24"] and host_metadata(realnode, ns)["metadata"]["generation"] == 2
        assert "10.77.0.10" in os.listdir(store) and [m["leased"] for m in moves(realnode)] == [["10.77.0.10/24"]]
        delete_pod(realnode, ns, "app")
        wait(lambda: rtnl.has_link(HOST_NET, IFNAME), f"{IFNAME} back on the host", realnode, log="agent")
        wait(lambda: "10.77.0.10" not in os.listdir(store), "the lease given back", realnode, log="agent")
    finally:
        realnode.stop_process("agent")
        realnode.start_agent()


def test_sigkill_between_the_move_and_the_metadata_write_is_finished_at_restart(realnode, veth):
    """The agent dies (SIGKILL) right after the kernel moved the netdev, before its record says
    so and before the metadata is written. containerd closes the dead plugin and runs the pod.
    The restarted agent's Synchronize finds the record ``moving`` for a running sandbox: it
    finishes the move (configured, ``in-pod``) and writes the metadata (generation 2)."""
    from agent.prepare import rtnl

    realnode.stop_process("agent")
    agent = realnode.start_agent(env={"SYSDRA_TEST_CRASH_AT": "netdev:moved"})
    ns = nic_pod(realnode, "ip -o link show data0", CONFIG)
    wait(lambda: agent.poll() is not None, "the agent killed at netdev:moved", realnode, log="agent")
    assert agent.returncode == -signal.SIGKILL
    assert [m["state"] for m in moves(realnode)] == ["moving"] and not rtnl.has_link(HOST_NET, IFNAME)
    assert host_metadata(realnode, ns)["metadata"]["generation"] == 1
    synced = agent_count(realnode, "NRI: synchronized with")
    realnode.start_agent()
    wait(lambda: agent_count(realnode, "NRI: synchronized with") > synced, "the restarted agent synchronized",
         realnode, log="agent")  # fmt: skip
    wait(lambda: [m["state"] for m in moves(realnode)] == ["in-pod"], "the move finished", realnode, log="agent")
    assert host_metadata(realnode, ns)["metadata"]["generation"] == 2
    running_log(realnode, ns, "app")
    delete_pod(realnode, ns, "app")
    wait(lambda: rtnl.has_link(HOST_NET, IFNAME), f"{IFNAME} back on the host", realnode, log="agent")
    assert [m.get("state", "planned") for m in moves(realnode)] in ([], ["planned"])


def test_containerd_restarted_under_a_running_pod_leaves_nothing_stranded(realnode, veth):
    """containerd restarted: the plugin is synchronized again and keeps the running pod's netdev
    where it is. containerd then forgets the pod's NRI state, so its deletion sends no
    StopPodSandbox: the namespace going is noticed instead, and the record finished (the veth
    died with the namespace; a physical NIC comes back). The next pod gets a fresh veth."""
    from agent.prepare import rtnl

    ns = nic_pod(realnode, "true")
    running_log(realnode, ns, "app")
    assert [m["state"] for m in moves(realnode)] == ["in-pod"]
    before = nri_status(realnode)
    assert before["state"] == "registered" and before["runtime"].startswith("containerd") and before["socket"] == realnode.nri_socket
    synced = agent_count(realnode, "NRI: synchronized with")
    realnode.stop_process("containerd")
    down = wait(lambda: (s := nri_status(realnode))["state"] == "failed" and s, "sysdra status: NRI failed", realnode, log="agent")
    assert realnode.nri_socket in down["reason"]  # the connection lost, then no socket or refused
    realnode._start_containerd({n: peer(n) for n in ("containerd", "ctr", "containerd-shim-runc-v2")}, 120)
    wait(lambda: agent_count(realnode, "NRI: synchronized with") > synced, "the NRI plugin synchronized after containerd's restart",
         realnode, log="agent")  # fmt: skip
    after = wait(lambda: (s := nri_status(realnode))["state"] == "registered" and s, "sysdra status: NRI registered", realnode)
    assert after["connections"] == before["connections"] + 1 and after["claimsWaiting"] == []
    assert [m["state"] for m in moves(realnode)] == ["in-pod"] and not rtnl.has_link(HOST_NET, IFNAME)
    delete_pod(realnode, ns, "app")
    wait(lambda: not moves(realnode) or [m.get("state", "planned") for m in moves(realnode)] == ["planned"],
         "the record of the gone sandbox finished", realnode, log="agent")  # fmt: skip
    assert not rtnl.has_link(HOST_NET, "data0") and not rtnl.has_link(HOST_NET, "net1")


def test_a_damaged_checkpoint_under_a_pod_with_a_netdev_blocks_no_other_pod(realnode, veth):
    """The checkpoint's snapshot damaged (bytes over its middle) while the netdev is in its pod: a
    pod with nothing of ours still starts (the NRI plugin has the driver repair the files, as at a
    start, from the agent's last save), the record of the move is kept, and the netdev comes back
    when its pod goes."""
    from agent.prepare import rtnl

    ns = nic_pod(realnode, "true")
    running_log(realnode, ns, "app")
    path = os.path.join(realnode.kubelet_dir, "plugins", DRIVER, "checkpoint.json")
    corrupt = agent_count(realnode, "CHECKPOINT CORRUPT")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\x00garbage\x00")
    create_pod(realnode, ns, "plain", "true", host_network=False)
    running_log(realnode, ns, "plain")  # every pod start failed until the agent restarted
    assert agent_count(realnode, "CHECKPOINT CORRUPT") > corrupt
    assert [m["state"] for m in moves(realnode)] == ["in-pod"] and not rtnl.has_link(HOST_NET, IFNAME)
    delete_pod(realnode, ns, "app")
    wait(lambda: rtnl.has_link(HOST_NET, IFNAME), f"{IFNAME} back on the host", realnode, log="agent")
    delete_pod(realnode, ns, "plain")
    aside = [n for n in os.listdir(os.path.dirname(path)) if ".corrupt-" in n]
    assert aside
    for name in aside:  # the node's leftover check: nothing of a test stays
        os.unlink(os.path.join(os.path.dirname(path), name))


def _restart_containerd(node: RealNode, request_timeout: str) -> None:
    """containerd again with ``plugin_request_timeout = request_timeout``; the agent synchronized."""
    synced = agent_count(node, "NRI: synchronized with")
    node.stop_process("containerd")
    node.nri_request_timeout = request_timeout
    node._start_containerd({n: peer(n) for n in ("containerd", "ctr", "containerd-shim-runc-v2")}, 120)
    wait(lambda: agent_count(node, "NRI: synchronized with") > synced, "the NRI plugin synchronized", node, log="agent")


REFUSED = "netdev records cannot be used now"  # the agent's refusal of a sandbox while the lock is held


def hold_lock_after_prepare(node: RealNode, until) -> tuple[threading.Thread, threading.Event]:
    """A thread taking the plugin's lock as a prepare of another claim would, right after the next
    claim's prepare (its RunPodSandbox follows), held until ``until()`` or the event is set."""
    from agent.prepare.checkpoint import Checkpoint
    from agent.prepare.metadata.update import Flock

    plugin_dir = os.path.join(node.kubelet_dir, "plugins", DRIVER)
    done = threading.Event()

    def prepared() -> set[str]:
        try:
            return set(Checkpoint.load(os.path.join(plugin_dir, "checkpoint.json"), move_corrupt=False).claims)
        except ValueError:  # read while a save appends: looked at again
            return set()
    before = prepared()

    def hold():
        while not (prepared() - before) and not done.wait(0.01):
            pass  # the pod's claim prepared (saved under the lock the prepare still holds)
        with Flock(os.path.join(plugin_dir, "serialize.lock"), 60):
            while not until() and not done.wait(0.05):
                pass
    thread = threading.Thread(target=hold)
    thread.start()
    return thread, done


def test_a_move_waiting_for_the_lock_answers_within_containerds_request_timeout(realnode, veth):
    """containerd with ``plugin_request_timeout = "1s"``, and the plugin's lock held (a prepare of
    another claim) from the pod's prepare until its sandbox's RunPodSandbox was answered. The agent
    must refuse the sandbox before containerd's deadline: past it, containerd v2.4.2 (NRI 0.12.3)
    drops the plugin and runs the sandbox anyway, and the pod ran without its netdev for good. The
    kubelet's next sandbox of the pod gets it."""
    from agent.prepare import rtnl

    refused = agent_count(realnode, REFUSED)
    _restart_containerd(realnode, "1s")
    holder, done = hold_lock_after_prepare(realnode, lambda: agent_count(realnode, REFUSED) > refused)
    try:
        ns = nic_pod(realnode, "ip -o link show data0", CONFIG)
        lines = running_log(realnode, ns, "app")
        assert any(re.match(r"\d+: data0[@:]", line) for line in lines), lines  # not "Device "data0" does not exist"
        assert agent_count(realnode, REFUSED) > refused
        delete_pod(realnode, ns, "app")
        wait(lambda: rtnl.has_link(HOST_NET, IFNAME), f"{IFNAME} back on the host", realnode, log="agent")
    finally:
        done.set()
        holder.join()
        _restart_containerd(realnode, "2s")


def test_containerd_restarted_while_a_prepare_holds_the_lock_keeps_the_plugin_registered(realnode, veth):
    """containerd restarted while the plugin's lock is held (a prepare that takes seconds: a MIG or
    partition change) and a pod with a netdev waits for its sandbox. The plugin's Synchronize must
    not fail on the lock: containerd closes a plugin whose Synchronize failed, at every attempt
    while the lock is held, and runs the pod's next sandbox without it: the pod without its netdev
    for good. Registered, the sandbox is refused until the lock is free, then gets the netdev."""
    from agent.prepare import rtnl

    refused, later, box = agent_count(realnode, REFUSED), agent_count(realnode, "finished later"), {}

    def running_or_refused_again() -> bool:  # the kubelet's next sandbox of the pod came
        pod = realnode.plane.get("Pod", "app", box["ns"]) if "ns" in box else {}
        return pod.get("status", {}).get("phase") == "Running" or agent_count(realnode, REFUSED) > refused + 1

    holder, done = hold_lock_after_prepare(realnode, running_or_refused_again)
    try:
        box["ns"] = ns = nic_pod(realnode, "ip -o link show data0", CONFIG)
        wait(lambda: agent_count(realnode, REFUSED) > refused, "the pod's sandbox refused", realnode, log="agent")
        _restart_containerd(realnode, "2s")
        assert agent_count(realnode, "finished later") > later  # synchronized while the lock was held
        lines = running_log(realnode, ns, "app")
        assert any(re.match(r"\d+: data0[@:]", line) for line in lines), lines  # not "Device "data0" does not exist"
        delete_pod(realnode, ns, "app")
        wait(lambda: rtnl.has_link(HOST_NET, IFNAME), f"{IFNAME} back on the host", realnode, log="agent")
    finally:
        done.set()
        holder.join()


def test_a_sandbox_run_before_the_agent_is_back_gets_its_netdev_before_its_container(realnode, veth):
    """containerd restarted and ran a pod's sandbox before the agent was back (its NRI plugin
    reconnects with a backoff): the pod ran for good without its NIC. The agent moves it in at its
    Synchronize; containerd's default validator, asked by the pod's annotation to require the
    plugin, refuses the container until then (docs/networking.md)."""
    from agent.prepare import rtnl

    refused, agent = agent_count(realnode, REFUSED), psutil.Process(realnode.procs["agent"].pid)
    holder, done = hold_lock_after_prepare(realnode, lambda: False)
    try:  # the sandbox refused while the lock is held, the agent paused, containerd restarted
        ns = nic_pod(realnode, "ip -o link show data0", CONFIG, {"required-plugins.noderesource.dev/pod": '["sysdra"]'})
        wait(lambda: agent_count(realnode, REFUSED) > refused, "the pod's sandbox refused", realnode, log="agent")
        agent.suspend()
        realnode.stop_process("containerd")
    finally:
        done.set()
        holder.join()
    try:
        realnode._start_containerd({n: peer(n) for n in ("containerd", "ctr", "containerd-shim-runc-v2")}, 120)
        wait(lambda: "required plugin" in json.dumps(realnode.plane.get("Pod", "app", ns)["status"]),
             "the container refused without the plugin", realnode)
    finally:
        agent.resume()
    lines = running_log(realnode, ns, "app")
    assert any(re.match(r"\d+: data0[@:]", line) for line in lines), lines
    delete_pod(realnode, ns, "app")
    wait(lambda: rtnl.has_link(HOST_NET, IFNAME), f"{IFNAME} back on the host", realnode, log="agent")


def test_zz_the_node_leaves_nothing_behind(realnode):
    """Last in the module: stop the node; no process, mount, socket or file of it is left
    outside its directory, and the host's sysctls are as they were."""
    realnode.stop()
    problems = realnode.before.compare(HostState.take(), node_dir=realnode.dir, cgroup_root=realnode.cgroup_root)
    assert not problems, "\n".join(problems)
