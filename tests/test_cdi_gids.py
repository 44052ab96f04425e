"""``cdi_additional_gids``: a claim's CDI device adds the host groups of its group-owned nodes
(cdi/nodegroup.py), the spec's version follows (0.7.0), and off writes no such field. The nodes
are real (mknod, root only) in a tmp root: the agent reads them as untrusted input."""

from __future__ import annotations

import os
import stat

import pytest

from agent.settings import ConfigError, Settings
from cdi.claim import build_claim_spec
from cdi.nodegroup import group_reader, node_group
from cdi.spec import SpecError, validate
from discovery.models import DeviceNode
from tests.conftest import require_root
from tests.kubelet_standin import gpu

UID = "9d3c1c8e-0000-4000-8000-000000000001"


def _node(root, path: str, mode: int, gid: int, rdev=(1, 3), kind=stat.S_IFCHR) -> DeviceNode:
    host = os.path.join(root, path.lstrip("/"))
    os.makedirs(os.path.dirname(host), exist_ok=True)
    os.mknod(host, mode | kind, os.makedev(*rdev))
    os.chown(host, 0, gid)
    os.chmod(host, mode)
    return DeviceNode(path=path, host_path=host, type="c", major=1, minor=3, source="test")


@pytest.fixture
def root(tmp_path):
    require_root()
    return str(tmp_path)


@pytest.mark.parametrize("mode,gid,expected", [
    (0o660, 44, 44),    # root:render 0660 (ROCm's /dev/kfd)
    (0o640, 44, 44),    # the group may read
    (0o620, 44, 44),    # the group may write
    (0o600, 44, None),  # the group has no access: nothing to add
    (0o660, 0, None),   # root's group: 0 adds nothing (runtimes ignore it)
    (0o666, 44, 44),    # world-accessible too: the group is harmless, and the mode may change
])
def test_the_group_of_a_group_owned_node(root, mode, gid, expected):
    assert node_group(_node(root, "/dev/kfd", mode, gid)) == expected


def test_what_is_not_the_node_grants_nothing(root, tmp_path):
    assert node_group(DeviceNode(path="/dev/x", host_path=str(tmp_path / "gone"), major=1, minor=3, source="t")) is None
    other = _node(root, "/dev/other", 0o660, 44, rdev=(1, 5))  # another device's numbers at the path
    assert node_group(other) is None
    regular = tmp_path / "dev" / "file"
    regular.write_text("")
    os.chown(regular, 0, 44)
    os.chmod(regular, 0o660)
    assert node_group(DeviceNode(path="/dev/file", host_path=str(regular), major=1, minor=3, source="t")) is None
    real = _node(root, "/dev/real", 0o660, 44)
    link = tmp_path / "dev" / "link"
    os.symlink(real.host_path, link)  # a symlink is never followed
    assert node_group(DeviceNode(path="/dev/link", host_path=str(link), major=1, minor=3, source="t")) is None
    block = _node(root, "/dev/blk", 0o660, 44, kind=stat.S_IFBLK)  # the spec says char
    assert node_group(block) is None


def _gpu_with(root, *nodes: DeviceNode):
    return gpu(0, root).replace(device_nodes=tuple(nodes))


def test_the_spec_adds_each_devices_groups_at_device_level_and_version_0_7(root):
    dev = _gpu_with(root, _node(root, "/dev/kfd", 0o660, 110), _node(root, "/dev/dri/renderD128", 0o660, 44),
                    _node(root, "/dev/dri/card0", 0o660, 44), _node(root, "/dev/own", 0o600, 7))
    spec = build_claim_spec("sysdra.io", UID, [dev], root, group_of=group_reader("on"))
    (cdi_dev,) = spec["devices"]
    assert cdi_dev["containerEdits"]["additionalGids"] == [44, 110]  # each once, sorted
    assert "additionalGids" not in spec["containerEdits"]  # only a container given the device joins
    assert spec["cdiVersion"] == "0.7.0"
    assert [n["path"] for n in cdi_dev["containerEdits"]["deviceNodes"]] == ["/dev/kfd", "/dev/dri/renderD128",
                                                                              "/dev/dri/card0", "/dev/own"]


def test_off_or_nothing_group_owned_writes_no_field_and_keeps_0_5(root):
    dev = _gpu_with(root, _node(root, "/dev/kfd", 0o660, 110))
    for group_of in (group_reader("off"), None):
        spec = build_claim_spec("sysdra.io", UID, [dev], root, group_of=group_of)
        assert "additionalGids" not in str(spec) and spec["cdiVersion"] == "0.5.0"
    mine = _gpu_with(root, _node(root, "/dev/mine", 0o600, 110))
    spec = build_claim_spec("sysdra.io", UID, [mine], root, group_of=group_reader("on"))
    assert "additionalGids" not in str(spec) and spec["cdiVersion"] == "0.5.0"  # nothing to add: no 0.7.0


@pytest.mark.parametrize("gids", [["44"], [-1], [2**32], [True], "44"])
def test_validate_refuses_bad_group_ids(gids):
    spec = {"cdiVersion": "0.7.0", "kind": "k8s.sysdra.io/claim",
            "devices": [{"name": "d", "containerEdits": {"env": ["A=1"], "additionalGids": gids}}]}
    with pytest.raises(SpecError, match="additionalGids"):
        validate(spec)


def test_the_setting():
    assert Settings().cdi_additional_gids == "off"
    assert Settings.of({"cdi_additional_gids": "on"}).cdi_additional_gids == "on"
    with pytest.raises(ConfigError, match="cdi.additional.gids"):
        Settings.of({"cdi_additional_gids": "auto"})
    # a config file's bare on/off, which YAML reads as a bool
    import yaml

    for text, value in (("cdi_additional_gids: off", "off"), ("cdi_additional_gids: on", "on")):
        assert Settings.of(yaml.safe_load(text)).cdi_additional_gids == value
