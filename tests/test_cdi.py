"""CDI specs: minimum cdiVersion, strict validation, schema conformance of our claim specs."""

from __future__ import annotations

import json
import os

import pytest

from agent.prepare import cdifiles
from cdi.claim import ClaimDevice, build_claim_spec, host_path
from cdi.spec import SpecError, minimum_version, validate
from tests.conftest import REPO
from tests.kubelet_standin import gpu, nic

SCHEMAS = os.path.join(REPO, "cdi", "schema")  # the vendored copy (cdi/schema/README.md)


def _dev(name="dev", **edits):
    return {"name": name, "containerEdits": edits or {"env": ["A=1"]}}


def _spec(devices=None, kind="example.com/claim", **top):
    return {"kind": kind, "devices": devices or [_dev()], **top}


@pytest.mark.parametrize("spec,expected", [
    (_spec(), "0.3.0"),
    (_spec([_dev(mounts=[{"hostPath": "/a", "containerPath": "/b", "type": "bind"}])]), "0.4.0"),
    (_spec([_dev(mounts=[{"hostPath": "/a", "containerPath": "/b"}])]), "0.3.0"),
    (_spec([_dev("0abc")]), "0.5.0"),
    (_spec([_dev(deviceNodes=[{"path": "/dev/x", "hostPath": "/root/dev/x"}])]), "0.5.0"),
    (_spec(containerEdits={"deviceNodes": [{"path": "/dev/x", "hostPath": "/r/dev/x"}]}), "0.5.0"),
    (_spec(annotations={"a": "b"}), "0.6.0"),
    (_spec([{"name": "d", "annotations": {"a": "b"}, "containerEdits": {"env": ["A=1"]}}]), "0.6.0"),
    (_spec(kind="example.com/cl.aim"), "0.6.0"),
    (_spec([_dev(additionalGids=[44])]), "0.7.0"),
    (_spec([_dev(additionalGids=[])]), "0.3.0"),
    (_spec(containerEdits={"intelRdt": {"closID": "x"}}), "0.7.0"),
    (_spec(containerEdits={"intelRdt": {"schemata": []}}), "1.1.0"),
    (_spec(containerEdits={"intelRdt": {"enableMonitoring": True}}), "1.1.0"),
    (_spec([_dev(netDevices=[{"hostInterfaceName": "eth1", "name": "net1"}])]), "1.1.0"),
])
def test_minimum_version(spec, expected):
    assert minimum_version(spec) == expected


def test_claim_spec_versions_follow_content():
    letter_uid = "a" + "0" * 7 + "-0000-4000-8000-000000000000"
    digit_uid = "1" + "0" * 7 + "-0000-4000-8000-000000000000"
    assert build_claim_spec("sysdra.io", letter_uid, [gpu(0)])["cdiVersion"] == "0.3.0"
    assert build_claim_spec("sysdra.io", digit_uid, [gpu(0)])["cdiVersion"] == "0.5.0"
    # the DaemonSet's --root=/host is the agent's view: the runtime on the host is given the
    # host's path (none needed), so it stats the node and keeps its mode (found on the real node)
    rooted = build_claim_spec("sysdra.io", letter_uid, [gpu(0, root="/host")], root="/host")
    assert rooted["cdiVersion"] == "0.3.0"
    assert rooted["devices"][0]["containerEdits"]["deviceNodes"][0] == {
        "path": "/dev/dri/renderD128", "type": "c", "major": 226, "minor": 128}


def test_claim_spec_follows_a_rescanned_device_and_the_root():
    """A device's nodes are built once per device object: a rescan's new object (new numbers after
    a reboot, a driver reload) and another root are seen, and no spec shares another's dicts."""
    uid = "a" + "0" * 7 + "-0000-4000-8000-000000000000"
    nodes = lambda spec: spec["devices"][0]["containerEdits"]["deviceNodes"]
    first = build_claim_spec("sysdra.io", uid, [gpu(0, minor=128)])
    assert nodes(first)[0]["minor"] == 128
    assert nodes(build_claim_spec("sysdra.io", uid, [gpu(0, minor=140)]))[0]["minor"] == 140
    dev = gpu(0, root="/host")
    assert "hostPath" not in nodes(build_claim_spec("sysdra.io", uid, [dev], root="/host"))[0]
    assert nodes(build_claim_spec("sysdra.io", uid, [dev]))[0]["hostPath"] == "/host/dev/dri/renderD128"
    again = build_claim_spec("sysdra.io", uid, [dev], root="/host")
    nodes(again)[0]["minor"] = 0
    assert nodes(build_claim_spec("sysdra.io", uid, [dev], root="/host"))[0]["minor"] == 128


