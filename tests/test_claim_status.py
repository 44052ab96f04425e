"""status.devices (KEP-4817) and its fine-grained authorization on the real kube-apiserver v1.37.2,
in the cluster of tests/claim_status_cluster.py: what the agent writes, what the server refuses
(another node's claim, another driver's entries, a token not bound to the node, a replaced claim),
and our checks against the server's at every limit. Another driver shares the claim and writes
its own entry with its own field manager; the agent's server-side apply must leave it untouched.
The writer's retries, conflicts and request count are tests/test_claim_status_writes.py's."""

from __future__ import annotations

import asyncio
import os

import pytest
from lightkube import AsyncClient, KubeConfig

from agent.kubeletplugin.claims import KubeClaimSource
from agent.kubeletplugin.statusbackends import KubeStatus, StatusRefused
from agent.kubeletplugin.statuswriter import StatusWriter
from agent.kubeletplugin.types import ClaimRef
from tests.claim_status_cluster import DRIVER, MAC, OTHER, _entry, cluster, ours, ref, run  # noqa: F401 - cluster: the fixture
from tests.controlplane import resource_path, unique
from tests.kubelet_standin import registered_plugin


def test_the_daemonset_token_carries_its_node(cluster):
    review = cluster.plane.request("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                                   client=cluster.plane.http(token=cluster.pod_token),
                                   body={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}).json()  # fmt: skip
    user = review["status"]["userInfo"]
    assert user["username"] == "system:serviceaccount:sysdra:sysdra"
    assert user["extra"]["authentication.kubernetes.io/node-name"] == [cluster.name]


def test_prepare_writes_our_entries_deallocation_removes_them_other_drivers_untouched(cluster):
    """Prepare: one apply of our entries (from the claim the prepare read). Unprepare: no request
    at all; when the claim is deallocated (kube-controller-manager clears the allocation once no
    pod uses it), the server drops the entries of the devices no longer allocated."""
    c = cluster.allocated_claim(cluster.name)
    results = c["status"]["allocation"]["devices"]["results"]
    other = [r for r in results if r["driver"] == OTHER]
    assert len(other) == 1 and len(results) == 3
    theirs = [{"driver": OTHER, "pool": other[0]["pool"], "device": other[0]["device"], "data": {"owner": "them"},
               "conditions": [{"type": "Ready", "status": "False", "reason": "Starting", "message": "",
                               "lastTransitionTime": "2026-01-01T00:00:00Z"}]}]  # fmt: skip
    cluster.apply_status_as(OTHER, c, theirs)

    async def scenario():
        client = cluster.agent_client()
        writer = StatusWriter(KubeStatus(DRIVER, client))
        try:
            async with registered_plugin(cluster.settings, cluster.inv, KubeClaimSource(client), writer) as kubelet:
                resp = await kubelet.prepare(c)
                assert resp.claims[c["metadata"]["uid"]].error == ""
                await writer.idle(30)
                prepared = await asyncio.to_thread(cluster.claim, c)
                again = await kubelet.prepare(c)  # idempotent: the same entries, nothing changes
                assert again.claims[c["metadata"]["uid"]].error == ""
                await writer.idle(30)
                reprepared = await asyncio.to_thread(cluster.claim, c)
                assert (await kubelet.unprepare(c)).claims[c["metadata"]["uid"]].error == ""
                await writer.idle(30)
                assert writer.failed == 0, writer.last_error
                assert writer.written == 2  # the prepare's apply, the re-prepare's "unchanged"
                return prepared, reprepared
        finally:
            await client.close()

    prepared, reprepared = run(scenario())
    entries = {e["device"]: e for e in ours(prepared)}
    by_request = {r["request"]: r["device"] for r in results if r["driver"] == DRIVER}
    assert set(entries) == {by_request["gpu"], by_request["nic"]}
    for e in entries.values():
        assert e["pool"] == cluster.name
        (ready,) = e["conditions"]
        assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "True", "Prepared")
        assert e["data"]["cdiDeviceIDs"] and e["data"]["kind"] in ("gpu", "nic")
    assert entries[by_request["nic"]]["networkData"] == {"interfaceName": "ens9f0", "hardwareAddress": MAC,
                                                       "ips": ["2001:db8::5/64"]}  # fmt: skip
    assert "networkData" not in entries[by_request["gpu"]]
    assert [e for e in prepared["status"]["devices"] if e["driver"] == OTHER] == theirs
    assert reprepared["metadata"]["resourceVersion"] == prepared["metadata"]["resourceVersion"]
    managers = {m["manager"] for m in prepared["metadata"]["managedFields"] if m.get("subresource") == "status"}
    assert {DRIVER, OTHER} <= managers
    after = cluster.claim(prepared)  # the unprepare sent nothing
    assert after["metadata"]["resourceVersion"] == prepared["metadata"]["resourceVersion"]
    meta = after["metadata"]
    path = resource_path("ResourceClaim", meta["namespace"], meta["name"]) + "/status"
    after["status"].pop("allocation")  # as kube-controller-manager deallocates
    deallocated = cluster.plane.request("PUT", path, body=after).json()
    assert "devices" not in deallocated["status"]  # ours and theirs: none of the devices is allocated any more


