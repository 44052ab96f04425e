"""deploy/rbac.yaml on the real authorizer (kube-apiserver v1.37.2, --authorization-mode=Node,RBAC):
the agent, with a token for its ServiceAccount bound to its Node, can do everything it does
(agent/publish/kubestore.py, agent/kubeletplugin/claims.py, doctor's review) and nothing more;
the kubelet's own identity is limited to its node's slices by the Node authorizer."""

from __future__ import annotations

import asyncio
import copy
import os

import pytest
import yaml
from lightkube import AsyncClient, KubeConfig

from agent.kubeletplugin.claims import ClaimError, KubeClaimSource
from agent.publish import Conflict
from agent.publish.kubestore import KubeStore
from tests.conftest import REPO
from tests.controlplane import token_claims, unique

DRIVER = "sysdra.io"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def slice_for(node: str, devices: int = 1) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"generateName": f"00000-{DRIVER}-{node}-"},
            "spec": {"driver": DRIVER, "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": f"dev-{i}"} for i in range(devices)]}}  # fmt: skip


class Agent:
    """The agent's identity: ServiceAccount sysdra/sysdra (deploy/rbac.yaml), token bound to its Node."""

    def __init__(self, plane, tmp):
        plane.apply(f"{REPO}/deploy/namespace.yaml")
        plane.apply(f"{REPO}/deploy/rbac.yaml")
        self.node = plane.create_node(unique("rbac-own"))
        self.name = self.node["metadata"]["name"]
        self.other = plane.create_node(unique("rbac-other"))["metadata"]["name"]
        self.token = plane.token("sysdra", "sysdra", node=self.name)
        self.kubeconfig = plane.write_kubeconfig(str(tmp / "agent.kubeconfig"), token=self.token, namespace="sysdra")
        self.http = plane.http(token=self.token)

    def client(self) -> AsyncClient:
        return AsyncClient(config=KubeConfig.from_file(self.kubeconfig), field_manager=DRIVER)


@pytest.fixture(scope="module")
def agent(apiserver, tmp_path_factory):
    # RBAC alone first: the server is the session's, and another module (the chart's, tests/test_mps_pods.py)
    # may have left the node policy in place, which a test below applies itself
    for kind in ("ValidatingAdmissionPolicyBinding", "ValidatingAdmissionPolicy"):
        apiserver.delete(kind, "sysdra-own-node-slices")
    a = Agent(apiserver, tmp_path_factory.mktemp("rbac"))
    yield a
    a.http.close()


def test_token_is_the_service_account_bound_to_the_node(apiserver, agent):
    claims = token_claims(agent.token)["kubernetes.io"]
    assert claims["serviceaccount"]["name"] == "sysdra" and claims["namespace"] == "sysdra"
    assert claims["node"] == {"name": agent.name, "uid": agent.node["metadata"]["uid"]}
    review = apiserver.request("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews", client=agent.http,
                               body={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}).json()  # fmt: skip
    user = review["status"]["userInfo"]
    assert user["username"] == "system:serviceaccount:sysdra:sysdra"
    assert user["extra"]["authentication.kubernetes.io/node-name"] == [agent.name]


def test_everything_the_store_does_is_allowed(agent):
    async def scenario():
        client = agent.client()
        store = KubeStore(client, node_name=agent.name, driver_name=DRIVER)
        try:
            assert await store.node_uid() == agent.node["metadata"]["uid"]  # get nodes
            created = await store.create(slice_for(agent.name))  # create
            listed = await store.list_slices()  # list, field selectors
            assert [o["metadata"]["name"] for o in listed] == [created["metadata"]["name"]]
            events = store.watch(store.list_resource_version)  # watch
            updated = copy.deepcopy(created)
            updated["spec"]["devices"].append({"name": "dev-new"})
            updated = await store.update(updated)  # update (resourceVersion precondition)
            kind, obj = await asyncio.wait_for(events.__anext__(), 10)
            assert kind == "MODIFIED" and obj["metadata"]["resourceVersion"] == updated["metadata"]["resourceVersion"]
            await events.aclose()
            with pytest.raises(Conflict):
                await store.update(created)  # stale resourceVersion: 409, not 403
            await store.delete(updated["metadata"]["name"], updated["metadata"]["uid"], updated["metadata"]["resourceVersion"])
            assert await store.list_slices() == []
        finally:
            await client.close()

    run(scenario())


def test_resource_claims_can_be_read_for_prepare(apiserver, agent):
    ns = unique("claims")
    apiserver.create_namespace(ns)
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "c", "namespace": ns},
             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.sysdra.io"}}]}}}  # fmt: skip
    uid = apiserver.create(claim)["metadata"]["uid"]

    async def scenario():
        client = agent.client()
        try:
            source = KubeClaimSource(client)
            got = await asyncio.to_thread(source.read_claim, ns, "c")
            with pytest.raises(ClaimError, match="not found"):
                await asyncio.to_thread(source.read_claim, ns, "missing")
            return got
        finally:
            await client.close()

    assert run(scenario())["metadata"]["uid"] == uid