@pytest.mark.parametrize("root", ["/", "/host", "/host/", "//host", "/tmp/x/../host", "/ho"])
def test_host_path_is_the_path_relative_to_the_root(root):
    """``host_path`` answers as ``os.path.relpath`` does (its former body), without its cost."""
    def reference(path: str) -> str:
        rel = os.path.relpath(path, root)
        return path if rel == ".." or rel.startswith("../") else "/" + rel
    for path in ["/host/dev/nvidia0", "/host", "/host/", "/hostx/dev/a", "/dev/dri/card0", "/", "/host/../dev/x",
                 "//host//dev/./a", "/ho/dev/a", "/tmp/host/dev/a"]:
        assert host_path(path, root) == reference(path), (path, root)


def test_claim_spec_layout_and_env():
    uid = "5d0c6cb4-9f8f-4d3b-a1c3-7b6f0c3a0d11"
    spec = build_claim_spec("sysdra.io", uid, [gpu(0), gpu(1), nic(0, "ens1f0")])
    assert spec["kind"] == "k8s.sysdra.io/claim"
    assert [d["name"] for d in spec["devices"]] == [
        f"{uid}-gpu-0000-1b-00-0", f"{uid}-gpu-0000-1c-00-0", f"{uid}-nic-0000-40-00-0"]
    assert spec["containerEdits"]["env"] == [
        f"SYSDRA_CLAIM_UID={uid}",
        "SYSDRA_DEVICES=gpu-0000-1b-00-0,gpu-0000-1c-00-0,nic-0000-40-00-0",
        "SYSDRA_GPU_PCI_BUS_IDS=0000:1b:00.0,0000:1c:00.0",
        "SYSDRA_NIC_PCI_BUS_IDS=0000:40:00.0",
        "SYSDRA_NIC_INTERFACES=ens1f0",
    ]
    keys = [e.split("=", 1)[0] for d in spec["devices"] for e in d["containerEdits"]["env"]]
    keys += [e.split("=", 1)[0] for e in spec["containerEdits"]["env"]]
    assert len(keys) == len(set(keys)), "duplicate env keys within one claim"
    assert "deviceNodes" not in spec["devices"][2]["containerEdits"]  # NIC: env only, still non-empty


def test_devices_of_a_claim_never_set_one_variable_or_mount_differently():
    """One container may be given all of a claim's CDI devices, and the runtime keeps one of two
    values: two devices of the claim may set one variable (or mount one path) only alike."""
    uid = "5d0c6cb4-9f8f-4d3b-a1c3-7b6f0c3a0d11"
    a, b = gpu(0), gpu(1)
    pipe = {"hostPath": "/mps/a", "containerPath": "/tmp/nvidia-mps"}
    alike = [ClaimDevice(a, "a", ("LIMIT=1",), (pipe,)), ClaimDevice(b, "b", ("LIMIT=1",), (pipe,))]
    assert len(build_claim_spec("sysdra.io", uid, alike)["devices"]) == 2
    with pytest.raises(SpecError, match="set LIMIT to different values"):
        build_claim_spec("sysdra.io", uid, [ClaimDevice(a, "a", ("LIMIT=1",)), ClaimDevice(b, "b", ("LIMIT=2",))])
    with pytest.raises(SpecError, match="mount different things at /tmp/nvidia-mps"):
        build_claim_spec("sysdra.io", uid, [ClaimDevice(a, "a", mounts=(pipe,)),
                                            ClaimDevice(b, "b", mounts=(dict(pipe, hostPath="/mps/b"),))])
    with pytest.raises(SpecError, match="set twice"):  # a device's own and the claim-wide edits
        build_claim_spec("sysdra.io", uid, [ClaimDevice(a, "a", ("SYSDRA_DEVICES=x",))])