def _write(cluster, token: str | None, c: dict, entries: list[dict]) -> None:
    async def go():
        config = cluster.kubeconfig
        if token is not None:
            config = cluster.plane.write_kubeconfig(os.path.join(os.path.dirname(cluster.kubeconfig), unique("t")), token=token)
        client = AsyncClient(config=KubeConfig.from_file(config), field_manager=DRIVER)
        try:
            await asyncio.to_thread(KubeStatus(DRIVER, client).write, ref(c), entries)
        finally:
            await client.close()

    run(go())


def test_refused_for_a_claim_allocated_to_another_node(cluster):
    far = cluster.far["metadata"]["name"]
    c = cluster.allocated_claim(far, other=False)
    mine = [_entry(r) for r in c["status"]["allocation"]["devices"]["results"]]
    with pytest.raises(StatusRefused) as err:
        _write(cluster, None, c, mine)
    # the server's answer is a 422 whose field error is Forbidden (the check runs in validation)
    assert "422" in str(err.value) and "status.devices: Forbidden" in str(err.value)
    assert 'resource "resourceclaims/driver"' in str(err.value) and "arbitrary-node:patch" in str(err.value)
    assert ours(cluster.claim(c)) == []


def test_refused_for_another_drivers_entries(cluster):
    c = cluster.allocated_claim(cluster.name)
    theirs = [_entry(r) for r in c["status"]["allocation"]["devices"]["results"] if r["driver"] == OTHER]
    with pytest.raises(StatusRefused) as err:
        _write(cluster, None, c, theirs)
    assert "status.devices: Forbidden" in str(err.value) and 'resource "resourceclaims/driver"' in str(err.value)
    assert (cluster.claim(c).get("status") or {}).get("devices") is None


def test_refused_without_a_token_bound_to_the_node(cluster):
    """An unbound ServiceAccount token is checked for arbitrary-node:patch only, which we never grant."""
    c = cluster.allocated_claim(cluster.name, other=False)
    mine = [_entry(r) for r in c["status"]["allocation"]["devices"]["results"]]
    with pytest.raises(StatusRefused) as err:
        _write(cluster, cluster.plane.token("sysdra", "sysdra"), c, mine)
    assert "arbitrary-node:patch" in str(err.value)
    _write(cluster, None, c, mine)  # the node-bound pod token may
    assert [e["device"] for e in ours(cluster.claim(c))] == [e["device"] for e in mine]


def test_a_replaced_claim_is_not_written(cluster):
    c = cluster.allocated_claim(cluster.name, other=False)
    mine = [_entry(r) for r in c["status"]["allocation"]["devices"]["results"]]
    stale = ClaimRef(c["metadata"]["namespace"], c["metadata"]["name"], "00000000-0000-4000-8000-000000000000")

    async def go():
        client = cluster.agent_client()
        try:
            await asyncio.to_thread(KubeStatus(DRIVER, client).write, stale, mine)
        finally:
            await client.close()

    with pytest.raises(StatusRefused):
        run(go())
    assert ours(cluster.claim(c)) == []


