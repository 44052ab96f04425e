"""SIGHUP on an agent running in-process: a new ``list_attributes`` rescans (its list attributes are
made by the scan, not when slices are built) and no device leaves the slices meanwhile; ``share``
needs a restart (prepare reads it once); a new ``resync_interval`` starts or speeds up the periodic
rescans at once; a new ``partition_type_attribute`` republishes; prepare's updates of the status
board run on the loop's thread."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

import pytest

from agent.service.daemon import Agent
from tests.conftest import profile_root
from tests.kubelet_standin import settings_for

LISTS = {"ints", "strings", "bools", "versions"}  # value fields of list-typed attributes


async def _until(predicate, what: str, timeout: float = 30.0) -> None:
    """Until ``predicate()`` (or what it returns, awaited) is true."""
    deadline = time.monotonic() + timeout
    while not ((await value) if asyncio.iscoroutine(value := predicate()) else value):
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached: {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def _running(agent: Agent):
    """``agent`` served until the block ends, once its start-up rescans are done (a fixture root's
    file watch is armed after the first publish, then one full rescan follows)."""
    stop = asyncio.Event()
    running = asyncio.create_task(agent.run(stop))
    try:
        await _until(lambda: agent.kubelet_plugin is not None and agent.board.registration["state"] != "not_started"
                     and agent.rescans >= 2 and not agent._scanning.locked(), "the agent's start-up")
        yield
    finally:
        stop.set()
        assert await asyncio.wait_for(running, 60) == 0


async def _published(agent: Agent) -> list[dict]:
    return [d for sl in await agent.store.list_slices() for d in sl["spec"].get("devices", ())]


def _has_lists(device: dict) -> bool:
    return any(set(v) & LISTS for v in (device.get("attributes") or {}).values())


@pytest.mark.parametrize("first", [True, False], ids=["on-off-on", "off-on-off"])
def test_a_reloaded_list_attributes_rescans_and_keeps_every_device(tmp_path, first):
    settings = settings_for(str(tmp_path), root=profile_root("server-2s-gpu-nic"), metrics_address="",
                            resync_interval=0, debounce=0.05, list_attributes=first)
    agent = Agent(settings)
    pools: list[int] = []  # device count of every pool handed to the publisher after the first reload

    async def main():
        async with _running(agent):
            await agent.publisher.wait_synced(lambda p: p.pool is agent.pool)
            names = {d["name"] for d in await _published(agent)}
            assert names and all(_has_lists(d) == first for d in await _published(agent))
            set_pool = agent.publisher.set_pool
            agent.publisher.set_pool = lambda pool, **kw: (pools.append(sum(len(sl["devices"]) for sl in pool.slices)),
                                                           set_pool(pool, **kw))
            for lists in (not first, first):
                agent.reload(agent.settings.replace(list_attributes=lists))
                agent._republish()  # before the rescan lands (as a health round's taints may): same devices

                async def published(lists=lists) -> bool:
                    devices = await _published(agent)
                    return {d["name"] for d in devices} == names and all(_has_lists(d) == lists for d in devices)

                await _until(published, f"every device published with list_attributes={lists}")
        assert pools and all(n == len(names) for n in pools), pools

    asyncio.run(main())


def test_a_reloaded_device_attributes_rescans_and_publishes_them(tmp_path, caplog):
    """docs/attributes.md, "The operator's attributes": a change takes effect at SIGHUP (a full rescan)."""
    settings = settings_for(str(tmp_path), root=profile_root("server-2s-gpu-nic"), metrics_address="",
                            resync_interval=0, debounce=0.05, nvml=False)
    agent = Agent(settings)
    caplog.set_level(logging.INFO, "sysdra.daemon")
    rails = ({"match": ["interface:ibp*"], "attributes": {"rail": 7}},)

    async def main():
        async with _running(agent):
            await agent.publisher.wait_synced(lambda p: p.pool is agent.pool)
            names = {d["name"] for d in await _published(agent)}
            assert "nic-0000-9f-00-0" in names
            assert all("rail" not in (d.get("attributes") or {}) for d in await _published(agent))
            agent.reload(agent.settings.replace(device_attributes=rails))
            assert agent.settings.device_attributes == rails

            async def published() -> bool:
                devices = {d["name"]: d for d in await _published(agent)}
                return set(devices) == names and (devices["nic-0000-9f-00-0"].get("attributes") or {}).get("rail") == {"int": 7}

            await _until(published, "the operator's attribute published after the reload")
        assert "need a restart" not in caplog.text

    asyncio.run(main())


def test_a_reloaded_share_needs_a_restart(tmp_path, caplog):
    settings = settings_for(str(tmp_path), root=profile_root("server-2s-gpu-nic"), metrics_address="")
    agent = Agent(settings)
    caplog.set_level(logging.INFO, "sysdra.daemon")
    agent.reload(settings.replace(share=("gpu",), share_policies={"gpu": {"compute": {"default": 50}}}))
    assert agent.settings.share == () and agent.settings.share_policies == settings.share_policies
    assert "SIGHUP: share, share_policies changed but need a restart" in caplog.text
    assert "SIGHUP: applied" not in caplog.text


@pytest.mark.parametrize("first", [0, 3600])
def test_a_reloaded_resync_interval_applies_at_once(tmp_path, first):
    settings = settings_for(str(tmp_path), root=profile_root("vm-numa-none"), metrics_address="",
                            resync_interval=first, debounce=0.05)
    agent = Agent(settings)
    resyncs: list[str] = []
    rescan = agent.rescan

    def counted(*args, **kw):  # the periodic loop's rescans, not the start-up's or the watch's
        if (task := asyncio.current_task()) is not None and task.get_name() == "resync":
            resyncs.append(task.get_name())
        return rescan(*args, **kw)

    agent.rescan = counted

    async def main():
        async with _running(agent):
            assert not resyncs
            agent.reload(agent.settings.replace(resync_interval=0.05))
            await _until(lambda: len(resyncs) >= 3, "periodic rescans at the reloaded interval")

    asyncio.run(main())


def test_prepare_updates_the_status_board_on_the_loop_thread(tmp_path):
    settings = settings_for(str(tmp_path), root=profile_root("vm-numa-none"), metrics_address="", resync_interval=0)
    agent = Agent(settings)
    threads: list[int] = []
    set_claims = agent.board.set_prepared_claims

    def recorded(claims):
        threads.append(threading.get_ident())
        set_claims(claims)

    agent.board.set_prepared_claims = recorded

    async def main():
        async with _running(agent):
            threads.clear()  # (start-up's own call is on the loop)
            await asyncio.to_thread(agent.kubelet_plugin.driver.unprepare_claims, [])  # as the kubelet's calls run
            await _until(lambda: threads, "the board's update")
            return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert threads == [loop_thread]


def test_a_reloaded_partition_type_attribute_republishes_at_once(tmp_path, caplog):
    """An operator who turns DRAPartitionableDevicesType on, then the setting, sends a SIGHUP: the
    slices name each partition's type then (it said "need a restart": only a restart published it)."""
    settings = settings_for(str(tmp_path), root=profile_root("mi300x-partitions"), metrics_address="",
                            resync_interval=0, debounce=0.05, partitions=True)
    agent = Agent(settings)
    caplog.set_level(logging.INFO, "sysdra.daemon")

    async def declared(want: list) -> bool:
        return want == [sl["spec"].get("partitionTypeAttribute") for sl in await agent.store.list_slices() if sl["spec"].get("devices")]

    async def main():
        async with _running(agent):
            await agent.publisher.wait_synced(lambda p: p.pool is agent.pool)
            assert await declared([None])
            agent.reload(agent.settings.replace(partition_type_attribute=True))
            await _until(lambda: declared([f"{settings.driver_name}/partitionType"]), "the slices naming partitionType")
        assert "need a restart" not in caplog.text

    asyncio.run(main())
