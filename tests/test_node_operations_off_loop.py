"""Recording the applied ``skip_node_operations`` (agent/service/nodeops.py: a durable write, fsync of
the file and its directory, and at start a read of the whole checkpoint) never runs on the event
loop: while it is held up (a disk busy with image pulls can keep an fsync for seconds), the status
socket still answers, at start as on SIGHUP.

Measured by events, not durations: the save is held on a ``threading.Event`` until the test has
been answered on the status socket; a save on the loop keeps the loop (and so the test) waiting
until the hold gives up, and the test sees the save already finished."""

from __future__ import annotations

import asyncio
import threading

from agent.service import nodeops, reload as reloading
from agent.service.daemon import Agent
from agent.service.status import status_socket_path
from tests.conftest import profile_root
from tests.kubelet_standin import settings_for
from tests.test_host_nics import until
from tests.test_prepare_off_loop import _status

HOLD = 5.0  # seconds a held save waits for the test before it goes on by itself (only a save on the loop)


class HeldSave:
    """``nodeops.save_applied`` held until ``release`` (once ``armed``); ``finished``: it went on."""

    def __init__(self, monkeypatch, armed: bool = True):
        self.armed = armed
        self.entered, self.release, self.finished = threading.Event(), threading.Event(), threading.Event()
        self.threads: list[int] = []  # of every armed save
        real = nodeops.save_applied

        def save(plugin_dir: str, value: dict) -> None:
            if self.armed:
                self.threads.append(threading.get_ident())
                self.entered.set()
                self.release.wait(HOLD)
                self.finished.set()
            real(plugin_dir, value)

        monkeypatch.setattr(nodeops, "save_applied", save)


async def _answered_while_held(held: HeldSave, agent: Agent) -> dict:
    """The status socket's answer, asked once the save is held; the save must still be held then."""
    await until(held.entered.is_set)  # the save of the applied rule
    try:
        status = await _status(status_socket_path(agent.settings))
        assert not held.finished.is_set(), "the status socket answered only after the save: it ran on the event loop"
        return status
    finally:
        held.release.set()


def test_the_first_record_of_the_rule_at_start_leaves_the_loop_free(tmp_path, monkeypatch):
    """The first start records the rule (no file yet): meanwhile the status socket answers."""
    settings = settings_for(str(tmp_path), root=profile_root("vm-numa-none"), metrics_address="", resync_interval=0)
    held = HeldSave(monkeypatch)
    agent = Agent(settings)

    async def main():
        stop = asyncio.Event()
        running = asyncio.create_task(agent.run(stop))
        try:
            status = await _answered_while_held(held, agent)
            assert status["nodeName"] == settings.node_name
            await until(lambda: agent.rescans >= 1)  # the first scan after the rule is settled
            assert threading.get_ident() not in held.threads  # (a second save, once released, on the loop)
        finally:
            stop.set()
            assert await asyncio.wait_for(running, 60) == 0

    asyncio.run(main())
    assert nodeops.load_applied(settings.plugin_dir) == {}


def test_a_sighup_that_changes_the_rule_records_it_off_the_loop(tmp_path, monkeypatch):
    """SIGHUP with a new ``skip_node_operations``: recorded (fsync) in a worker thread, then applied."""
    settings = settings_for(str(tmp_path), root=profile_root("vm-numa-none"), metrics_address="", resync_interval=0)
    held = HeldSave(monkeypatch, armed=False)  # (start-up's own record goes through)
    agent = Agent(settings)
    rule = {"nic": ["*"]}

    async def main():
        stop = asyncio.Event()
        running = asyncio.create_task(agent.run(stop))
        try:
            await until(lambda: agent.kubelet_plugin is not None and agent.kubelet_plugin.started  # started up
                        and agent.board.registration["state"] != "not_started")
            held.armed = True
            reloading.sighup_handler(agent, lambda: agent.settings.replace(skip_node_operations=rule))()
            await _answered_while_held(held, agent)
            await until(lambda: agent.settings.skip_node_operations == rule)  # the new rule applied
            assert held.threads and threading.get_ident() not in held.threads  # (a second save, once released, on the loop)
        finally:
            stop.set()
            assert await asyncio.wait_for(running, 60) == 0

    asyncio.run(main())
    assert nodeops.load_applied(settings.plugin_dir) == rule
