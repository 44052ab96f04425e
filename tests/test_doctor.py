"""sysdra doctor on temp kubelet/CDI/metadata trees: good and broken inputs."""

from __future__ import annotations

import email.utils
import json
import os
import socket

import pytest

from agent.cli.main import main as cli_main
from agent.service.status import StatusBoard
from agent.settings import Settings
from agent.tools import doctor, doctor_files
from cdi.spec import finish
from tests.test_status import _Serving

GOOD = {"kind": "k8s.sysdra.io/claim", "devices": [{"name": "0b7e-gpu", "containerEdits": {"deviceNodes": [{"path": "/dev/null"}]}}]}


def levels(findings, prefix=""):
    return [(f.check.split(":", 1)[0], f.level) for f in findings if f.check.startswith(prefix)]


@pytest.fixture
def node(tmp_path):
    kubelet = tmp_path / "kubelet"
    plugin = kubelet / "plugins" / "sysdra.io"
    (kubelet / "plugins_registry").mkdir(parents=True)
    plugin.mkdir(parents=True)
    settings = Settings(node_name="node-a", kubelet_dir=str(kubelet), cdi_dir=str(tmp_path / "cdi"), cluster="dir:" + str(tmp_path / "c"))
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(plugin / "dra.sock"))
    listener.listen(1)
    yield settings, tmp_path
    listener.close()


def test_sockets_good_missing_and_not_a_socket(node):
    settings, _ = node
    reg = os.path.join(settings.registry_dir, "sysdra.io-reg.sock")
    found = doctor.check_kubelet(settings)
    assert ("dra-socket", "ok") in levels(found) and ("registration-socket", "fail") in levels(found)
    with open(reg, "w") as f:
        f.write("oops")
    bad = [f for f in doctor.check_kubelet(settings) if f.check == "registration-socket"][0]
    assert bad.level == "fail" and "not a socket (regular file)" in bad.message and "remove" in bad.fix
    os.unlink(reg)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(reg)
    stale.close()
    bad = [f for f in doctor.check_kubelet(settings) if f.check == "registration-socket"][0]
    assert bad.level == "fail" and "stale" in bad.message


def _write(d, name, obj):
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, name)
    with open(path, "w") as f:
        f.write(obj if isinstance(obj, str) else json.dumps(obj))
    return path


def test_cdi_specs(tmp_path):
    d = str(tmp_path / "cdi")
    _write(d, "good.json", finish(GOOD))
    too_new = dict(finish(GOOD), cdiVersion="0.6.0", kind="k8s.sysdra.io/other")
    _write(d, "new.json", too_new)
    annotated = dict(GOOD, kind="k8s.sysdra.io/ann", annotations={"a": "b"}, cdiVersion="0.5.0")
    _write(d, "old.json", annotated)
    _write(d, "broken.json", '{"cdiVersion": "0.5.0", "kind": ')
    _write(d, "schema.json", {"cdiVersion": "0.5.0", "kind": "k8s.sysdra.io/x", "devices": [{"name": "a"}]})
    _write(d, "zdup.json", dict(finish(GOOD)))
    _write(d, "yaml.yaml", "cdiVersion: 0.3.0\nkind: vendor.com/y\ndevices:\n- name: y\n  containerEdits:\n    env: [A=1]\n")
    _write(d, "gone.json", {"cdiVersion": "0.5.0", "kind": "k8s.sysdra.io/gone",
                            "devices": [{"name": "g", "containerEdits": {"deviceNodes": [{"path": "/dev/nope", "hostPath": "/dev/nope"}]}}]})
    by_file = {}
    for f in doctor_files.check_cdi_dirs([d]):
        by_file.setdefault(os.path.basename(f.check.split(":", 1)[1]) if ":" in f.check else f.check, []).append(f)
    lv = {k: sorted({f.level for f in v}) for k, v in by_file.items()}
    assert lv["good.json"] == ["ok"]
    assert lv["yaml.yaml"] == ["ok"]
    assert lv["new.json"] == ["warn"] and "needs only 0.5.0" in by_file["new.json"][0].message
    assert lv["old.json"] == ["fail"] and "below" in by_file["old.json"][0].message
    assert lv["broken.json"] == ["fail"] and "does not parse" in by_file["broken.json"][0].message
    assert lv["schema.json"] == ["fail"] and "schema" in by_file["schema.json"][0].message
    assert "fail" in lv["zdup.json"] and "also defined in" in " ".join(f.message for f in by_file["zdup.json"])
    assert "warn" in lv["gone.json"]


