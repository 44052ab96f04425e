"""status.devices (KEP-4817) and its fine-grained authorization on the real kube-apiserver v1.37.2.

The agent runs as the DaemonSet does: ServiceAccount sysdra/sysdra (deploy/rbac.yaml) with the
token the kubelet mounts into its pod (bound to the Pod object, so it carries the node name).
Claims are allocated by the upstream allocator from what the server holds, and written as the
scheduler does. Another driver shares the claim and writes its own entry with its own field
manager; the agent's server-side apply must leave it untouched."""

from __future__ import annotations

import asyncio
import copy
import json
import os

import pytest
from lightkube import AsyncClient, KubeConfig

from agent.kubeletplugin.claims import KubeClaimSource
from agent.kubeletplugin.statusbackends import KubeStatus, StatusRefused
from agent.kubeletplugin.statuswriter import StatusWriter
from agent.kubeletplugin.types import ClaimRef
from agent.publish import Reconciler
from agent.publish.kubestore import KubeStore
from agent.publish.slices import build_pool
from discovery.models import AttributeValue, NetInterface, NicInfo
from tests.conftest import REPO
from tests.controlplane import allocate, load_yaml, resource_path, unique
from tests.kubelet_standin import gpu, inventory, nic, registered_plugin, settings_for

DRIVER = "sysdra.io"
OTHER = "other.example.com"
MAC = "0c:42:a1:00:00:01"


def run(coro, timeout: float = 90):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def typed(*devices):
    # the `type` attribute deploy/deviceclasses.yaml selects on (discovery always sets it)
    return [d.replace(attributes={"type": AttributeValue(string=d.kind)}) for d in devices]


def host_root(tmp) -> str:
    """A host tree whose init's network namespace lists one global IPv6 address on ens9f0
    (``/proc/1/net/if_inet6``, the kernel's format) and one link-local that is left out."""
    root = os.path.join(str(tmp), "host")
    os.makedirs(os.path.join(root, "proc", "1", "net"))
    with open(os.path.join(root, "proc", "1", "net", "if_inet6"), "w") as f:
        f.write("20010db8000000000000000000000005 05 40 00 80 ens9f0\n"
                "fe800000000000000e42a1fffe000001 05 40 20 80 ens9f0\n")  # fmt: skip
    return root


