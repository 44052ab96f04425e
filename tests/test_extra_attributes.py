"""The operator's device attributes (``device_attributes``, discovery/extra_attributes.py): checked
as the API server checks names and values, given to the devices their rules name, never over a
device's own attribute or past the API's limit, and matched across drivers by the upstream allocator."""

from __future__ import annotations

import pytest

from agent.publish.slices import build_pool, render
from agent.settings import ConfigError, Settings
from discovery.extra_attributes import ExtraAttributes
from discovery.inventory import scan
from tests.conftest import profile_root
from tests.controlplane import allocate, claim_from
from tests.test_allocator import CLASSES, DRIVER, NODE, claim, devices, exactly

RAILS = [{"match": ["interface:ibp26s0", "pci:0000:3c:00.0"], "attributes": {"rail": 0, "fabric": "ib-east"}},
         {"match": "interface:ibp*", "attributes": {"rail": 1, "cabled": True}},
         {"match": ["kind:gpu", "kind:nic"], "attributes": {"dra.net/numaNode": {"copy": "resource.kubernetes.io/numaNode"}}}]


def _api(device) -> dict:
    return {k: v.to_api() for k, v in device.attributes.items()}


def test_the_rules_give_the_devices_they_name_their_attributes():
    inv = scan(profile_root("server-2s-gpu-nic"), extra_attributes=ExtraAttributes.parse(RAILS))
    by = {d.name: _api(d) for d in inv.devices}
    first = by["nic-0000-1a-00-0"]  # ibp26s0: the first rule's rail wins, the second adds what the first has not
    assert first["rail"] == {"int": 0} and first["fabric"] == {"string": "ib-east"} and first["cabled"] == {"bool": True}
    assert by["nic-0000-3c-00-0"]["rail"] == {"int": 0}  # by its PCI address
    assert by["nic-0000-9f-00-0"]["rail"] == {"int": 1} and "fabric" not in by["nic-0000-9f-00-0"]
    for name, attrs in by.items():  # copied: the device's own value under the other driver's name
        assert attrs["dra.net/numaNode"] == attrs["resource.kubernetes.io/numaNode"], name
        assert ("rail" in attrs) == (name in {"nic-0000-1a-00-0", "nic-0000-3c-00-0", "nic-0000-9f-00-0"}), name
    assert all(not d.problems for d in inv.devices)


def test_a_devices_own_attribute_wins_and_the_api_limit_holds():
    rules = [{"match": "kind:gpu", "attributes": {"type": "tpu", "model": "x"}},
             {"match": "kind:gpu", "attributes": {f"extra{i}": i for i in range(16)}}]
    inv = scan(profile_root("server-2s-gpu-nic"), extra_attributes=ExtraAttributes.parse(rules))
    gpu = next(d for d in inv.devices if d.kind == "gpu")
    assert gpu.attributes["type"].string == "gpu"
    assert len(gpu.attributes) + len(gpu.capacity) == 32
    problems = {p.what: p.reason for p in gpu.problems}
    assert problems["device_attributes type"] == "the device publishes its own"
    assert "past the API's 32 attributes and capacities" in problems["device_attributes extra15"]
    copy = ExtraAttributes.parse([{"match": "kind:gpu", "attributes": {"rack": {"copy": "noSuchAttribute"}}}])
    assert "rack" not in next(d for d in scan(profile_root("server-2s-gpu-nic"), extra_attributes=copy).devices).attributes


@pytest.mark.parametrize("entry, message", [
    ({"match": "kind:gpu"}, "rule 1: needs exactly 'match' and 'attributes'"),
    ({"match": [], "attributes": {"a": 1}}, "rule 1: 'match' is a list"),
    ({"match": "gpu", "attributes": {"a": 1}}, "'gpu' is not pci:<glob>"),
    ({"match": "kind:gpu", "attributes": {}}, "rule 1: 'attributes' maps 1 to 16"),
    ({"match": "kind:gpu", "attributes": {"1rail": 1}}, "rule 1: '1rail' is not an attribute name"),
    ({"match": "kind:gpu", "attributes": {"a" * 33: 1}}, "is not an attribute name"),
    ({"match": "kind:gpu", "attributes": {"Example.com/rail": 1}}, "is not an attribute name"),
    ({"match": "kind:gpu", "attributes": {"resource.kubernetes.io/rail": 1}}, "domain is Kubernetes' own"),
    ({"match": "kind:gpu", "attributes": {"a" * 60 + ".com/rail": 1}}, "is not an attribute name"),
    ({"match": "kind:gpu", "attributes": {"rail": "x" * 65}}, "rail: a string of 1 to 64 bytes"),
    ({"match": "kind:gpu", "attributes": {"rail": ""}}, "rail: a string of 1 to 64 bytes"),
    ({"match": "kind:gpu", "attributes": {"rail": 1 << 63}}, "past a 64-bit integer"),
    ({"match": "kind:gpu", "attributes": {"rail": 1.5}}, "rail: a value is a string, an integer, a bool"),
    ({"match": "kind:gpu", "attributes": {"rail": {"copy": "a b"}}}, "rail: a value is a string"),
    ({"match": "kind:gpu", "attributes": {"rail": {"copy": "x", "and": 1}}}, "rail: a value is a string"),
])
def test_a_bad_rule_is_refused_naming_it(entry, message):
    with pytest.raises(ValueError, match=None) as err:
        ExtraAttributes.parse([entry])
    assert message in str(err.value)
    with pytest.raises(ConfigError) as err:  # as the agent loads it: exit 78, the setting named
        Settings.of({"device_attributes": [entry]})
    assert str(err.value).startswith("invalid setting device-attributes:") and message in str(err.value)