def test_hundreds_of_specs_are_grouped(tmp_path):
    d = str(tmp_path / "cdi")
    for i in range(300):
        _write(d, f"k8s.sysdra.io-claim_{i:04d}.json", dict(finish(GOOD), kind=f"k8s.sysdra.io/c{i}"))
    for i in range(40):
        _write(d, f"gone{i:02d}.json", {"cdiVersion": "0.5.0", "kind": f"k8s.sysdra.io/gone{i}",
                                        "devices": [{"name": "g", "containerEdits": {"deviceNodes": [{"path": "/dev/nope"}]}}]})
    _write(d, "broken.json", "{")
    found = doctor_files.check_cdi_dirs([d])
    assert len(found) < 10, [f.message for f in found]
    valid = [f for f in found if f.level == "ok"]
    assert len(valid) == 1 and valid[0].message.startswith("300 valid specs (k8s.sysdra.io-claim_0000.json")
    gone = [f for f in found if f.level == "warn" and "does not exist" in f.message]
    assert len(gone) == 1 and gone[0].message.startswith("40 specs, e.g. device ") and "gone00.json" in gone[0].message
    assert [f.level for f in found if "broken.json" in f.check] == ["fail"]  # alone: reported as it is


def test_cdi_without_jsonschema(tmp_path, monkeypatch):
    monkeypatch.setattr(doctor_files, "_schema_validator", lambda: None)
    d = str(tmp_path / "cdi")
    _write(d, "schema.json", {"cdiVersion": "0.5.0", "kind": "k8s.sysdra.io/x", "devices": [{"name": "a"}]})
    found = doctor_files.check_cdi_dirs([d])
    assert ("cdi", "warn") in levels(found)  # says jsonschema is missing
    assert any(f.level == "fail" and "containerEdits" in f.message for f in found)


def test_metadata_streams(tmp_path):
    plugin = str(tmp_path)
    obj = {"kind": "DeviceMetadata", "apiVersion": "metadata.resource.k8s.io/v1beta1", "metadata": {"name": "c"}, "requests": []}
    good = _write(os.path.join(plugin, "dra-device-metadata", "ns_c", "req"), "metadata.json",
                  json.dumps(obj) + "\n" + json.dumps(dict(obj, apiVersion="metadata.resource.k8s.io/v1alpha1")) + "\n")
    os.chmod(good, 0o644)
    assert levels(doctor_files.check_metadata(plugin)) == [("metadata", "ok")]
    _write(os.path.join(plugin, "dra-device-metadata", "ns_d", "req"), "metadata.json", json.dumps(obj) + "\n" + json.dumps(obj)[:40])
    found = doctor_files.check_metadata(plugin)
    assert [f.level for f in found] == ["fail"] and "complete JSON stream" in found[0].message


def test_checkpoint(tmp_path):
    from agent.prepare.checkpoint import COMPLETED, STARTED, Checkpoint

    plugin = str(tmp_path)
    assert levels(doctor_files.check_checkpoint(plugin)) == [("checkpoint", "skip")]
    cp = Checkpoint(os.path.join(plugin, "checkpoint.json"))
    dev = {"requests": ["r"], "pool": "p", "device": "d", "cdiDeviceIDs": [], "shareID": None}

    def entry(state, *devices):
        return {"state": state, "namespace": "ns", "name": "c", "devices": list(devices)}

    u1, u2, u3, u4 = (f"0000000{n}-0000-4000-8000-000000000000" for n in range(1, 5))
    cp.claims = {u1: entry(COMPLETED, dev), u2: entry(STARTED)}
    cp.save()
    cp.claims[u3] = entry(COMPLETED)
    cp.save(changed=[u3])
    before = sorted(os.listdir(plugin))
    found = doctor_files.check_checkpoint(plugin)
    assert levels(found) == [("checkpoint", "ok")]
    assert "3 claims recorded (1 being prepared), generation 1, 1 journal records" in found[0].message
    cp.claims["not-a-uid"] = entry(COMPLETED, {})  # checksummed, but no entry we write: not used
    cp.save(changed=["not-a-uid"])
    found = doctor_files.check_checkpoint(plugin)
    assert levels(found) == [("checkpoint", "warn"), ("checkpoint", "ok")] and "not-a-uid" in found[0].message
    del cp.claims["not-a-uid"]
    cp.save(changed=["not-a-uid"])
    cp.claims[u3] = {**entry(COMPLETED), "pods": [u1], "netdevsLost": "the checkpoint was damaged"}  # adopted so
    cp.save(changed=[u3])
    found = doctor_files.check_checkpoint(plugin)
    assert levels(found) == [("checkpoint", "warn"), ("checkpoint", "ok")] and found[0].check == "checkpoint:netdevs-lost"
    assert f"{u3}: the checkpoint was damaged" in found[0].message
    cp.claims[u3] = {**entry(COMPLETED), "futureThing": {"x": 1}}  # a newer sysdra's entry: kept, held, said
    cp.save(changed=[u3])
    found = doctor_files.check_checkpoint(plugin)
    assert levels(found) == [("checkpoint", "warn"), ("checkpoint", "ok")] and found[0].check == "checkpoint:foreign"
    assert f"{u3}: futureThing" in found[0].message and "3 claims recorded" in found[1].message
    cp.claims[u3] = entry(COMPLETED)
    cp.save(changed=[u3])
    with open(cp.journal_path, "r+b") as f:  # a flipped byte in a record that is not the last
        f.seek(cp._journal_size - 20)
        f.write(b"X")
    cp.claims[u4] = entry(COMPLETED)
    cp.save(changed=[u4])
    found = doctor_files.check_checkpoint(plugin)
    assert levels(found) == [("checkpoint", "fail")] and "checksum mismatch" in found[0].message
    assert "CHECKPOINT CORRUPT" in found[0].fix
    assert sorted(os.listdir(plugin)) == before  # doctor never moves or repairs anything
    Checkpoint.load(cp.path)  # what the agent does at start: moves both files aside
    found = doctor_files.check_checkpoint(plugin)
    assert levels(found) == [("checkpoint", "warn"), ("checkpoint", "skip")] and found[0].check == "checkpoint:aside"
    assert "checkpoint.json.corrupt-" in found[0].message and "checkpoint.json.journal.corrupt-" in found[0].message
    with open(cp.path, "w") as f:
        json.dump({"version": 9, "claims": {}}, f)
    assert ("checkpoint", "fail") in levels(doctor_files.check_checkpoint(plugin))


