"""With the API (``cluster: kube``) the agent publishes its first slices only once the kubelet has
registered it: the scheduler allocates from a slice the moment it exists, and the kubelet fails
the prepare of a driver it has not registered yet ("DRA driver sysdra.io is not registered", a
warning event on the pod; the real node's helm test saw it). A kubelet that never answers delays
the first publish by REGISTRATION_WAIT only, with a warning. The real API server; the kubelet is
the stand-in (tests/test_helm_realnode.py runs this with the real one)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from agent.service import startup
from agent.service.daemon import Agent
from agent.settings import Settings
from tests.conftest import profile_root
from tests.kubelet_standin import KubeletStandIn, find_registration_sockets
from tests.test_apiserver_publish import Node, run


def _agent(apiserver, tmp_path, monkeypatch) -> tuple[Node, Settings]:
    node = Node(apiserver, tmp_path, token=True)
    monkeypatch.setenv("KUBECONFIG", node.kubeconfig)
    settings = Settings(root=profile_root("server-2s-gpu-nic"), node_name=node.name, cluster="kube", resync_interval=0,
                        kubelet_dir=str(tmp_path / "kubelet"), cdi_dir=str(tmp_path / "cdi"), nvml=False,
                        metrics_address="", claim_status=False, nri_socket="")  # fmt: skip
    return node, settings


async def _until(predicate, what: str, timeout: float = 30.0):
    try:
        async with asyncio.timeout(timeout):
            while not (got := await asyncio.to_thread(predicate)):
                await asyncio.sleep(0.05)
    except TimeoutError:
        pytest.fail(f"not reached: {what}")
    return got


def test_the_first_slices_wait_for_the_kubelets_registration(apiserver, tmp_path, monkeypatch):
    node, settings = _agent(apiserver, tmp_path, monkeypatch)

    async def scenario():
        stop = asyncio.Event()
        task = asyncio.create_task(Agent(settings).run(stop))
        try:
            await _until(lambda: find_registration_sockets(settings.registry_dir), "the registration socket")
            await asyncio.sleep(1.5)  # a kubelet's plugin watcher looks about once a second; this one is late
            assert await asyncio.to_thread(node.slices) == []
            await KubeletStandIn(settings.registry_dir).register()
            await _until(node.slices, "the slices after the registration")
        finally:
            stop.set()
            await task

    run(scenario())


def test_a_kubelet_that_never_registers_delays_the_first_slices_only_so_long(apiserver, tmp_path, monkeypatch, caplog):
    node, settings = _agent(apiserver, tmp_path, monkeypatch)
    monkeypatch.setattr(startup, "REGISTRATION_WAIT", 1.0)
    caplog.set_level(logging.WARNING)

    async def scenario():
        stop = asyncio.Event()
        task = asyncio.create_task(Agent(settings).run(stop))
        try:
            await _until(node.slices, "the slices without a registration")
            assert find_registration_sockets(settings.registry_dir)
        finally:
            stop.set()
            await task

    run(scenario())
    assert any("has not registered the plugin within 1 s: publishing anyway" in r.getMessage() for r in caplog.records)