@pytest.mark.parametrize("method,path", [
    ("GET", "/api/v1/namespaces/sysdra/secrets"),
    ("GET", "/api/v1/secrets"),
    ("GET", "/api/v1/namespaces/kube-system/configmaps"),
    ("GET", "/api/v1/pods"),
    ("GET", "/api/v1/nodes"),  # get one node, not list them
    ("PATCH", "/api/v1/nodes/{node}"),
    ("DELETE", "/api/v1/nodes/{node}"),
    ("PATCH", "/apis/resource.k8s.io/v1/resourceslices/x"),  # the agent replaces, never patches
    ("DELETE", "/apis/resource.k8s.io/v1/resourceslices"),  # deletecollection is the kubelet's
    ("GET", "/apis/resource.k8s.io/v1/resourceclaims"),  # claims: get by name only
    ("PUT", "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/c/status"),
    ("POST", "/apis/resource.k8s.io/v1/deviceclasses"),
    ("POST", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings"),
])  # fmt: skip
def test_calls_the_agent_must_not_make_are_refused(apiserver, agent, method, path):
    body = "{}" if method in ("POST", "PUT", "PATCH") else None
    headers = {"Content-Type": "application/merge-patch+json" if method == "PATCH" else "application/json"}
    r = agent.http.request(method, path.format(node=agent.name), content=body, headers=headers)
    assert r.status_code == 403, (method, path, r.status_code, r.text[:300])


def test_doctor_api_check_passes_as_the_agent_and_fails_without_the_binding(apiserver, agent, monkeypatch, tmp_path):
    from agent.tools.doctor import check_api

    monkeypatch.setenv("KUBECONFIG", agent.kubeconfig)
    found = {f.check: f for f in check_api("kube", agent.name)}
    assert found["api"].level == "ok" and found["rbac"].level == "ok", found
    assert found["identity"].level == "ok", found["identity"]
    assert found["clock"].level == "ok"
    # a ServiceAccount without the binding: doctor names what is missing
    apiserver.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "unbound", "namespace": "sysdra"}})
    token = apiserver.token("sysdra", "unbound")
    monkeypatch.setenv("KUBECONFIG", apiserver.write_kubeconfig(str(tmp_path / "unbound.kubeconfig"), token=token))
    found = {f.check: f for f in check_api("kube", agent.name)}
    assert found["rbac"].level == "fail" and "create resourceslices" in found["rbac"].message


def _doctor_as(apiserver, monkeypatch, path, node, **identity):
    from agent.tools.doctor import check_api

    monkeypatch.setenv("KUBECONFIG", apiserver.write_kubeconfig(str(path), namespace="sysdra", **identity))
    return {f.check: f for f in check_api("kube", node)}


def test_doctor_fails_the_agents_own_rbac_without_a_node_bound_token(apiserver, agent, monkeypatch, tmp_path):
    """The systemd unit's credential: RBAC alone passes the access reviews, but a token bound to
    no node (or another node) cannot write claim status. The SelfSubjectReview tells them apart."""
    unbound = apiserver.token("sysdra", "sysdra")  # TokenRequest without boundObjectRef
    assert "node" not in token_claims(unbound)["kubernetes.io"]
    found = _doctor_as(apiserver, monkeypatch, tmp_path / "unbound", agent.name, token=unbound)
    assert found["rbac"].level == "ok", found["rbac"]  # what doctor said before: all fine
    assert found["identity"].level == "fail", found["identity"]
    assert "system:serviceaccount:sysdra:sysdra is bound to no node" in found["identity"].message
    assert "claim status writes" in found["identity"].message
    assert f"--bound-object-kind Node --bound-object-name {agent.name}" in found["identity"].fix
    other = apiserver.token("sysdra", "sysdra", node=agent.other)
    found = _doctor_as(apiserver, monkeypatch, tmp_path / "other", agent.name, token=other)
    assert found["identity"].level == "fail" and f"bound to node {agent.other}, not to this node" in found["identity"].message
    found = _doctor_as(apiserver, monkeypatch, tmp_path / "bound", agent.name, token=agent.token)
    assert found["identity"].level == "ok" and found["rbac"].level == "ok", found