def test_registration_from_status_socket(tmp_path):
    b = StatusBoard("node-a", "sysdra.io")
    path = str(tmp_path / "status.sock")
    b.set_registration("waiting")
    with _Serving(b, path):
        assert levels(doctor.check_registration(path)) == [("registration", "warn")]
        b.set_registration("registered")
        assert levels(doctor.check_registration(path)) == [("registration", "ok")]
        b.record_error("publish", "API error 403")
        assert levels(doctor.check_registration(path)) == [("registration", "ok"), ("agent", "warn")]
    assert levels(doctor.check_registration(path)) == [("registration", "fail")]


def bound_to(*nodes, username="system:serviceaccount:sysdra:sysdra"):
    return lambda: {"username": username, "extra": {doctor.NODE_NAME_EXTRA: list(nodes)} if nodes else {}}


@pytest.mark.parametrize("user,why", [
    (bound_to(), "bound to no node"),
    (bound_to("node-b"), "bound to node node-b, not to this node node-a"),
    (bound_to("node-a", "node-b"), "bound to node node-a, node-b"),  # the server wants exactly one
    (bound_to("node-a", username="system:node:node-a"), "system:node:node-a is not a ServiceAccount"),
    (lambda: {}, "(anonymous) is not a ServiceAccount"),
])  # fmt: skip
def test_identity_not_bound_to_this_node_fails_and_says_what_breaks(user, why):
    """The cases the real server cannot give us (tests/test_apiserver_rbac.py has the token kinds)."""
    found = doctor.check_identity(user(), "node-a")
    assert found.level == "fail" and why in found.message, found
    assert "claim status writes" in found.message and "--bound-object-name node-a" in found.fix
    assert doctor.check_identity(bound_to("node-a")(), "node-a").level == "ok"


def test_identity_question_failing_is_a_warning_and_the_rest_is_checked():
    def refused():
        raise PermissionError("selfsubjectreviews is forbidden")

    found = doctor.check_api("kube", "node-a", lambda *a: (True, None), whoami=refused)
    assert levels(found) == [("api", "ok"), ("rbac", "ok"), ("identity", "warn"), ("clock", "skip")]
    assert "selfsubjectreviews is forbidden" in found[2].message