class Cluster:
    """The deploy/ manifests on the server, a class for the other driver, two nodes."""

    def __init__(self, plane, tmp):
        self.plane = plane
        for name in ("namespace.yaml", "rbac.yaml", "deviceclasses.yaml"):
            plane.apply(f"{REPO}/deploy/{name}")
        self.other_class = unique("other")
        plane.apply({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": self.other_class},
                     "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{OTHER}"'}}]}})  # fmt: skip
        self.node = plane.create_node(unique("status-own"))
        self.name = self.node["metadata"]["name"]
        self.far = plane.create_node(unique("status-far"))
        self.ns = unique("status")
        plane.create_namespace(self.ns)
        self.pod_token = self.daemonset_pod_token()
        self.kubeconfig = plane.write_kubeconfig(str(tmp / "agent.kubeconfig"), token=self.pod_token, namespace="sysdra")
        host = host_root(tmp)
        devices = typed(gpu(0, root=host), nic(0, "ens9f0"))
        devices[1] = devices[1].replace(nic=NicInfo(interfaces=(NetInterface(name="ens9f0", mac=MAC),)))
        self.inv = inventory(*devices, root=host)
        self.settings = settings_for(str(tmp), root=host, node_name=self.name, cluster="kube")
        for node in (self.name, self.far["metadata"]["name"]):
            self.publish(node)

    def daemonset_pod_token(self) -> str:
        """What the kubelet mounts into the DaemonSet's pod: a token bound to the Pod, which runs
        on our node. The Pod is the DaemonSet's own template, so the server validates that too."""
        (ds,) = [d for d in load_yaml(f"{REPO}/deploy/daemonset.yaml") if d["kind"] == "DaemonSet"]
        self.plane.apply(ds)
        template = copy.deepcopy(ds["spec"]["template"])
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": unique("sysdra"), "namespace": "sysdra", "labels": template["metadata"]["labels"]},
               "spec": dict(template["spec"], nodeName=self.name)}  # fmt: skip
        pod = self.plane.create(pod)
        assert any(v.get("projected") for v in pod["spec"]["volumes"]), "the kube-api-access volume is mounted"
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": pod["metadata"]["name"],
                                            "uid": pod["metadata"]["uid"]}}}  # fmt: skip
        path = resource_path("ServiceAccount", "sysdra", "sysdra") + "/token"
        return self.plane.request("POST", path, body=body).json()["status"]["token"]

    def publish(self, node: str) -> None:
        async def sync():
            client = AsyncClient(config=KubeConfig.from_file(self.plane.kubeconfig), field_manager=DRIVER)
            try:
                store = KubeStore(client, node_name=node, driver_name=DRIVER)
                await Reconciler(store, node_name=node, driver_name=DRIVER).sync(
                    build_pool(self.inv, node_name=node, driver_name=DRIVER))
            finally:
                await client.close()

        run(sync())
        self.plane.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{node}-{OTHER}"},
                           "spec": {"driver": OTHER, "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                                    "devices": [{"name": "other-0"}]}})  # fmt: skip

    def allocated_claim(self, node: str, other: bool = True) -> dict:
        """A claim for a GPU, a NIC (and the other driver's device), allocated on ``node`` by the allocator."""
        requests = [{"name": "gpu", "exactly": {"deviceClassName": "gpu.sysdra.io"}},
                    {"name": "nic", "exactly": {"deviceClassName": "nic.sysdra.io"}}]  # fmt: skip
        if other:
            requests.append({"name": "other", "exactly": {"deviceClassName": self.other_class}})
        stored = self.plane.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                    "metadata": {"name": unique("claim"), "namespace": self.ns},
                                    "spec": {"devices": {"requests": requests}}})  # fmt: skip
        slices = self.plane.list("ResourceSlice", fields={"spec.nodeName": node})
        classes = self.plane.list("DeviceClass")
        (allocation,) = allocate(slices, classes, stored, node=self.plane.get("Node", node))
        meta = stored["metadata"]
        path = resource_path("ResourceClaim", meta["namespace"], meta["name"]) + "/status"
        return self.plane.request("PUT", path, body=dict(stored, status={"allocation": allocation})).json()

    def claim(self, c: dict) -> dict:
        return self.plane.get("ResourceClaim", c["metadata"]["name"], c["metadata"]["namespace"])

    def apply_status_as(self, manager: str, c: dict, entries: list[dict]) -> dict:
        meta = c["metadata"]
        path = resource_path("ResourceClaim", meta["namespace"], meta["name"]) + "/status"
        body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": meta["name"], "namespace": meta["namespace"]}, "status": {"devices": entries}}  # fmt: skip
        return self.plane.request("PATCH", path, body=body, params={"fieldManager": manager, "force": "true"},
                                  content_type="application/apply-patch+yaml").json()

    def agent_client(self) -> AsyncClient:
        return AsyncClient(config=KubeConfig.from_file(self.kubeconfig), field_manager=DRIVER)


@pytest.fixture(scope="module")
def cluster(apiserver, tmp_path_factory):
    return Cluster(apiserver, tmp_path_factory.mktemp("status"))


def ref(c: dict) -> ClaimRef:
    m = c["metadata"]
    return ClaimRef(m["namespace"], m["name"], m["uid"])


def ours(c: dict) -> list[dict]:
    return [e for e in (c.get("status") or {}).get("devices") or [] if e["driver"] == DRIVER]


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


def _entry(r: dict) -> dict:
    return {"driver": r["driver"], "pool": r["pool"], "device": r["device"], "data": {"x": 1}}


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
