"""GPU faults kept across restarts (agent/health/faults.py), at their edges: a file damaged past
what a parser takes, a time out of range, a clear that races a new fault, another GPU put in a
faulty GPU's slot while the agent runs."""

from __future__ import annotations

import asyncio
import json
import logging
import os

from agent.health.checks import HEALTHY
from agent.health.faults import FILE, FaultStore
from discovery.inventory import scan
from tests.simnvml import SimNvmlEvents
from tests.test_gpu_faults import (BDF, GPU, UUID, _check_once, _faulted_and_restarted, _restarted, cli_flags, node,  # noqa: F401 - node: a fixture
                                   until, watching_xid_79)


def test_a_file_nested_too_deep_is_damage_not_a_crash(node, caplog):
    """JSON nested past Python's recursion limit (well inside the 1 MiB bound) is a damaged file:
    json.loads raises RecursionError, which is no ValueError; it must not end the agent's first
    round (nor `first_round`, before the slices are published)."""
    from agent.health.monitor import first_round

    with open(os.path.join(node.plugin_dir, FILE), "wb") as f:
        f.write(b'{"version": 1, "faults": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    caplog.set_level(logging.WARNING, logger="agent.health.faults")
    assert FaultStore(node.plugin_dir, node.root).load() == {}
    assert "is damaged" in caplog.text and "treated as empty" in caplog.text
    assert asyncio.run(_check_once(node)) == HEALTHY
    assert first_round(node, scan(node.root))[0] == {}


def test_a_since_out_of_range_is_a_bad_entry(node, caplog):
    """`since` is read back as a time: Infinity (JSON's 1e999) is written back as null, so the
    fault is lost at the next read, and a time past time_t ends `sysdra health list`."""
    from agent.cli.main import main as cli

    boot = "1b0c7d8e-0000-4000-8000-000000000001"
    good = {"uuid": UUID, "bdf": BDF, "reason": "xid-79", "message": "m", "since": 1.0, "bootId": boot}
    with open(os.path.join(node.plugin_dir, FILE), "w") as f:
        f.write(json.dumps({"version": 1, "faults": [dict(good, uuid="GPU-aaaa", since=1e300),
                                                     dict(good, uuid="GPU-bbbb", since=float("inf")), good]}))
    caplog.set_level(logging.WARNING, logger="agent.health.faults")
    assert list(FaultStore(node.plugin_dir, node.root).load()) == [(UUID, None)]
    flags = cli_flags(node)
    assert cli(["health", "list", *flags]) == 0


def test_the_same_fault_again_after_a_clear_is_kept(node):
    """The operator clears a GPU's fault (`sysdra health clear`, another process) and the GPU
    raises the same XID again before the agent's next round has read the file: that is a new fault,
    to be kept and shown, not taken for a repeat of the one cleared."""
    from agent.cli.main import main as cli

    flags = cli_flags(node)
    inv, sim = scan(node.root), SimNvmlEvents()

    async def main():
        monitor = await watching_xid_79(node, inv, sim)
        try:
            assert cli(["health", "clear", *flags, GPU]) == 0
            checks = monitor.link_checks
            sim.emit(BDF, sim.nvmlEventTypeXidCriticalError, 79)  # the GPU fell off the bus again
            await until(lambda: monitor.link_checks > checks)
            await asyncio.sleep(0.2)  # its record done (or skipped)
            await monitor.check_now()
            assert monitor.states[GPU].verdict.reason == "xid-79"
            assert (UUID, None) in FaultStore(node.plugin_dir, node.root).load()
        finally:
            await monitor.stop()

    asyncio.run(main())


def test_a_fault_raised_while_a_round_applies_a_clear_is_kept_and_shown(node):
    """The same, the other way round: the round that reads the cleared file runs between the
    event (its GPU marked at once, on the loop) and the fault's write. The fault is written; the
    GPU must not be left healthy until some later change of the file or the inventory."""
    from agent.cli.main import main as cli

    flags = cli_flags(node)

    async def main():
        monitor = await _faulted_and_restarted(node)
        try:
            monitor.xid = None  # (no NVML here: the UUID is discovery's)
            assert cli(["health", "clear", *flags, GPU]) == 0
            monitor._gpu_fault(BDF, "xid-48", "NVML: critical XID 48")  # what the event thread schedules
            await monitor.check_now()  # a round that got the lock first: it reads the cleared file
            await until(lambda: (UUID, None) in FaultStore(node.plugin_dir, node.root).load())
            await until(lambda: not monitor._link_checks)
            await monitor.check_now()
            await monitor.check_now()
            assert monitor.states[GPU].verdict.reason == "xid-48"
        finally:
            await monitor.stop()

    asyncio.run(main())


def test_another_gpu_hotplugged_into_the_slot_does_not_get_the_fault(node):
    """The faulty GPU is unplugged and another one (another UUID) plugged into its slot while the
    agent runs (a VM's GPU detached and another attached at the same address): "another GPU put in
    its slot does not get it" holds for the running agent too, not only after a restart; and
    `sysdra health clear` of the old GPU leaves nothing behind either way."""
    from agent.cli.main import main as cli

    flags = cli_flags(node)
    inv, sim = scan(node.root), SimNvmlEvents()
    gpu = inv.by_name()[GPU]
    without = inv.replace(devices=tuple(d for d in inv.devices if d.name != GPU))
    other = inv.replace(devices=tuple(d.replace(gpu=gpu.gpu.replace(nvidia_uuid="GPU-00000000-1111-2222-3333-444444444444"))
                                      if d.name == GPU else d for d in inv.devices))

    async def main():
        monitor = await watching_xid_79(node, inv, sim)
        try:
            await until(lambda: not monitor._link_checks)
            monitor.on_inventory(without)  # unplugged
            await monitor.check_now()
            monitor.on_inventory(other)  # another GPU in the slot
            await monitor.check_now()
            assert monitor.states[GPU].verdict.health == HEALTHY, monitor.states[GPU].verdict
            assert cli(["health", "clear", *flags, UUID]) == 0  # the old GPU's fault: gone from the file
            await monitor.check_now()
            assert monitor.states[GPU].verdict.health == HEALTHY, monitor.states[GPU].verdict
        finally:
            await monitor.stop()
        again = await _restarted(node)  # (what a restart finds: the same)
        try:
            assert again.states[GPU].verdict.health == HEALTHY
        finally:
            await again.stop()

    asyncio.run(main())