def test_api_permissions_and_clock():
    now = 1_800_000_000.0
    date = email.utils.formatdate(now, usegmt=True)
    calls = []

    def review(verb, group, resource, name):
        calls.append((verb, resource, name))
        return (verb != "delete"), date

    found = doctor.check_api("kube", "node-a", review, now=lambda: now + 1, whoami=bound_to("node-a"))
    assert levels(found) == [("api", "ok"), ("rbac", "fail"), ("identity", "ok"), ("clock", "ok")]
    assert "delete resourceslices" in found[1].message
    assert ("get", "nodes", "node-a") in calls
    skewed = doctor.check_api("kube", "node-a", lambda *a: (True, date), now=lambda: now + 60, whoami=bound_to("node-a"))
    assert levels(skewed) == [("api", "ok"), ("rbac", "ok"), ("identity", "ok"), ("clock", "fail")]
    assert doctor.check_api("dir:/x", "node-a")[0].level == "skip"

    def unreachable(*a):
        raise ConnectionRefusedError("refused")

    assert levels(doctor.check_api("kube", "n", unreachable)) == [("api", "fail")]
    # nvidia_mps_pod: the daemons' pods in their namespace
    pods = []

    def no_pod_delete(verb, group, resource, name, namespace=None):
        pods.append((verb, resource, namespace)) if resource == "pods" else None
        return not (resource == "pods" and verb == "delete"), date

    found = doctor.check_api("kube", "node-a", no_pod_delete, now=lambda: now, mps_namespace="gpu-system",
                             whoami=bound_to("node-a"))
    assert levels(found) == [("api", "ok"), ("rbac", "ok"), ("identity", "ok"), ("rbac-mps", "fail"), ("clock", "ok")]
    assert "gpu-system, not allowed: delete pods" in found[3].message
    assert pods == [(v, "pods", "gpu-system") for v in ("get", "list", "create", "delete")]


def test_cli_exit_codes(node, capsys):
    settings, tmp = node
    args = ["doctor", "--kubelet-dir", settings.kubelet_dir, "--cdi-dir", str(tmp / "cdi"), "--cluster", settings.cluster]
    os.makedirs(tmp / "cdi")
    _write(str(tmp / "cdi"), "good.json", finish(GOOD))
    reg = os.path.join(settings.registry_dir, "sysdra.io-reg.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(reg)
    listener.listen(1)
    b = StatusBoard("node-a", "sysdra.io")
    b.set_registration("registered")
    try:
        with _Serving(b, os.path.join(settings.plugin_dir, "status.sock")):
            assert cli_main(args) == 0, capsys.readouterr().out
            out = capsys.readouterr().out
            assert "0 problem(s)" in out
            _write(str(tmp / "cdi"), "broken.json", "{")
            assert cli_main(args) == 1
            out = capsys.readouterr().out
            assert "[FAIL] cdi:" in out and "fix:" in out
    finally:
        listener.close()


def test_a_config_sysdra_run_refuses_is_a_failed_config_check(tmp_path, capsys):
    """The share policies and their combinations are judged as `sysdra run` judges them (exit 78 there)."""
    config = tmp_path / "config.yaml"
    config.write_text("share: [gpu]\npartitions: true\n")
    assert cli_main(["doctor", "--config", str(config), "--kubelet-dir", str(tmp_path / "kubelet"),
                     "--cluster", f"dir:{tmp_path / 'cluster'}"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] config:" in out and "gpu cannot be combined with partitions" in out


def test_a_checkpoint_aside_whose_name_holds_no_time_is_still_named():
    """Any file may be in the plugin dir: a name whose suffix is no Unix time (a digit int() does
    not take, one past any time) is named without a time, never a crash of the doctor."""
    import tempfile

    from agent.tools.doctor_files import _checkpoint_aside

    for suffix, when in (("1700000000", "20"), ("\u00b2", "?"), ("9" * 40, "?")):
        with tempfile.TemporaryDirectory() as d:
            open(os.path.join(d, f"checkpoint.json.rejected-{suffix}"), "w").close()
            (found,) = _checkpoint_aside(d)
            assert found.check == "checkpoint:aside" and f"(last at {when}" in found.message


def test_files_nested_too_deep_to_parse_are_failed_checks_not_a_crash(tmp_path):
    """CDI specs (any tool's) and metadata files nested too deep: doctor raised RecursionError
    and checked nothing more."""
    d = str(tmp_path / "cdi")
    _write(d, "deep.json", "[" * 100000)
    _write(d, "deep.yaml", "[" * 100000)
    _write(d, "good.json", finish(GOOD))
    found = doctor_files.check_cdi_dirs([d])
    assert {os.path.basename(f.check): (f.level, f.message) for f in found if os.path.basename(f.check).startswith("deep")} == {
        "deep.json": ("fail", "does not parse: nested too deep"), "deep.yaml": ("fail", "does not parse: nested too deep")}
    assert any(f.level == "ok" and "good.json" in f.check for f in found)
    _write(os.path.join(str(tmp_path), "dra-device-metadata", "ns_c", "req"), "metadata.json", "[" * 100000)
    found = doctor_files.check_metadata(str(tmp_path))
    assert [(f.level, f.message) for f in found] == [("fail", "not a complete JSON stream: nested too deep")]
