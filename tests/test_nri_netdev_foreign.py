"""A netdev claim whose checkpoint entry a newer sysdra wrote (agent/prepare/checkpoint_entries.py):
this agent's NRI plugin never moves its netdevs nor saves its records (a save would drop the fields it
does not know), refuses a pod it would have to move them for, and the kubelet's unprepare gives them
back to the host from what it knows of the entry. Real namespaces and a veth NIC, the runtime's NRI
stand-in (tests/nri_standin.py), as in tests/test_nri_netdev_damaged.py. Root only.
"""

from __future__ import annotations

import logging

import pytest

from agent.nri.ttrpc import CallError
from agent.prepare.checkpoint import Checkpoint
from tests.test_checkpoint_compat import newer_writes
from tests.test_nri_netdev import CLAIM, ifname_nets, nets, where  # noqa: F401 - fixtures
from tests.test_nri_netdev_damaged import Agent, app, claim_ref, in_pod, other


def test_a_newer_agents_netdev_records_are_neither_moved_nor_saved(tmp_path, ifname_nets, caplog):
    nets = ifname_nets
    first = in_pod(tmp_path, nets)  # prepared, its netdev in the app's sandbox
    path = first.driver.checkpoint_path
    raw = newer_writes(path, CLAIM)  # then the newer agent recorded its new feature in the entry
    agent = Agent(tmp_path, nets)  # this agent again (a rollback): kept, not adopted
    assert agent.driver.recovery.foreign == [CLAIM] and not agent.driver.recovery.netdevs_lost

    async def events(call):
        await call("RunPodSandbox", app(nets))  # the sandbox it is in: nothing to do
        with pytest.raises(CallError, match=f"claim {CLAIM} of pod ns/app was prepared by a newer sysdra .*futureThing"):
            await call("RunPodSandbox", app(nets, "id-app-2"))
        await call("RunPodSandbox", other())  # nothing of ours
        await call("StopPodSandbox", app(nets))  # not this agent's to move back: said
    with caplog.at_level(logging.ERROR):
        agent.serve([app(nets)], events)
    assert where(nets) == (False, True)
    assert Checkpoint.load(path, move_corrupt=False).foreign[CLAIM].raw == raw
    assert f"claim {CLAIM} was prepared by a newer sysdra: its netdevs are that one's to move back" in caplog.text
    assert agent.driver.unprepare_claims([claim_ref()]) == {CLAIM: None}  # what it knows of the entry: undone
    assert where(nets) == (True, False)
    assert f"CHECKPOINT ENTRY OF A NEWER SYSDRA REMOVED: claim {CLAIM}" in caplog.text