def _limit_cases(base: dict) -> dict[str, dict]:
    cond = {"type": "Ready", "status": "True", "reason": "Prepared", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}
    conds = lambda n: [dict(cond, type=f"sysdra.io/c{i}") for i in range(n)]  # noqa: E731
    data = lambda n: {"x": "a" * (n - len('{"x":""}'))}  # noqa: E731 - n bytes of compact JSON
    v4 = lambda n: [f"192.0.2.{i + 1}/24" for i in range(n)]  # noqa: E731
    return {
        "plain": base,
        "8 conditions": dict(base, conditions=conds(8)), "9 conditions": dict(base, conditions=conds(9)),
        "duplicate condition types": dict(base, conditions=[cond, cond]),
        "reason with a space": dict(base, conditions=[dict(cond, reason="Not ready")]),
        "status maybe": dict(base, conditions=[dict(cond, status="Maybe")]),
        "data 10240 bytes": dict(base, data=data(10240)), "data 10241 bytes": dict(base, data=data(10241)),
        "data an array": dict(base, data=[1]),
        "16 IPs": dict(base, networkData={"ips": v4(16)}), "17 IPs": dict(base, networkData={"ips": v4(17)}),
        "duplicate IPs": dict(base, networkData={"ips": v4(1) * 2}),
        "IP without prefix": dict(base, networkData={"ips": ["192.0.2.5"]}),
        "IP not canonical": dict(base, networkData={"ips": ["2001:DB8::5/64"]}),
        "IPv4 host bits": dict(base, networkData={"ips": ["192.0.2.5/24"]}),
        "IPv4-mapped below /96": dict(base, networkData={"ips": ["::ffff:102:304/64"]}),
        "interface 256 bytes": dict(base, networkData={"interfaceName": "i" * 256}),
        "interface 257 bytes": dict(base, networkData={"interfaceName": "i" * 257}),
        "hardware address 128 bytes": dict(base, networkData={"hardwareAddress": "h" * 128}),
        "hardware address 129 bytes": dict(base, networkData={"hardwareAddress": "h" * 129}),
        "shareID of an unshared device": dict(base, shareID="00000000-0000-4000-8000-000000000000"),
        "shareID upper case": dict(base, shareID="00000000-0000-4000-8000-00000000000A"),
    }  # fmt: skip


def test_our_checks_and_the_server_agree_at_every_limit(cluster):
    from agent.kubeletplugin.devicestatus import allocated_keys, problems

    c = cluster.allocated_claim(cluster.name, other=False)
    r = c["status"]["allocation"]["devices"]["results"][0]
    base = {"driver": r["driver"], "pool": r["pool"], "device": r["device"]}
    meta = c["metadata"]
    path = resource_path("ResourceClaim", meta["namespace"], meta["name"]) + "/status"
    verdicts = {}
    for what, entry in _limit_cases(base).items():
        body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": meta["name"], "namespace": meta["namespace"]}, "status": {"devices": [entry]}}  # fmt: skip
        resp = cluster.plane.request("PATCH", path, body=body, params={"fieldManager": "limits", "force": "true"},
                                     content_type="application/apply-patch+yaml", ok=False)
        # duplicate list-map keys fail in server-side apply's merge, before validation: a 500
        want = (200, 500) if what == "duplicate condition types" else (200, 422)
        assert resp.status_code in want, (what, resp.status_code, resp.text[:300])
        verdicts[what] = (resp.status_code == 200, not problems(entry, allocated_keys(c)))
        cluster.apply_status_as("limits", c, [])
    assert {w: v for w, v in verdicts.items() if v[0] != v[1]} == {}
    assert [w for w, (server, _) in verdicts.items() if server] == [
        "plain", "8 conditions", "data 10240 bytes", "16 IPs", "IPv4 host bits", "interface 256 bytes",
        "hardware address 128 bytes"]  # fmt: skip