def test_the_setting_takes_yaml_text_from_the_environment():
    s = Settings.of({"device_attributes": "[{match: [kind:nic], attributes: {rail: 3}}]"})
    assert s.device_attributes == ({"match": ["kind:nic"], "attributes": {"rail": 3}},)
    assert Settings.of({"device_attributes": ""}).device_attributes == ()
    with pytest.raises(ConfigError, match="at most 64"):
        Settings.of({"device_attributes": [{"match": "kind:nic", "attributes": {"a": 1}}] * 65})


SRIOV = "sriovnetwork.k8snetworkplumbingwg.io"


def _foreign_vfs() -> dict:
    """Stand-in for dra-driver-sriov's slice (a Go driver for real SR-IOV NICs, which this machine
    has none of): two VFs, named by NUMA node with the attribute it publishes for other drivers."""
    vfs = [{"name": f"vf-numa{n}", "attributes": {"dra.net/numaNode": {"int": n}}} for n in (1, 0)]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{NODE}-sriov"},
            "spec": {"driver": SRIOV, "nodeName": NODE, "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
                     "devices": vfs}}


def test_a_claim_aligns_a_gpu_with_another_drivers_vf_by_the_copied_name():
    inv = scan(profile_root("server-2s-gpu-nic"), extra_attributes=ExtraAttributes.parse(RAILS))
    ours = render(build_pool(inv, node_name=NODE, driver_name=DRIVER), driver_name=DRIVER, node_name=NODE,
                  generation=1, full_name=True)
    vf_class = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "vf.example.com"},
                "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{SRIOV}"'}}]}}
    # the first GPU is on NUMA node 0; the first VF on node 1: only the constraint pairs them otherwise
    c = claim("aligned", exactly("gpu", "gpu.sysdra.io"), exactly("vf", "vf.example.com"),
              constraints=[{"matchAttribute": "dra.net/numaNode"}])
    (a,) = allocate(ours + [_foreign_vfs()], CLASSES + [vf_class], claim_from(c), node=NODE)
    got = {r["request"]: r["device"] for r in a["devices"]["results"]}
    gpu_numa = devices(ours)[got["gpu"]]["attributes"]["dra.net/numaNode"]["int"]
    assert got["vf"] == f"vf-numa{gpu_numa}"
    plain = claim("plain", exactly("gpu", "gpu.sysdra.io"), exactly("vf", "vf.example.com"))
    (b,) = allocate(ours + [_foreign_vfs()], CLASSES + [vf_class], claim_from(plain), node=NODE)
    assert {r["device"] for r in b["devices"]["results"]} != {r["device"] for r in a["devices"]["results"]}


def test_the_agents_scans_give_the_devices_the_operators_attributes(tmp_path):
    from agent.service import scanning
    from tests.kubelet_standin import settings_for

    settings = settings_for(str(tmp_path), root=profile_root("server-2s-gpu-nic"), nvml=False, device_attributes=RAILS)
    for inv in (scanning.default_scan(settings), scanning.update(None, settings, None)[1]):
        assert _api(inv.by_name()["nic-0000-9f-00-0"])["rail"] == {"int": 1}
    plain = scanning.default_scan(settings.replace(device_attributes=()))
    assert "rail" not in plain.by_name()["nic-0000-9f-00-0"].attributes


def test_sysdra_scan_shows_them_in_the_slices_run_would_publish(tmp_path, capsys):
    import json

    from agent.cli import main as cli

    config = tmp_path / "config.yaml"
    config.write_text("device_attributes:\n- {match: [interface:ibp*], attributes: {rail: 7}}\n")
    argv = ["scan", "--root", profile_root("server-2s-gpu-nic"), "-o", "slices", "--node-name", NODE, "--config", str(config)]
    assert cli.main(argv) == 0
    got = devices(json.loads(capsys.readouterr().out)["items"])
    assert got["nic-0000-9f-00-0"]["attributes"]["rail"] == {"int": 7} and "rail" not in got["gpu-0000-18-00-0"]["attributes"]
