"""A rolling update under the real containerd v2.4.2 (its NRI v0.12.3 adaptation) on the real node
(tests/realnode.py): both agent instances register as NRI plugin ``50-sysdra``; containerd keeps
both (no check of names) and calls each with every pod event, and the claimed NIC moves into its
pod once; the old instance stopped, the new one alone gives it back (docs/networking.md, "Rolling
updates"). Root only."""

from __future__ import annotations

import pytest

from agent.prepare import rtnl
from tests.realnode import RealNode
from tests.realnode_pods import delete_pod, running_log, wait
from tests.test_realnode_nic import CONFIG, HOST_NET, IFNAME, moves, nic_pod, realnode, veth  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.root]


def count(node: RealNode, log: str, text: str) -> int:
    return node.log_tail(log, 100000).count(text)


def test_both_instances_are_called_and_the_nic_moves_once(realnode, veth):  # noqa: F811
    realnode.stop_process("agent")
    kept = 'plugin \\"50-sysdra\\" connected and synchronized'  # (logrus quotes the message)
    before = count(realnode, "containerd", kept)
    try:
        realnode.start_agent("--rolling-update-uid", "old", name="agent-old")
        realnode.start_agent("--rolling-update-uid", "new", name="agent-new")
        for name in ("agent-old", "agent-new"):
            wait(lambda: count(realnode, name, "NRI: synchronized"), f"{name} synchronized by containerd", realnode,
                 log=name)
        wait(lambda: count(realnode, "containerd", kept) == before + 2, "containerd keeping both plugins", realnode,
             log="containerd")
        ns = nic_pod(realnode, "ip -o link show data0", CONFIG)
        lines = running_log(realnode, ns, "app")
        assert any(" data0" in line and "mtu 1400" in line for line in lines), lines
        assert [m["state"] for m in moves(realnode)] == ["in-pod"] and not rtnl.has_link(HOST_NET, IFNAME)
        moved = [n for n in ("agent-old", "agent-new") if count(realnode, n, f"netdev {IFNAME} is data0 in pod sandbox")]
        there = [n for n in ("agent-old", "agent-new") if count(realnode, n, f"netdev {IFNAME} is already data0 in pod sandbox")]
        assert len(moved) == 1 and there == [n for n in ("agent-old", "agent-new") if n not in moved], (moved, there)
        realnode.stop_process("agent-old")
        delete_pod(realnode, ns, "app")
        wait(lambda: rtnl.has_link(HOST_NET, IFNAME), f"{IFNAME} back on the host", realnode, log="agent-new")
        assert [m.get("state", "planned") for m in moves(realnode)] in ([], ["planned"])
    finally:
        for name in ("agent-old", "agent-new"):
            realnode.stop_process(name)
        realnode.start_agent()
