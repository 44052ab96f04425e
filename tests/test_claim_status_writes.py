"""The claim-status writer against the real kube-apiserver v1.37.2, in the cluster of
tests/claim_status_cluster.py: server errors and connection resets retried until written, as are
answers that stall, trickle or are cut short (each attempt ended at its deadline), writes
that fail for good counted and shown by ``sysdra status``, a queued write that keeps what a
``sysdra metadata update`` wrote meanwhile, an apply over a claim changed since it was read
retried with a fresh read (409), and what a pod's cycle costs in requests."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from lightkube import AsyncClient, KubeConfig

from agent.kubeletplugin.claims import KubeClaimSource
from agent.kubeletplugin.statusbackends import KubeStatus
from agent.kubeletplugin.statuswriter import StatusWriter
from tests.claim_status_cluster import DRIVER, MAC, OTHER, _entry, cluster, ours, ref, run  # noqa: F401 - cluster: the fixture
from tests.conftest import REPO
from tests.controlplane import resource_path
from tests.kubelet_standin import registered_plugin, settings_for


def test_server_errors_and_resets_are_retried_until_written(cluster, tmp_path):
    from agent.kubeletplugin import statuswriter
    from tests.faultproxy import FaultProxy

    c = cluster.allocated_claim(cluster.name, other=False)
    mine = [_entry(r) for r in c["status"]["allocation"]["devices"]["results"]]
    proxy = FaultProxy(cluster.plane).start()
    try:
        proxy.fail_next(2, 503, method="PATCH")
        proxy.reset_next(1)
        config = proxy.write_kubeconfig(str(tmp_path / "proxy.kubeconfig"), token=cluster.pod_token)

        async def go():
            client = AsyncClient(config=KubeConfig.from_file(config), field_manager=DRIVER)
            writer = StatusWriter(KubeStatus(DRIVER, client))
            try:
                writer.submit(ref(c), mine)
                await writer.idle(60)
                return writer
            finally:
                await client.close()

        statuswriter.FIRST_DELAY = 0.05  # the backoff's shape is not under test here
        writer = run(go())
    finally:
        statuswriter.FIRST_DELAY = 0.5
        proxy.stop()
    assert (writer.written, writer.failed) == (1, 0), writer.last_error
    assert [e["device"] for e in ours(cluster.claim(c))] == [e["device"] for e in mine]


def test_writes_that_fail_for_good_are_counted_and_shown_by_sysdra_status(cluster, tmp_path, monkeypatch):
    """The daemon's writer and observer: real metrics and status board. One claim's writes all get
    a 503 (retries exhausted), one is refused by the server (another node's claim), one is written."""
    from agent.cli.status import render_text
    from agent.kubeletplugin import statuswriter
    from agent.service.metrics import Metrics
    from agent.service.observers import ClaimStatusObserver
    from agent.service.status import StatusBoard
    from tests.faultproxy import FaultProxy

    monkeypatch.setattr(statuswriter, "ATTEMPTS", 3)
    monkeypatch.setattr(statuswriter, "FIRST_DELAY", 0.05)  # the backoff's shape is not under test here
    down, fine = (cluster.allocated_claim(cluster.name, other=False) for _ in range(2))
    far = cluster.allocated_claim(cluster.far["metadata"]["name"], other=False)
    metrics, board = Metrics(process=False, bridge_global=False), StatusBoard(cluster.name, DRIVER)
    proxy = FaultProxy(cluster.plane).start()
    try:
        proxy.fail_next(100, 503, method="PATCH", path="/resourceclaims/" + down["metadata"]["name"] + "/")
        config = proxy.write_kubeconfig(str(tmp_path / "proxy.kubeconfig"), token=cluster.pod_token)

        async def go():
            client = AsyncClient(config=KubeConfig.from_file(config), field_manager=DRIVER)
            writer = statuswriter.status_writer(cluster.settings, client, observer=ClaimStatusObserver(metrics, board))
            try:
                for c in (down, far, fine):
                    writer.submit(ref(c), [_entry(r) for r in c["status"]["allocation"]["devices"]["results"]])
                await writer.idle(60)
            finally:
                await client.close()

        run(go())
    finally:
        proxy.stop()
    assert proxy.injected == 3  # every attempt of the one claim, none of the others
    count = lambda result: metrics.registry.get_sample_value("sysdra_claim_status_writes_total", {"result": result})  # noqa: E731
    assert {r: count(r) for r in statuswriter.RESULTS} == {"written": 1, "unchanged": 0, "refused": 1, "invalid": 0, "failed": 1}
    assert ours(cluster.claim(down)) == [] and ours(cluster.claim(far)) == [] and len(ours(cluster.claim(fine))) == 2
    doc = board.snapshot()
    assert doc["claimStatus"]["failed"] == 2
    failures = {f["name"]: f for f in doc["claimStatus"]["recentFailures"]}
    assert failures.keys() == {down["metadata"]["name"], far["metadata"]["name"]}
    assert failures[down["metadata"]["name"]]["result"] == "failed" and "after 3 attempts" in failures[down["metadata"]["name"]]["reason"]
    assert failures[far["metadata"]["name"]]["result"] == "refused" and "422" in failures[far["metadata"]["name"]]["reason"]
    text = render_text(json.loads(json.dumps(doc)))  # as `sysdra status` gets it over the socket
    assert "claim status: 1 written, 0 unchanged, 2 failed (retries exhausted 1, refused 1)\n" in text, text
    lines = {ln.split()[0]: ln for ln in text.splitlines() if ln.startswith("  ")}
    down_line, far_line = lines[f"{cluster.ns}/{down['metadata']['name']}"], lines[f"{cluster.ns}/{far['metadata']['name']}"]
    assert " failed " in down_line and "(after 3 attempts)" in down_line, down_line
    assert " refused " in far_line and "API error 422" in far_line, far_line
    assert board.summary().endswith("; 2 claim status writes failed")


def test_a_queued_write_keeps_what_a_metadata_update_wrote_meanwhile(cluster):
    """The prepare's write is still queued when the runtime hook's `sysdra metadata update` applies
    the claim's IPs: the queued write must not put the entries of before the update back."""
    import subprocess
    import sys

    from tests.test_claim_status_offline import HeldBackend

    c = cluster.allocated_claim(cluster.name)
    m = c["metadata"]
    s = cluster.settings
    cmd = [sys.executable, "-m", "agent", "metadata", "update", "--config", os.devnull, "--kubelet-dir", s.kubelet_dir,
           "--cluster", "kube", "--namespace", m["namespace"], "--claim", m["name"], "--uid", m["uid"], "--request", "nic",
           "--ip", "2001:db8::7/64"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYSDRA_")} | {"KUBECONFIG": cluster.kubeconfig}

    async def scenario():
        client = cluster.agent_client()
        writer = StatusWriter(KubeStatus(DRIVER, client))
        try:
            async with registered_plugin(s, cluster.inv, KubeClaimSource(client), writer) as kubelet:
                writer.backend = held = HeldBackend(writer.backend)
                assert (await kubelet.prepare(c)).claims[m["uid"]].error == ""
                out = await asyncio.to_thread(subprocess.run, cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
                assert out.returncode == 0 and "status.devices updated (2 entries)" in out.stdout, out.stderr
                updated = await asyncio.to_thread(cluster.claim, c)
                held.gate.set()  # now the prepare's write, queued before the update
                await writer.idle(30)
                assert writer.failed == 0, writer.last_error
                return updated, writer.written
        finally:
            await client.close()

    updated, written = run(scenario())
    nic_of = lambda claim: [e for e in ours(claim) if e["device"].startswith("nic-")]  # noqa: E731
    assert [e["networkData"] for e in nic_of(updated)] == [{"interfaceName": "ens9f0", "hardwareAddress": MAC,
                                                             "ips": ["2001:db8::7/64"]}]  # fmt: skip
    now = cluster.claim(c)
    assert nic_of(now) == nic_of(updated) and now["metadata"]["resourceVersion"] == updated["metadata"]["resourceVersion"]
    assert written == 1  # found already so: nothing written
    assert [e["driver"] for e in now["status"]["devices"]].count(DRIVER) == 2


def test_a_write_over_a_claim_changed_since_it_was_read_is_retried_with_a_fresh_read(cluster):
    """The apply carries the resourceVersion read: the server refuses it (409) when the claim
    changed in between, and the write is decided again on what the claim is now."""
    c = cluster.allocated_claim(cluster.name)
    results = c["status"]["allocation"]["devices"]["results"]
    mine = [_entry(r) for r in results if r["driver"] == DRIVER]
    theirs = [_entry(r) for r in results if r["driver"] == OTHER]
    asked = []

    def latest():  # between our read and our write, the other driver writes its entry
        asked.append(cluster.claim(c)["metadata"]["resourceVersion"])
        if len(asked) == 1:
            cluster.apply_status_as(OTHER, c, theirs)
        return mine

    async def go():
        client = cluster.agent_client()
        try:
            return await asyncio.to_thread(KubeStatus(DRIVER, client).write, ref(c), [], latest)
        finally:
            await client.close()

    assert run(go()) is True
    assert len(asked) == 2 and asked[0] != asked[1]
    now = [{k: v for k, v in e.items() if v is not None} for e in cluster.claim(c)["status"]["devices"]]  # (conditions: null)
    assert [e for e in now if e["driver"] == DRIVER] == mine and [e for e in now if e["driver"] == OTHER] == theirs


def test_a_pod_cycle_costs_one_get_and_one_apply(cluster, tmp_path):
    """Counted at a proxy in front of the real server: the prepare's GET of the claim, one apply
    of our entries that reuses that read, and nothing at unprepare (issue 43)."""
    from agent.kubeletplugin.claimapi import ClaimApi
    from tests.faultproxy import FaultProxy

    c = cluster.allocated_claim(cluster.name, other=False)
    m = c["metadata"]
    # a kubelet dir of its own: the module's other claims may hold the same GPU there
    settings = settings_for(str(tmp_path), root=cluster.settings.root, node_name=cluster.name, cluster="kube")
    proxy = FaultProxy(cluster.plane).start()
    try:
        config = proxy.write_kubeconfig(str(tmp_path / "proxy.kubeconfig"), token=cluster.pod_token)

        async def scenario():
            api = ClaimApi(AsyncClient(config=KubeConfig.from_file(config)), field_manager=DRIVER)
            writer = StatusWriter(KubeStatus(DRIVER, api))
            try:
                async with registered_plugin(settings, cluster.inv, KubeClaimSource(api), writer) as kubelet:
                    assert (await kubelet.prepare(c)).claims[m["uid"]].error == ""
                    await writer.idle(30)
                    assert (await kubelet.unprepare(c)).claims[m["uid"]].error == ""
                    await writer.idle(30)
                    assert (writer.written, writer.failed) == (1, 0), writer.last_error
            finally:
                api.close()

        run(scenario())
    finally:
        proxy.stop()
    path = resource_path("ResourceClaim", m["namespace"], m["name"])
    assert [(method, target.split("?")[0]) for method, target in proxy.requests] == [("GET", path), ("PATCH", path + "/status")]
    assert [e["device"] for e in ours(cluster.claim(c))] == [r["device"] for r in c["status"]["allocation"]["devices"]["results"]]


STOPS = {"stalled after the head": lambda p: p.stall_next(1, method="PATCH"),
         "stalled mid-body": lambda p: p.stall_next(1, after=50, method="PATCH"),
         "trickled": lambda p: p.trickle(0.05),
         "cut mid-body": lambda p: p.cut_next(1, after=50, method="PATCH")}


@pytest.mark.parametrize("stop", STOPS.values(), ids=STOPS.keys())
def test_a_write_whose_answer_stops_short_ends_at_its_deadline_and_is_retried(cluster, tmp_path, monkeypatch, stop):
    """The claim requests' deadline is the whole exchange's (libcurl's): a server that stalls or
    trickles its answer costs one attempt of one writer thread, then the write is retried."""
    from agent.kubeletplugin import claimapi, statuswriter
    from tests.faultproxy import FaultProxy

    monkeypatch.setattr(claimapi, "TIMEOUT", 1.0)
    monkeypatch.setattr(statuswriter, "FIRST_DELAY", 0.05)
    c = cluster.allocated_claim(cluster.name, other=False)
    mine = [_entry(r) for r in c["status"]["allocation"]["devices"]["results"]]
    proxy = FaultProxy(cluster.plane).start()
    config = proxy.write_kubeconfig(str(tmp_path / "proxy.kubeconfig"), token=cluster.pod_token)

    async def go():
        client = AsyncClient(config=KubeConfig.from_file(config), field_manager=DRIVER)
        writer = StatusWriter(KubeStatus(DRIVER, client))
        try:
            stop(proxy)
            writer.submit(ref(c), mine)
            # the first attempt ended at its deadline (its retry may be done already)
            while not (writer.written or any(p.attempt for p in list(writer._pending.values()))):
                await asyncio.sleep(0.05)
            proxy.trickle(0)
            await writer.idle(60)
            return writer
        finally:
            await client.close()

    try:
        writer = run(go())
    finally:
        proxy.stop()
    assert (writer.written, writer.failed) == (1, 0), writer.last_error
    assert [e["device"] for e in ours(cluster.claim(c))] == [e["device"] for e in mine]
    assert proxy.injected == (0 if stop is STOPS["trickled"] else 1)
