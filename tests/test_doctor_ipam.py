"""sysdra doctor's check of the node's IPAM pools (agent/tools/doctor_ipam.py) with the real CNI
plugins of Debian's containernetworking-plugins: a pool's plugin found under the root and
speaking CNI 1.0 is ok, a missing one fails, a plugin that speaks only older CNI fails, pools
without NRI warn, and no pools say nothing."""

from __future__ import annotations

import os

import pytest

from agent.tools.doctor_ipam import check_ipam
from tests.kubelet_standin import settings_for
from tests.test_nic_ipam import CNI_BIN, POOL, root  # noqa: F401 - the fixture node with /opt/cni/bin


def test_pools_plugins_are_found_and_speak_cni_1_0(tmp_path, root):  # noqa: F811
    old = os.path.join(root, "opt", "cni", "old")
    os.makedirs(old)
    with open(os.path.join(old, "ancient"), "w") as f:  # a plugin of CNI's early days
        f.write('#!/bin/sh\necho \'{"cniVersion": "0.4.0", "supportedVersions": ["0.3.1", "0.4.0"]}\'\n')
    os.chmod(os.path.join(old, "ancient"), 0o755)
    s = settings_for(str(tmp_path), root=root, nic_ipam={"data": POOL, "gone": {"type": "whereabouts"}})
    found = {f.message.split(":")[0]: f for f in check_ipam(s)}
    assert found["IPAM pool data"].level == "ok" and "host-local" in found["IPAM pool data"].message
    assert found["IPAM pool gone"].level == "fail" and "containernetworking-plugins" in found["IPAM pool gone"].fix
    s = settings_for(str(tmp_path), root=root, nic_ipam={"old": {"type": "ancient"}}, cni_bin_dir="/opt/cni/old")
    (f,) = check_ipam(s)
    assert (f.level, f.message) == ("fail", f"IPAM pool old: {root}/opt/cni/old/ancient speaks CNI 0.3.1, 0.4.0, not 1.0.0")


def test_pools_without_nri_warn_and_no_pools_say_nothing(tmp_path, root):  # noqa: F811
    assert check_ipam(settings_for(str(tmp_path), root=root)) == []
    levels = [f.level for f in check_ipam(settings_for(str(tmp_path), root=root, nic_ipam={"data": POOL}, nri_socket=""))]
    assert levels == ["warn", "ok"]


@pytest.mark.parametrize("plugin", ["host-local", "static", "dhcp"])
def test_the_ipam_plugins_of_a_node_speak_cni_1_0(tmp_path, root, plugin):  # noqa: F811
    (f,) = check_ipam(settings_for(str(tmp_path), root=root, nic_ipam={"p": {"type": plugin}}))
    assert f.level == "ok", f


@pytest.mark.parametrize("answer,said", [('{"supportedVersions": 5}', "supportedVersions is not a list of versions: 5"),
                                         ('{"supportedVersions": [1, 0]}', "supportedVersions is not a list"),
                                         ("[" * 50000, "its VERSION answer is nested too deep")])
def test_a_plugins_odd_version_answer_is_its_failed_check(tmp_path, root, answer, said):  # noqa: F811
    """Another program's output: doctor raised TypeError or RecursionError and checked nothing more."""
    odd = os.path.join(root, "opt", "cni", "odd")
    os.makedirs(odd)
    with open(os.path.join(odd, "plugin"), "w") as f:
        f.write(f"#!/bin/sh\necho '{answer}'\n")
    os.chmod(os.path.join(odd, "plugin"), 0o755)
    (f,) = check_ipam(settings_for(str(tmp_path), root=root, nic_ipam={"p": {"type": "plugin"}}, cni_bin_dir="/opt/cni/odd"))
    assert f.level == "fail" and said in f.message