@pytest.mark.parametrize("bad,msg", [
    ({"cdiVersion": "0.3.0", "kind": "a.com/c", "devices": []}, "no devices"),
    ({"cdiVersion": "0.3.0", "kind": "a.com/c", "devices": [{"name": "d", "containerEdits": {}}]}, "empty device edits"),
    ({"cdiVersion": "0.3.0", "kind": "a.com/c", "devices": [_dev("0d")]}, "below the 0.5.0"),
    ({"cdiVersion": "9.9.9", "kind": "a.com/c", "devices": [_dev()]}, "unknown cdiVersion"),
    ({"cdiVersion": "0.3.0", "kind": "1a.com/c", "devices": [_dev()]}, "invalid kind"),
    ({"cdiVersion": "0.3.0", "kind": "a.com/c", "devices": [_dev("-x")]}, "invalid device name"),
    ({"cdiVersion": "0.3.0", "kind": "a.com/c", "devices": [_dev(), _dev()]}, "duplicate"),
    ({"cdiVersion": "0.3.0", "kind": "a.com/c", "devices": [_dev(env=["=x"])]}, "NAME=value"),
    ({"cdiVersion": "0.3.0", "kind": "a.com/c", "devices": [_dev(deviceNodes=[{"path": "/d", "bogus": 1}])]}, "unknown field"),
    ({"cdiVersion": "0.3.0", "kind": "a.com/c", "devices": [_dev()], "extra": 1}, "unknown field"),
    # JSON of another type than the runtime's Go field: TypeError here, or taken for valid
    ({"cdiVersion": "0.3.0", "kind": "a.com/c", "devices": [_dev(deviceNodes=5)]}, r"deviceNodes: must be a list"),
    ({"cdiVersion": "0.3.0", "kind": "a.com/c", "devices": [_dev(mounts=True)]}, r"mounts: must be a list"),
    ({"cdiVersion": "0.3.0", "kind": "a.com/c", "devices": [_dev(hooks=[{"hookName": [], "path": "/x"}])]},
     r"hookName: must be a string"),
    ({"cdiVersion": "0.3.0", "kind": "a.com/c", "devices": [_dev(deviceNodes=[{"path": "/d", "permissions": 7}])]},
     r"permissions: must be a string"),
    ({"cdiVersion": "0.3.0", "kind": "a.com/c", "devices": [_dev(deviceNodes=[{"path": 5}])]}, r"path: must be a string"),
    ({"cdiVersion": "0.3.0", "kind": "a.com/c", "devices": [_dev(mounts=[{"hostPath": 1, "containerPath": "/b"}])]},
     r"hostPath: must be a string"),
    ({"cdiVersion": "0.3.0", "kind": "a.com/c", "devices": [_dev(deviceNodes=[{"path": "/d", "major": "1"}])]},
     r"major: must be an integer"),
    ({"cdiVersion": "0.6.0", "kind": "a.com/c", "devices": [_dev()], "annotations": {"a": 1}}, r"annotations: must be an object of strings"),
    ({"cdiVersion": "1.1.0", "kind": "a.com/c", "devices": [_dev(intelRdt=5)]}, r"intelRdt: must be an object"),
])
def test_validate_rejects_what_runtimes_reject(bad, msg):
    with pytest.raises(SpecError, match=msg):
        validate(bad)


def _schema_validator():
    import jsonschema
    schema_path = os.path.join(SCHEMAS, "schema.json")
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT7

    schema = json.load(open(schema_path))
    defs = json.load(open(os.path.join(SCHEMAS, "defs.json")))
    # schema.json refers to "defs.json" by its upstream name
    registry = Registry().with_resource("defs.json", Resource.from_contents(defs, default_specification=DRAFT7))
    return jsonschema.Draft7Validator(schema, registry=registry)


