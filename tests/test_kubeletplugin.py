"""Kubelet plugin over real unix sockets: registration, prepare/unprepare on v1 and v1beta1,
input checks, restarts and concurrent calls. A kubelet stand-in drives the plugin like the real
one. Socket handling and rolling updates are tests/test_kubeletplugin_sockets.py's."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
import stat

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.prepare.checkpoint import Checkpoint
from agent.prepare.metadata.stream import read_file
from agent.protos import dra_v1_pb2, dra_v1_pb2_grpc, pluginregistration_pb2, pluginregistration_pb2_grpc
from tests.kubelet_standin import DRIVER, Env, _ref as claim_ref, claim, run, store_claim


@pytest.fixture
def env(tmp_path):
    return Env(tmp_path)


def test_registration_info_and_status(env):
    async def main():
        async with env as e:
            info = e.kubelet.info
            assert info.type == "DRAPlugin" and info.name == DRIVER
            assert info.endpoint == os.path.join(e.settings.kubelet_dir, "plugins", DRIVER, "dra.sock")
            assert os.path.isabs(info.endpoint)
            assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
            assert e.kubelet.service == "v1.DRAPlugin"
            assert e.plugin.registration.registered and e.plugin.registration.failures == 0
            reg = e.plugin.registration_socket
            assert reg == os.path.join(e.settings.kubelet_dir, "plugins_registry", f"{DRIVER}-reg.sock")
            for path in (reg, e.plugin.dra_socket):
                mode = os.stat(path).st_mode
                assert stat.S_ISSOCK(mode) and not mode & stat.S_IWOTH
                assert not os.stat(os.path.dirname(path)).st_mode & stat.S_IWOTH
            seen = []
            e.plugin.registration.listeners.append(lambda st: seen.append((st.registered, st.error)))
            # a rejected registration is kept for status output
            async with grpc.aio.insecure_channel("unix:" + reg) as ch:
                stub = pluginregistration_pb2_grpc.RegistrationStub(ch)
                await stub.NotifyRegistrationStatus(
                    pluginregistration_pb2.RegistrationStatus(plugin_registered=False, error="boom"))
            assert not e.plugin.registration.registered and e.plugin.registration.error == "boom"
            assert e.plugin.registration.failures == 1 and e.plugin.registration.updated
            assert seen == [(False, "boom")] and "listeners" not in e.plugin.registration.as_dict()
        assert not os.path.exists(e.plugin.registration_socket)
        assert not os.path.exists(e.plugin.dra_socket)
    run(main())


def test_dra_served_before_registration_socket_appears(tmp_path, monkeypatch):
    e = Env(tmp_path)
    seen = []
    orig = e.plugin._reg.start

    async def spy(add):
        # the DRA endpoint must answer before the kubelet can see the registration socket
        seen.append(os.path.exists(e.plugin.registration_socket))
        async with grpc.aio.insecure_channel("unix:" + e.plugin.dra_socket) as ch:
            resp = await dra_v1_pb2_grpc.DRAPluginStub(ch).NodeUnprepareResources(
                dra_v1_pb2.NodeUnprepareResourcesRequest(), timeout=5)
        seen.append(len(resp.claims))
        await orig(add)

    monkeypatch.setattr(e.plugin._reg, "start", spy)

    async def main():
        async with e:
            pass
    run(main())
    assert seen == [False, 0]


@pytest.mark.parametrize("version", ["v1.DRAPlugin", "v1beta1.DRAPlugin"])
def test_prepare_unprepare_both_versions(env, version):
    async def main():
        async with env as e:
            e.kubelet.service = version
            c = store_claim(e.settings, claim("c1", [("gpus/big", "gpu-0000-1b-00-0"), ("nets", "nic-0000-40-00-0")],
                                               share_ids={"nic-0000-40-00-0": "5ab3c1c8-0000-4000-8000-000000000001"}))
            uid = c["metadata"]["uid"]
            resp = await e.kubelet.prepare(c)
            assert list(resp.claims) == [uid]
            r = resp.claims[uid]
            assert r.error == ""
            devs = [(list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids)) for d in r.devices]
            assert devs == [  # each request's KEP-5304 metadata ID rides on its first device
                (["gpus"], "node-1", "gpu-0000-1b-00-0",
                 [f"k8s.{DRIVER}/claim={uid}-gpu-0000-1b-00-0", f"{DRIVER}/metadata={uid}_gpus"]),
                (["nets"], "node-1", "nic-0000-40-00-0",
                 # a share is its own CDI device: <claim>-<device>-<shareID> (docs/sharing.md)
                 [f"k8s.{DRIVER}/claim={uid}-nic-0000-40-00-0-5ab3c1c8-0000-4000-8000-000000000001", f"{DRIVER}/metadata={uid}_nets"]),
            ]
            if version == "v1.DRAPlugin":
                assert not r.devices[0].HasField("share_id")
                assert r.devices[1].share_id == "5ab3c1c8-0000-4000-8000-000000000001"
            else:
                assert "share_id" not in r.devices[1].DESCRIPTOR.fields_by_name
            spec_path = os.path.join(e.settings.cdi_dir, f"k8s.{DRIVER}-claim_{uid}.json")
            spec = json.load(open(spec_path))
            assert stat.S_IMODE(os.stat(spec_path).st_mode) == 0o644
            assert spec["kind"] == f"k8s.{DRIVER}/claim"
            # idempotent: same answer again, spec unchanged
            again = await e.kubelet.prepare(c)
            assert again == resp
            un = await e.kubelet.unprepare(c)
            assert list(un.claims) == [uid] and un.claims[uid].error == ""
            assert not os.path.exists(spec_path)
            un = await e.kubelet.unprepare(c)  # idempotent, unknown claims succeed
            assert un.claims[uid].error == ""
            assert os.listdir(e.settings.cdi_dir) == []
    run(main())


def test_every_claim_answered_with_its_own_error(env):
    async def main():
        async with env as e:
            good = store_claim(e.settings, claim("good", [("r", "gpu-0000-1b-00-0")]))
            gone = store_claim(e.settings, claim("gone", [("r", "gpu-0000-99-00-0")]))
            replaced = store_claim(e.settings, claim("replaced", [("r", "gpu-0000-1c-00-0")]))
            other_pool = store_claim(e.settings, claim("otherpool", [("r", "gpu-0000-1c-00-0")], pool="node-2"))
            unalloc = claim("unalloc", [])
            del unalloc["status"]
            store_claim(e.settings, unalloc)
            os.makedirs(os.path.join(e.settings.cluster_dir, "resourceclaims", "default"), exist_ok=True)
            with open(os.path.join(e.settings.cluster_dir, "resourceclaims", "default", "corrupt.json"), "w") as f:
                f.write("{not json")
            other_driver = store_claim(e.settings, claim("otherdrv", [("r", "x")], driver="other.example.com"))
            refs = [good, gone, ("default", "replaced", "0badc0de-0000-4000-8000-000000000000"), other_pool,
                    unalloc, ("default", "missing", "11111111-2222-4333-8444-555555555555"),
                    ("default", "corrupt", "22222222-2222-4333-8444-555555555555"), other_driver]
            resp = await e.kubelet.prepare(*refs)
            errors = {uid: r.error for uid, r in resp.claims.items()}
            assert set(errors) == {r[2] if isinstance(r, tuple) else r["metadata"]["uid"] for r in refs}
            assert errors[good["metadata"]["uid"]] == ""
            assert "not on this node" in errors[gone["metadata"]["uid"]]
            assert "replaced" in errors["0badc0de-0000-4000-8000-000000000000"]
            assert "pool 'node-2'" in errors[other_pool["metadata"]["uid"]]
            assert "not allocated" in errors[unalloc["metadata"]["uid"]]
            assert "not found" in errors["11111111-2222-4333-8444-555555555555"]
            assert "corrupt.json" in errors["22222222-2222-4333-8444-555555555555"]
            # devices of other drivers are not ours: prepared with no devices, no spec
            assert errors[other_driver["metadata"]["uid"]] == "" and not resp.claims[other_driver["metadata"]["uid"]].devices
            assert sorted(os.listdir(e.settings.cdi_dir)) == [
                f"k8s.{DRIVER}-claim_{good['metadata']['uid']}.json", f"{DRIVER}_metadata_{good['metadata']['uid']}_r.json"]
            assert replaced  # stored under another UID
    run(main())


def test_a_result_the_kubelet_cannot_be_sent_is_that_claims_error_and_counted_so(env):
    """A driver bug (a device the answer cannot carry) fails only its claim, on both the kubelet's
    answer and the metrics; no status entries are handed on for it."""
    prepare_claims = env.driver.prepare_claims

    def buggy(claims):
        out = prepare_claims(claims)
        for uid, res in out.items():
            if any(c["metadata"]["name"] == "bad" and c["metadata"]["uid"] == uid for c in claims):
                res.devices[0].cdi_ids = [*res.devices[0].cdi_ids, 7]
        return out

    env.driver.prepare_claims = buggy
    calls = []
    env.plugin.observe = lambda what, results, seconds: calls.append({u: r.error for u, r in results.items()})

    async def main():
        async with env as e:
            good = store_claim(e.settings, claim("good", [("r", "gpu-0000-1b-00-0")]))
            bad = store_claim(e.settings, claim("bad", [("r", "gpu-0000-1c-00-0")]))
            resp = await e.kubelet.prepare(good, bad)
            assert resp.claims[good["metadata"]["uid"]].error == "" and resp.claims[good["metadata"]["uid"]].devices
            err = resp.claims[bad["metadata"]["uid"]]
            assert err.error.startswith("internal error encoding the result") and not err.devices
            assert calls == [{good["metadata"]["uid"]: None, bad["metadata"]["uid"]: err.error}]
    run(main())


@pytest.mark.parametrize("ns,name,uid,msg", [
    ("default", "c", "", "uid is empty"),
    ("", "c", "7f1c7a52-0000-4000-8000-000000000000", "namespace is empty"),
    ("default", "", "7f1c7a52-0000-4000-8000-000000000001", "name is empty"),
    ("default", "../../etc/passwd", "7f1c7a52-0000-4000-8000-000000000002", "path separator"),
    ("..", "c", "7f1c7a52-0000-4000-8000-000000000003", "path separator"),
    ("default", "c", "../../x", "path separator"),
    ("default", "a..b", "7f1c7a52-0000-4000-8000-000000000004", "'..'"),
    ("kube/system", "c", "7f1c7a52-0000-4000-8000-000000000005", "path separator"),
    ("default", "c", "uid with spaces", "malformed"),
    ("Default", "c", "7f1c7a52-0000-4000-8000-000000000006", "DNS label"),
    ("default", "x" * 100000, "7f1c7a52-0000-4000-8000-000000000007", "characters long"),
])
def test_malformed_input_is_a_per_claim_error(env, ns, name, uid, msg):
    async def main():
        async with env as e:
            good = store_claim(e.settings, claim("good", [("r", "gpu-0000-1b-00-0")]))
            for call in (e.kubelet.prepare, e.kubelet.unprepare):
                resp = await call((ns, name, uid), good)
                assert msg in resp.claims[uid].error
                assert resp.claims[good["metadata"]["uid"]].error == ""
            # nothing written outside our directories
            assert not os.path.exists(os.path.join(e.settings.kubelet_dir, "..", "etc"))
    run(main())


def test_a_claim_of_the_longest_valid_names_is_prepared_and_unprepared(env):
    """A namespace of 63 characters and a claim name of 250 are valid (253 are, but the ``dir:``
    store's file, "<name>.json", holds 250 at most), while "<namespace>_<name>",
    the host directory of the claim's device metadata, is longer than a file name can be (255
    bytes): prepare failed ("internal error: File name too long") and so did every unprepare,
    for ever (the kubelet keeps the pod terminating until its claims are unprepared)."""
    ns, name = "n" * 63, ".".join(["a" * 63] * 3) + "." + "b" * 58

    async def main():
        async with env as e:
            c = store_claim(e.settings, claim(name, [("r", "gpu-0000-1b-00-0")], namespace=ns))
            other = store_claim(e.settings, claim("other", [("r", "gpu-0000-1c-00-0")]))
            uid = c["metadata"]["uid"]
            assert (await e.kubelet.prepare(other)).claims[other["metadata"]["uid"]].error == ""
            assert (await e.kubelet.unprepare(c)).claims[uid].error == ""  # never prepared
            assert (await e.kubelet.prepare(c)).claims[uid].error == ""
            with open(os.path.join(e.settings.cdi_dir, f"{DRIVER}_metadata_{uid}_r.json")) as f:
                (mount,) = json.load(f)["devices"][0]["containerEdits"]["mounts"]
            assert read_file(mount["hostPath"])["metadata"]["name"] == name
            assert mount["containerPath"].endswith(f"/resourceclaims/{name}/r/{DRIVER}-metadata.json")
            assert (await e.kubelet.unprepare(c, other)).claims[uid].error == ""
            assert os.listdir(e.settings.cdi_dir) == [] and not os.path.exists(mount["hostPath"])
            assert os.listdir(os.path.join(e.settings.plugin_dir, "dra-device-metadata")) == []
    run(main())


ODD = st.text(alphabet="ab-./\\\x00\u00fc0 ", max_size=6) | st.sampled_from(["", "..", "default", "g0", "a" * 254])


def test_any_mix_of_references_is_answered_claim_by_claim(env):
    """Any call, mixing good references with odd text, repeats, a good claim's UID under another
    name and a good name under another UID, is answered for every UID asked: a good one (asked
    under one name) prepared and then unprepared, every other one its own error; nothing is left."""
    loop = asyncio.new_event_loop()
    loop.run_until_complete(env.__aenter__())
    good = [claim_ref(store_claim(env.settings, claim(f"g{i}", [("r", d)]))) for i, d in enumerate(("gpu-0000-1b-00-0", "gpu-0000-1c-00-0"))]
    good.append(claim_ref(store_claim(env.settings, claim("f", [("r", "x")], driver="other.example.com"))))
    ref = st.one_of(st.sampled_from(good), st.tuples(ODD, ODD, ODD | st.sampled_from([g[2] for g in good])),
                    st.builds(lambda g, name: (g[0], name, g[2]), st.sampled_from(good), st.sampled_from(["g0", "f", "zz"])),
                    st.builds(lambda g, uid: (g[0], g[1], uid), st.sampled_from(good), st.sampled_from([g[2] for g in good])))

    @settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.lists(ref, min_size=1, max_size=6))
    def check(refs):
        asked: dict[str, set] = {}
        for ns, name, uid in refs:
            asked.setdefault(uid, set()).add((ns, name, uid))
        ok = {uid for uid, names in asked.items() if len(names) == 1 and next(iter(names)) in good}
        prepared = loop.run_until_complete(env.kubelet.prepare(*refs)).claims
        assert set(prepared) == set(asked)
        assert {uid for uid, r in prepared.items() if not r.error} == ok, {u: r.error for u, r in prepared.items()}
        unprepared = loop.run_until_complete(env.kubelet.unprepare(*refs)).claims
        assert set(unprepared) == set(asked) and not any(unprepared[uid].error for uid in ok)
        assert Checkpoint.load(env.driver.checkpoint_path, move_corrupt=False).claims == {}
        assert os.listdir(env.settings.cdi_dir) == []

    try:
        check()
    finally:
        loop.run_until_complete(env.__aexit__(None, None, None))
        loop.close()


def test_oversize_request(env):
    async def main():
        async with env as e:
            refs = [("default", f"c{i}", f"00000000-0000-4000-8000-{i:012d}") for i in range(1001)]
            resp = await e.kubelet.prepare(*refs)
            assert len(resp.claims) == 1001
            assert all("at most 1000" in r.error for r in resp.claims.values())
    run(main())


def test_restart_over_same_directories(tmp_path):
    async def main():
        e = Env(tmp_path)
        async with e:
            c = store_claim(e.settings, claim("c", [("r", "gpu-0000-1b-00-0")]))
            first = await e.kubelet.prepare(c)
        e2 = Env(tmp_path)
        async with e2:
            again = await e2.kubelet.prepare(c)
            assert again == first
            assert (await e2.kubelet.unprepare(c)).claims[c["metadata"]["uid"]].error == ""
    run(main())


def test_concurrent_prepares_are_serialized(tmp_path):
    async def main():
        async with Env(tmp_path, share=("gpu",)) as e:  # 16 shares of one GPU: no claim is refused
            claims = [store_claim(e.settings, claim(f"c{i}", [("r", "gpu-0000-1b-00-0")],
                                                    share_ids={"gpu-0000-1b-00-0": str(uuid.uuid4())})) for i in range(16)]
            resps = await asyncio.gather(*(e.kubelet.prepare(c) for c in claims))
            assert all(r.claims[c["metadata"]["uid"]].error == "" for r, c in zip(resps, claims))
            assert len(e.driver.checkpoint.claims) == 16
    run(main())