def test_a_token_file_replaced_before_its_token_dies_needs_no_restart(apiserver, agent, tmp_path):
    """The systemd unit's rotation (docs/operations.md, "Credentials"): the kubeconfig names a
    tokenFile; a refresh replaces the file; when the old token is refused (401) both of the
    agent's clients (lightkube for slices, apihttp for claims) read the file again. The old token
    is killed by deleting the Node it is bound to: a TokenRequest lives 10 minutes at least."""
    doomed = apiserver.create_node(unique("rbac-doomed"))["metadata"]["name"]
    token_file = tmp_path / "token"
    first = apiserver.token("sysdra", "sysdra", node=doomed)
    token_file.write_text(first + "\n")
    kubeconfig = apiserver.write_kubeconfig(str(tmp_path / "kubeconfig"), token_file=str(token_file), namespace="sysdra")
    ns = unique("rotate")
    apiserver.create_namespace(ns)
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "c", "namespace": ns},
             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.sysdra.io"}}]}}}  # fmt: skip
    apiserver.create(claim)

    async def scenario():
        client = AsyncClient(config=KubeConfig.from_file(kubeconfig), field_manager=DRIVER)
        store, source = KubeStore(client, node_name=agent.name, driver_name=DRIVER), KubeClaimSource(client)
        try:
            assert await store.node_uid() == agent.node["metadata"]["uid"]  # the first token read
            assert (await asyncio.to_thread(source.read_claim, ns, "c"))["metadata"]["name"] == "c"
            fresh = apiserver.token("sysdra", "sysdra", node=agent.name)
            token_file.with_name("token.new").write_text(fresh + "\n")
            os.replace(token_file.with_name("token.new"), token_file)  # the refresh, atomically
            apiserver.delete("Node", doomed)
            await asyncio.to_thread(_until_refused, apiserver, first)
            assert await store.node_uid() == agent.node["metadata"]["uid"]  # a 401, the file again
            assert (await asyncio.to_thread(source.read_claim, ns, "c"))["metadata"]["name"] == "c"
        finally:
            await client.close()

    run(scenario())


def _until_refused(apiserver, token: str) -> None:
    import time

    deadline = time.monotonic() + 30
    with apiserver.http(token=token) as http:
        while http.get("/api").status_code != 401:  # the server may cache a good token a few seconds
            assert time.monotonic() < deadline, "a token bound to a deleted Node is still accepted"
            time.sleep(0.2)


def test_rbac_alone_lets_the_agent_write_another_nodes_slices(apiserver, agent):
    """RBAC cannot look at spec.nodeName: with deploy/rbac.yaml only, the agent's token can
    create a slice for a node it does not run on. The node binding in its token
    (userInfo.extra node-name) is what an admission policy can check (next test)."""
    import time

    deadline = time.monotonic() + 30
    while True:  # a policy the fixture deleted may still be in the server's policy informer
        r = agent.http.post("/apis/resource.k8s.io/v1/resourceslices", json=slice_for(agent.other))
        if "ValidatingAdmissionPolicy" not in r.text or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.status_code == 201, r.text
    apiserver.delete("ResourceSlice", r.json()["metadata"]["name"])


# deploy/admission-policy.yaml: the agent may write only its own node's slices
NODE_POLICY = list(yaml.safe_load_all(open(os.path.join(REPO, "deploy", "admission-policy.yaml"))))


def test_node_bound_token_and_an_admission_policy_confine_the_agent_to_its_node(apiserver, agent):
    import time

    apiserver.apply(NODE_POLICY)
    try:
        deadline = time.monotonic() + 30
        while True:  # the policy takes effect once the server's policy informer has it
            r = agent.http.post("/apis/resource.k8s.io/v1/resourceslices", json=slice_for(agent.other))
            if r.status_code != 201 or time.monotonic() > deadline:
                break
            apiserver.delete("ResourceSlice", r.json()["metadata"]["name"])
            time.sleep(0.2)
        assert r.status_code == 403 and "may only write its own node" in r.text, r.text
        own = agent.http.post("/apis/resource.k8s.io/v1/resourceslices", json=slice_for(agent.name))
        assert own.status_code == 201, own.text
        apiserver.delete("ResourceSlice", own.json()["metadata"]["name"])
    finally:
        apiserver.delete("ValidatingAdmissionPolicyBinding", "sysdra-own-node-slices")
        apiserver.delete("ValidatingAdmissionPolicy", "sysdra-own-node-slices")


def test_kubelet_identity_wipes_only_its_own_nodes_slices(apiserver):
    """The kubelet wipes a driver's slices with a deletecollection by field selector, as
    system:node:<name>; the Node authorizer lets it touch its own node's slices only."""
    own, other = unique("kubelet-own"), unique("kubelet-other")
    for n in (own, other):
        apiserver.create_node(n)
        apiserver.create(slice_for(n, devices=2))
    kubelet = apiserver.http(cert=apiserver.node_identity(own))
    try:
        wipe = lambda node: kubelet.request("DELETE", "/apis/resource.k8s.io/v1/resourceslices",  # noqa: E731
                                            params={"fieldSelector": f"spec.nodeName={node},spec.driver={DRIVER}"})
        assert wipe(other).status_code == 403
        assert wipe(own).status_code == 200
        assert apiserver.list("ResourceSlice", fields={"spec.nodeName": own}) == []
        assert len(apiserver.list("ResourceSlice", fields={"spec.nodeName": other})) == 1
    finally:
        kubelet.close()