def test_claim_specs_match_cdi_schema(tmp_path):
    validator = _schema_validator()
    uid = "5d0c6cb4-9f8f-4d3b-a1c3-7b6f0c3a0d11"
    for spec in (build_claim_spec("sysdra.io", uid, [gpu(0), nic(0)]),
                 build_claim_spec("sysdra.io", uid, [gpu(0, root="/host")], root="/host")):
        path = cdifiles.claim_spec_path(str(tmp_path), "sysdra.io", uid)
        cdifiles.write_spec(path, spec)
        assert os.stat(path).st_mode & 0o777 == 0o644
        on_disk = cdifiles.read_spec(path)
        errors = sorted(validator.iter_errors(on_disk), key=str)
        assert not errors, errors
    # the validator does catch a broken spec (guards against a vacuous schema setup)
    assert list(validator.iter_errors({"cdiVersion": "0.3.0", "kind": "a/b", "devices": "nope"}))


def test_files_list_only_ours(tmp_path):
    d = str(tmp_path)
    for name in ("k8s.sysdra.io-claim_u1.json", "k8s.sysdra.io-claim_u2.json", "other.com-claim_u3.json",
                 "k8s.sysdra.io-claim_u4.yaml", ".k8s.sysdra.io-claim_u5.json.abc.tmp", ".other.tmp",
                 "k8s.sysdra.io-claim_u 6.json"):  # not a UID: no claim of ours
        open(os.path.join(d, name), "w").close()
    assert sorted(cdifiles.list_claim_specs(d, "sysdra.io")) == ["u1", "u2"]
    assert cdifiles.clean_our_temps(d, "sysdra.io") == 1
    assert os.path.exists(os.path.join(d, ".other.tmp"))


def test_a_recorded_path_is_ours_only_directly_in_the_cdi_dir_with_our_prefix(tmp_path):
    # checkpoint paths are untrusted: only our claim and metadata specs in the CDI dir may be removed
    d = str(tmp_path / "cdi")
    ours = cdifiles.claim_spec_path(d, "sysdra.io", "u1")
    assert cdifiles.is_ours(d, "sysdra.io", ours) and cdifiles.is_ours(d + "/", "sysdra.io", ours)
    assert cdifiles.is_ours(d, "sysdra.io", f"{d}/sysdra.io_metadata_u1_r.json")
    for path in (f"{tmp_path}/k8s.sysdra.io-claim_u1.json", f"{d}/sub/k8s.sysdra.io-claim_u1.json",
                 f"{d}/../k8s.sysdra.io-claim_u1.json", f"{d}/other.com-claim_u1.json",
                 f"{d}/k8s.sysdra.io-claim_u1.yaml", f"{d}/k8s.sysdra.io-claim_u\x00.json", 5, None):
        assert not cdifiles.is_ours(d, "sysdra.io", path), path
    with pytest.raises(ValueError):  # a UID with a separator never makes a path outside the dir
        cdifiles.claim_spec_path(d, "sysdra.io", "../u1")
    # with the claim's UID: its own files only, never another claim's
    assert cdifiles.is_ours(d, "sysdra.io", ours, "u1") and cdifiles.is_ours(d, "sysdra.io", f"{d}/sysdra.io_metadata_u1_r.json", "u1")
    assert not cdifiles.is_ours(d, "sysdra.io", ours, "u2") and not cdifiles.is_ours(d, "sysdra.io", ours, "u")
    assert not cdifiles.is_ours(d, "sysdra.io", f"{d}/sysdra.io_metadata_u1_r.json", "u2")


def test_a_spec_file_that_is_json_but_no_valid_spec_is_unreadable(tmp_path):
    # (ensure_spec then rewrites it): parsing alone is not enough
    path = tmp_path / "k8s.sysdra.io-claim_u1.json"
    # (a SpecError, also where the shape is wrong: it was an AttributeError ensure_spec did not catch)
    for devices in ("x", [{"name": "d", "containerEdits": "x"}], ["x"]):
        path.write_text(json.dumps({"cdiVersion": "0.5.0", "kind": "k8s.sysdra.io/claim", "devices": devices}))
        with pytest.raises(SpecError, match=str(path)):
            cdifiles.read_spec(str(path))
