"""The agent's long-running loops outlive a failed round: a periodic rescan or a health round
whose handling raises is logged, the next round runs, and the agent still stops in order (the
kubelet side's sockets removed). A dead loop would end the resync or the taints following
health for good, and its exception would skip the kubelet plugin's stop at shutdown."""

from __future__ import annotations

import asyncio
import glob
import os
import time

from agent.service.daemon import Agent
from tests.conftest import profile_root
from tests.kubelet_standin import settings_for


async def _until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached: {what}")
        await asyncio.sleep(0.02)


def _fail_once_in(agent: Agent, method: str, task_name: str, calls: list[str]) -> None:
    """``agent.<method>`` raises on its first call from the task named ``task_name``; every
    call from that task is recorded in ``calls``."""
    original = getattr(agent, method)

    def call(*args, **kw):
        task = asyncio.current_task()
        if task is not None and task.get_name() == task_name:
            calls.append(task_name)
            if len(calls) == 1:
                raise RuntimeError(f"injected: {method} in {task_name}")
        return original(*args, **kw)

    setattr(agent, method, call)


def test_a_failed_round_does_not_end_its_loop_nor_skip_shutdown(tmp_path, caplog):
    settings = settings_for(str(tmp_path), root=profile_root("vm-numa-none"), metrics_address="",
                            resync_interval=0.1, health_interval=0.1)
    agent = Agent(settings)
    resyncs: list[str] = []
    health_rounds: list[str] = []
    _fail_once_in(agent, "rescan", "resync", resyncs)  # (a coroutine function: raises when called)
    _fail_once_in(agent, "health_states", "health-follow", health_rounds)

    async def main():
        stop = asyncio.Event()
        running = asyncio.create_task(agent.run(stop))
        try:
            await _until(lambda: len(resyncs) >= 2, "a periodic rescan after the failed one")
            await _until(lambda: len(health_rounds) >= 2, "a health round after the failed one")
            assert glob.glob(os.path.join(settings.registry_dir, "*.sock"))
        finally:  # stopped in order even when a wait above failed (a cancelled gRPC server may crash)
            stop.set()
            rc = await asyncio.wait_for(running, 60)
        return rc

    assert asyncio.run(main()) == 0
    assert not glob.glob(os.path.join(settings.registry_dir, "*.sock")) and not os.path.exists(
        os.path.join(settings.plugin_dir, "dra.sock"))
    failures = [r.getMessage() for r in caplog.records if r.exc_info]
    assert any("periodic rescan failed" in m for m in failures), failures
    assert any("health verdicts not applied" in m for m in failures), failures
