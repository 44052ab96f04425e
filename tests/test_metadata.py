"""KEP-5304 device metadata: stream decoding, files and CDI specs on prepare, deferred
updates, generation across rewrites and reboots, atomicity, cleanup and orphans."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from agent.cli.main import main as cli
from agent.kubeletplugin.types import ClaimRef
from agent.prepare import cdifiles
from agent.prepare.driver import Driver
from agent.prepare.metadata import decode, read_file
from agent.prepare.metadata import layout
from agent.prepare.metadata.stream import MetadataError
from agent.prepare.metadata.update import NetworkData, UpdateError, update_request
from discovery.models import AttributeValue, NetInterface, NicInfo
from tests.conftest import REPO
from tests.kubelet_standin import DRIVER, claim, gpu, inventory, nic
from tests.test_checkpoint import make_env

GPU0, NIC0 = "gpu-0000-1b-00-0", "nic-0000-40-00-0"
# a shortened rendering of upstream's KEP-5304 testdata/HEAD/metadata.json (tests/data/README.md)
EXAMPLE = os.path.join(REPO, "tests", "data", "kep5304-metadata-example.json")


class Crash(BaseException):
    pass


def env(tmp_path, **kw):
    s, state = make_env(tmp_path, **kw)
    g = gpu(0, root=s.root).replace(attributes={
        "model": AttributeValue(string="MI210"), "resource.kubernetes.io/pciBusID": AttributeValue(string="0000:1b:00.0")})
    n = nic(0, "ens9f0").replace(nic=NicInfo(interfaces=(NetInterface(name="ens9f0", mac="0c:42:a1:00:00:01"),)))
    state["inv"] = inventory(g, gpu(1, root=s.root), n, root=s.root)
    return s, state


def prepared(s, state, c):
    d = Driver(s, lambda: state["inv"])
    d.recover()
    res = d.prepare_claims([c])[c["metadata"]["uid"]]
    assert res.error is None, res.error
    return d, res


def host(s, c, request):
    return layout.host_file(s.plugin_dir, c["metadata"]["namespace"], c["metadata"]["name"], request)


def reboot(s, boot):
    for p in os.listdir(s.cdi_dir):
        os.unlink(os.path.join(s.cdi_dir, p))
    with open(os.path.join(s.root, "proc/sys/kernel/random/boot_id"), "w") as f:
        f.write(boot + "\n")


# --- the stream ---------------------------------------------------------------------
def test_reader_takes_first_understood_version():
    data = open(EXAMPLE).read()
    assert decode(data)["apiVersion"] == "metadata.resource.k8s.io/v1beta1"
    assert decode(data, understood=["metadata.resource.k8s.io/v1alpha1"])["requests"][0]["devices"][0] == {
        "driver": "gpu.example.com", "pool": "worker-0", "name": "gpu-0"}
    future = json.dumps({"kind": "DeviceMetadata", "apiVersion": "metadata.resource.k8s.io/v2", "whatever": [1]})
    assert decode(future + "\n" + data)["metadata"]["generation"] == 7  # unknown version skipped
    with pytest.raises(MetadataError, match="no DeviceMetadata of a known version"):
        decode(future)
    with pytest.raises(MetadataError, match="requests is malformed"):  # a broken known object is an error
        decode(json.dumps({"kind": "DeviceMetadata", "apiVersion": "metadata.resource.k8s.io/v1beta1",
                           "metadata": {}, "requests": {"x": 1}}) + data)
    with pytest.raises(MetadataError, match="not a JSON stream"):
        decode(data[:40])  # a cut first object (a cut later one is never reached)


# --- prepare ------------------------------------------------------------------------
def test_prepare_writes_stream_spec_and_appends_id_to_first_device(tmp_path):
    s, state = env(tmp_path)
    c = claim("c", [("gpus/big", GPU0), ("gpus/big", "gpu-0000-1c-00-0"), ("net", NIC0)])
    c["metadata"]["annotations"] = {"resource.kubernetes.io/pod-claim-name": "my-gpus"}
    uid = c["metadata"]["uid"]
    _, res = prepared(s, state, c)
    ids = [d.cdi_ids for d in res.devices]
    assert ids[0][1:] == [f"{DRIVER}/metadata={uid}_gpus"] and len(ids[1]) == 1
    assert ids[2][1:] == [f"{DRIVER}/metadata={uid}_net"]

    path = host(s, c, "gpus")
    assert path == os.path.join(s.kubelet_dir, "plugins", DRIVER, "dra-device-metadata", "default_c", "gpus", "metadata.json")
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"
    text = open(path).read()
    objs = [json.loads(p) for p in text.replace("}\n{", "}\n\x00{").split("\x00")]
    assert [o["apiVersion"] for o in objs] == ["metadata.resource.k8s.io/v1beta1", "metadata.resource.k8s.io/v1alpha1"]
    assert objs[0] == {**objs[1], "apiVersion": objs[0]["apiVersion"]}
    obj = objs[0]
    assert obj["metadata"] == {"name": "c", "namespace": "default", "uid": uid, "generation": 1}
    assert obj["podClaimName"] == "my-gpus"
    assert obj["requests"] == [{"name": "gpus/big", "devices": [
        {"driver": DRIVER, "pool": "node-1", "name": GPU0,
         "attributes": {"model": {"string": "MI210"}, "resource.kubernetes.io/pciBusID": {"string": "0000:1b:00.0"}}},
        {"driver": DRIVER, "pool": "node-1", "name": "gpu-0000-1c-00-0"}]}]
    net = read_file(host(s, c, "net"))["requests"][0]["devices"][0]
    assert net["networkData"] == {"interfaceName": "ens9f0", "hardwareAddress": "0c:42:a1:00:00:01"}

    spec = cdifiles.read_spec(layout.spec_path(s.cdi_dir, DRIVER, uid, "gpus"))
    assert os.path.basename(layout.spec_path(s.cdi_dir, DRIVER, uid, "gpus")) == f"{DRIVER}_metadata_{uid}_gpus.json"
    assert spec["kind"] == f"{DRIVER}/metadata"
    assert spec["devices"] == [{"name": f"{uid}_gpus", "containerEdits": {"mounts": [{
        "hostPath": path, "options": ["ro", "bind"],
        "containerPath": f"/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/my-gpus/gpus/{DRIVER}-metadata.json"}]}}]


def test_direct_claim_path_and_metadata_off(tmp_path):
    s, state = env(tmp_path)
    c = claim("direct", [("r", GPU0)])
    prepared(s, state, c)
    spec = cdifiles.read_spec(layout.spec_path(s.cdi_dir, DRIVER, c["metadata"]["uid"], "r"))
    assert spec["devices"][0]["containerEdits"]["mounts"][0]["containerPath"] == (
        f"/var/run/kubernetes.io/dra-device-attributes/resourceclaims/direct/r/{DRIVER}-metadata.json")
    s2, state2 = env(tmp_path / "off", device_metadata=False)
    c2 = claim("c", [("r", GPU0)])
    _, res = prepared(s2, state2, c2)
    assert len(res.devices[0].cdi_ids) == 1 and layout.list_specs(s2.cdi_dir, DRIVER) == {}
    assert not os.path.exists(layout.host_root(s2.plugin_dir))


# --- generation ---------------------------------------------------------------------
def test_generation_monotonic_across_update_lost_file_and_reboot(tmp_path):
    s, state = env(tmp_path)
    c = claim("c", [("net", NIC0)])
    uid, path = c["metadata"]["uid"], host(s, c, "net")
    d, _ = prepared(s, state, c)
    ref = ClaimRef("default", "c", uid)
    gen, where = update_request(s, ref, "net", NetworkData("eth1", ["192.0.2.5/24", "2001:db8::5/64"]))
    assert (gen, where) == (2, path)
    dev = read_file(path)["requests"][0]["devices"][0]
    assert dev["networkData"] == {"interfaceName": "eth1", "ips": ["192.0.2.5/24", "2001:db8::5/64"],
                                  "hardwareAddress": "0c:42:a1:00:00:01"}
    # the running agent picks the update up before its next call instead of saving over it
    other = claim("other", [("r", GPU0)])
    assert d.prepare_claims([other])[other["metadata"]["uid"]].error is None
    assert d.checkpoint.claims[uid]["metadata"]["requests"]["net"]["generation"] == 2
    # a lost file (no reboot) is restored with the recorded data, generation + 1
    os.unlink(path)
    d2 = Driver(s, lambda: state["inv"])
    assert uid in d2.recover().metadata_rebuilt
    assert read_file(path)["metadata"]["generation"] == 3
    assert read_file(path)["requests"][0]["devices"][0]["networkData"]["ips"] == ["192.0.2.5/24", "2001:db8::5/64"]
    # reboot: CDI dir emptied, new boot ID -> specs and files regenerated from the inventory, generation 4
    reboot(s, "boot-2")
    report = Driver(s, lambda: state["inv"]).recover()
    assert uid in report.metadata_rebuilt and report.boot_changed
    obj = read_file(path)
    assert obj["metadata"]["generation"] == 4
    assert "ips" not in obj["requests"][0]["devices"][0]["networkData"]  # those IPs belonged to the old sandbox
    assert cdifiles.read_spec(layout.spec_path(s.cdi_dir, DRIVER, uid, "net"))["devices"][0]["name"] == f"{uid}_net"
    # and again on the next reboot
    reboot(s, "boot-3")
    d3 = Driver(s, lambda: state["inv"])
    d3.recover()
    assert read_file(path)["metadata"]["generation"] == 5


def test_a_reprepare_with_another_allocation_keeps_counting(tmp_path):
    """The claim deallocated and allocated again (same UID, another device): the earlier
    prepare is undone, its files removed, and the new file's generation continues from the
    last one written, so a consumer comparing generations never sees one go back."""
    s, state = env(tmp_path)
    c = claim("c", [("net", NIC0)])
    uid, path = c["metadata"]["uid"], host(s, c, "net")
    d, _ = prepared(s, state, c)
    assert update_request(s, ClaimRef("default", "c", uid), "net", NetworkData("eth1"))[0] == 2
    again = claim("c", [("net", GPU0)], uid=uid)
    assert d.prepare_claims([again])[uid].error is None
    obj = read_file(path)
    assert obj["metadata"]["generation"] == 3 and obj["requests"][0]["devices"][0]["name"] == GPU0
    assert d.checkpoint.claims[uid]["metadata"]["requests"]["net"]["generation"] == 3


def test_update_errors(tmp_path, capsys):
    s, state = env(tmp_path)
    c = claim("c", [("net", NIC0)])
    prepared(s, state, c)
    ref = ClaimRef("default", "c", c["metadata"]["uid"])
    with pytest.raises(UpdateError, match="request not found in prepared claim"):
        update_request(s, ref, "nope", NetworkData("eth1"))
    with pytest.raises(UpdateError, match="request not found in prepared claim"):
        update_request(s, ClaimRef("default", "c", "00000000-0000-4000-8000-000000000000"), "net", NetworkData())
    with pytest.raises(UpdateError, match="CIDR"):
        update_request(s, ref, "net", NetworkData(ips=["192.0.2.5"]))
    with pytest.raises(UpdateError, match="CIDR"):  # no form of it passes the server's check: its status write would be a 422
        update_request(s, ref, "net", NetworkData(ips=["::ffff:1.2.3.4/64"]))
    with pytest.raises(UpdateError, match="not in request"):
        update_request(s, ref, "net", NetworkData(), device="gpu-x")
    assert read_file(host(s, c, "net"))["metadata"]["generation"] == 1
    args = ["metadata", "update", "--kubelet-dir", s.kubelet_dir, "--driver-name", DRIVER, "--namespace", "default",
            "--claim", "c", "--uid", c["metadata"]["uid"], "--request", "net", "--interface-name", "net1",
            "--ip", "10.0.0.7/16", "--config", os.devnull]
    assert cli(args) == 0 and capsys.readouterr().out.endswith("generation 2\n")
    assert cli(["metadata", "show", host(s, c, "net")]) == 0
    assert json.loads(capsys.readouterr().out)["requests"][0]["devices"][0]["networkData"]["interfaceName"] == "net1"
    assert cli(args[:-6] + ["--request", "zzz", "--config", os.devnull]) == 1
    assert "request not found in prepared claim" in capsys.readouterr().err


# --- atomicity, cleanup, recovery ---------------------------------------------------
def test_crash_between_temp_write_and_rename_keeps_old_file(tmp_path, monkeypatch):
    s, state = env(tmp_path)
    c = claim("c", [("net", NIC0)])
    prepared(s, state, c)
    path = host(s, c, "net")
    before = open(path, "rb").read()

    def crash(src, dst):
        raise Crash("SIGKILL")
    monkeypatch.setattr(os, "rename", crash)
    with pytest.raises(Crash):
        update_request(s, ClaimRef("default", "c", c["metadata"]["uid"]), "net", NetworkData("eth9"))
    monkeypatch.undo()
    assert open(path, "rb").read() == before  # never a partial file
    assert [n for n in os.listdir(os.path.dirname(path)) if n.endswith(".tmp")]  # the temp a SIGKILL leaves
    Driver(s, lambda: state["inv"]).recover()
    assert os.listdir(os.path.dirname(path)) == ["metadata.json"]


def test_unprepare_removes_dir_and_specs_orphans_removed_at_start(tmp_path):
    s, state = env(tmp_path)
    c = claim("c", [("a", GPU0), ("b", NIC0)])
    keep = claim("keep", [("r", "gpu-0000-1c-00-0")])
    d, _ = prepared(s, state, c)
    d.prepare_claims([keep])
    uid = c["metadata"]["uid"]
    assert sorted(os.path.basename(p) for p in layout.list_specs(s.cdi_dir, DRIVER)[uid]) == [
        f"{DRIVER}_metadata_{uid}_a.json", f"{DRIVER}_metadata_{uid}_b.json"]
    assert d.unprepare_claims([ClaimRef("default", "c", uid)]) == {uid: None}
    assert not os.path.exists(layout.claim_dir(s.plugin_dir, "default", "c")) and uid not in layout.list_specs(s.cdi_dir, DRIVER)
    # leftovers of a crash: a spec and a directory of a claim the checkpoint does not know
    ghost = "0a0a0a0a-0000-4000-8000-000000000000"
    with open(layout.spec_path(s.cdi_dir, DRIVER, ghost, "r"), "w") as f:
        f.write("{}")
    os.makedirs(os.path.join(layout.claim_dir(s.plugin_dir, "default", "ghost"), "r"))
    report = Driver(s, lambda: state["inv"]).recover()
    assert len(report.metadata_orphans_removed) == 2
    assert list(layout.list_specs(s.cdi_dir, DRIVER)) == [keep["metadata"]["uid"]]
    assert os.listdir(layout.host_root(s.plugin_dir)) == ["default_keep"]


def test_unprepare_removes_leftovers_and_never_follows_links(tmp_path):
    """Unprepare removes what prepare wrote by name; anything else in the directory (a crash's
    temp file, a request the entry does not record) goes too, and a link is removed, never followed."""
    s, state = env(tmp_path)
    outside = tmp_path / "outside"
    (outside / "a").mkdir(parents=True)
    (outside / "a" / "metadata.json").write_text("not ours")
    (outside / "metadata.json").write_text("not ours")
    cases = {"temp": lambda d: open(os.path.join(d, "a", ".metadata.json.1.2.tmp"), "w").close(),
             "extra": lambda d: os.makedirs(os.path.join(d, "zz")),
             "linked-request": lambda d: shutil.rmtree(os.path.join(d, "a")) or os.symlink(outside, os.path.join(d, "a")),
             "linked-dir": lambda d: shutil.rmtree(d) or os.symlink(outside, d)}
    d = Driver(s, lambda: state["inv"])
    d.recover()
    for name, spoil in cases.items():
        c = claim(name, [("a", GPU0)])
        uid = c["metadata"]["uid"]
        assert d.prepare_claims([c])[uid].error is None
        path = layout.claim_dir(s.plugin_dir, "default", name)
        spoil(path)
        assert d.unprepare_claims([ClaimRef("default", name, uid)]) == {uid: None}, name
        assert not os.path.lexists(path), name
        assert (outside / "a" / "metadata.json").read_text() == "not ours", name
        assert (outside / "metadata.json").read_text() == "not ours", name


def test_crash_after_metadata_written_rolls_back(tmp_path):
    s, state = env(tmp_path)
    c = claim("c", [("a", GPU0)])
    d = Driver(s, lambda: state["inv"])
    d.recover()

    def boom(point):
        if point == "prepare:specs-written":
            raise Crash(point)
    d.fault = boom
    with pytest.raises(Crash):
        d.prepare_claims([c])
    assert os.path.exists(host(s, c, "a"))
    Driver(s, lambda: state["inv"]).recover()
    assert not os.path.exists(layout.claim_dir(s.plugin_dir, "default", "c"))
    assert layout.list_specs(s.cdi_dir, DRIVER) == {}
