"""``list_attributes`` on a cluster whose API server has DRAListTypeAttributes off (its 1.37 default):
kube-apiserver v1.37.2 refuses every slice carrying a list attribute (422, a field error on the
attribute, tests/test_apiserver_slices.py). The whole agent, in API mode against that real server,
says so once as an error, counts it (``sysdra_list_attributes_refused``) and publishes the node's
devices without list attributes, instead of retrying a pool the server never takes; a SIGHUP tries
them again. The same agent on a server with the gate publishes them (agent/service/listfallback.py)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from lightkube import AsyncClient, KubeConfig

from agent.publish import metrics as publish_metrics
from agent.publish.kubestore import KubeStore
from agent.publish.listattrs import LIST_MEMBERS, refusal
from agent.publish.store import Invalid
from agent.service.daemon import Agent
from agent.settings import Settings
from tests.conftest import profile_root
from tests.controlplane import unique
from tests.test_apiserver_publish import DRIVER, Node, run
from tests.test_apiserver_slices import agent_slices

PROFILE = "server-2s-gpu-nic"  # numaNode is a list (its GPUs sit on both sockets' lists)


def lists(slices: list[dict]) -> set[str]:
    return {k for s in slices for d in s["spec"].get("devices", []) for k, v in d.get("attributes", {}).items()
            if any(m in v for m in LIST_MEMBERS)}  # fmt: skip


def published_devices(list_attributes: bool) -> int:
    return sum(len(s["spec"].get("devices", [])) for s in agent_slices(PROFILE, {"metadata": {"name": "n", "uid": "u"}},
                                                                       list_attributes=list_attributes))


class Agency:
    """The whole agent (no kubelet side) scanning the fixture node, publishing to ``plane`` with
    its node-bound ServiceAccount token."""

    def __init__(self, plane, tmp_path, monkeypatch):
        self.node = Node(plane, tmp_path, token=True)
        monkeypatch.setenv("KUBECONFIG", self.node.kubeconfig)
        self.settings = Settings(root=profile_root(PROFILE), node_name=self.node.name, cluster="kube", debounce=0.05,
                                 resync_interval=0, list_attributes=True, kubelet_dir=str(tmp_path / "kubelet"),
                                 cdi_dir=str(tmp_path / "cdi"), nvml=False)  # fmt: skip

    async def run(self, scenario) -> None:
        async def no_plugin():
            return None

        agent = Agent(self.settings)
        agent.start_kubelet_plugin = no_plugin
        stop = asyncio.Event()
        task = asyncio.get_running_loop().create_task(agent.run(stop))
        try:
            await scenario(agent)
        finally:
            stop.set()
            await task


def test_refused_list_attributes_are_left_out_once_said(older_apiserver, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    publish_metrics.LIST_ATTRIBUTES_REFUSED.set(0)
    a = Agency(older_apiserver, tmp_path, monkeypatch)
    total = published_devices(list_attributes=False)

    async def scenario(agent: Agent) -> None:
        await agent.publisher.wait_synced(lambda p: p.errors >= 1 and not agent.lists.applied(agent.settings).list_attributes
                                          and a.node.devices() == total, timeout=30)  # fmt: skip
        assert publish_metrics.LIST_ATTRIBUTES_REFUSED.values[()] == 1
        errors = agent.publisher.errors
        # SIGHUP, list_attributes still on: tried again, refused again, said again, published without
        agent.reload(agent.settings)
        await agent.publisher.wait_synced(lambda p: p.errors > errors and a.node.devices() == total, timeout=30)
        await asyncio.sleep(0.5)  # (nothing more should come: no retries of a refused pool)
        assert agent.publisher.errors == errors + 1

    run(a.run(scenario))
    slices = a.node.slices()
    assert sum(len(s["spec"]["devices"]) for s in slices) == total and not lists(slices)
    assert publish_metrics.LIST_ATTRIBUTES_REFUSED.values[()] == 1
    # the publisher's and the daemon's lines (the NRI plugin's warning about a missing runtime socket is its own)
    said = [r for r in caplog.records if r.levelno >= logging.WARNING and not r.name.startswith("agent.nri")]
    assert [r.levelname for r in said] == ["ERROR", "ERROR"], [r.getMessage() for r in said]  # no "publishing failed; retrying"
    assert "the API server refused the list-typed attributes resource.kubernetes.io/numaNode" in said[0].getMessage()
    assert "DRAListTypeAttributes" in said[0].getMessage() and "publishing without list attributes" in said[0].getMessage()
    assert any(r.getMessage() == "SIGHUP: trying list-typed attributes again" for r in caplog.records)


def test_a_server_with_the_gate_gets_them(apiserver, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING)
    publish_metrics.LIST_ATTRIBUTES_REFUSED.set(0)
    a = Agency(apiserver, tmp_path, monkeypatch)

    async def scenario(agent: Agent) -> None:
        await agent.publisher.wait_synced(lambda p: p.total.created >= 1, timeout=30)

    run(a.run(scenario))
    assert lists(a.node.slices()) == {"resource.kubernetes.io/numaNode"}
    assert publish_metrics.LIST_ATTRIBUTES_REFUSED.values[()] == 0 and not caplog.records


def test_only_a_field_error_on_a_list_attribute_is_a_refusal(older_apiserver):
    """The server's 422 for the list attribute is recognised; one on a scalar attribute is not
    (the slice is wrong some other way: the publisher retries it as before)."""
    node = older_apiserver.create_node(unique("refusal"))
    listed = agent_slices(PROFILE, node, list_attributes=True)[0]
    bad_scalar = agent_slices(PROFILE, node, list_attributes=False)[0]
    bad_scalar["spec"]["devices"][0]["attributes"]["model"] = {"string": "x" * 65}  # over the API's 64 characters

    async def errors():
        client = AsyncClient(config=KubeConfig.from_file(older_apiserver.kubeconfig), field_manager=DRIVER)
        store = KubeStore(client, node_name=node["metadata"]["name"], driver_name=DRIVER)
        got = []
        try:
            for obj in (listed, bad_scalar):
                with pytest.raises(Invalid) as err:
                    await store.create(obj)
                got.append(err.value)
        finally:
            await client.close()
        return got

    on_list, on_scalar = run(errors())
    assert refusal(listed, on_list).names == ("resource.kubernetes.io/numaNode",)
    assert on_scalar.fields and refusal(bad_scalar, on_scalar) is None
