"""A pod sandbox stopped while the agent was down, under the real containerd v2.4.2 and kubelet
v1.37.2 (tests/realnode.py): containerd keeps listing a stopped sandbox until it is removed, without
its network namespace (its NRI adaptation filters a stale one out), and the kubelet keeps a pod's
latest sandbox. The agent's Synchronize must not take it for a running one (docs/networking.md;
the kernel's side: tests/test_nri_netdev_stopped.py). Root only."""

from __future__ import annotations

import signal
import subprocess

import pytest

from agent.prepare import rtnl
from tests.controlplane import peer
from tests.realnode_pods import delete_pod, running_log, wait
from tests.test_realnode_nic import HOST_NET, IFNAME, moves, nic_pod, realnode, veth  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.root]


def test_a_sandbox_stopped_while_the_agent_was_down_leaves_the_netdev_to_the_pods_next_one(realnode, veth):  # noqa: F811
    """The agent down (SIGKILL: containerd drops the plugin) when the pod's sandbox dies (its pause
    killed): the kubelet stops it, unannounced (containerd removes its namespace: the veth dies
    there, a NIC comes back to the host), and runs the pod's next sandbox. The restarted agent's
    Synchronize lists the stopped sandbox beside the new one, which gets the netdev. Before, the
    stopped one was taken for running: its record stuck ``moving``, the pod's sandbox without its NIC."""
    ns = nic_pod(realnode, "true")
    running_log(realnode, ns, "app")
    (first,) = moves(realnode)
    realnode.stop_process("agent", signal.SIGKILL)
    try:
        subprocess.run([*realnode.enter, peer("ctr"), "-a", realnode.socket, "-n", "k8s.io", "task", "kill", "-s", "KILL",
                        first["sandbox"]], check=True, capture_output=True, timeout=30)  # fmt: skip
        status = lambda: realnode.plane.get("Pod", "app", ns)["status"]  # noqa: E731
        wait(lambda: status()["containerStatuses"][0]["restartCount"] >= 1 and status()["phase"] == "Running",
             "the pod's next sandbox", realnode)
        subprocess.run(["ip", "link", "add", IFNAME, "type", "veth", "peer", "name", "sdrpeer0"], check=True)  # a NIC back
    finally:
        realnode.start_agent()
    wait(lambda: [(m.get("state"), m.get("sandbox") != first["sandbox"]) for m in moves(realnode)] == [("in-pod", True)],
         "the netdev in the pod's next sandbox", realnode, log="agent")
    assert not rtnl.has_link(HOST_NET, IFNAME)
    delete_pod(realnode, ns, "app")
    wait(lambda: rtnl.has_link(HOST_NET, IFNAME), f"{IFNAME} back on the host", realnode, log="agent")
