"""sysdra doctor's check of CRI-O's config (agent/tools/doctor_crio.py): CDI reads the agent's spec
dir, NRI on at the agent's socket and open to external plugins, the drop-ins merged as CRI-O
merges them. CRI-O itself cannot run here (no package for this machine's Debian), so the
configs are checked against what its source says (cri-o/cri-o at f954a17e: pkg/config, the
defaults in internal/config/nri/nri.go and containerd/nri's api), not against `crio config`."""

from __future__ import annotations

import pytest

from agent.tools.doctor_crio import check_crio, config_files
from tests.test_doctor_runtime import CDI, SOCK, expect, levels, write

NRI_ON = "[crio.nri]\nenable_nri = true\n"


@pytest.mark.parametrize("text, cdi, nri", [
    (NRI_ON, "ok", "ok"),
    ("", "ok", "warn"),  # enable_nri unset: on since CRI-O 1.30, off before
    ("[crio.nri]\nenable_nri = false\n", "ok", "fail"),
    (NRI_ON + "nri_disable_connections = true\n", "ok", "fail"),
    (NRI_ON + "nri_listen = '/run/other.sock'\n", "ok", "warn"),
    ("[crio.runtime]\ncdi_spec_dirs = ['/etc/cdi']\n" + NRI_ON, "fail", "ok"),
    ("[crio.runtime]\ncdi_spec_dirs = ['/etc/cdi', '/var/run/cdi/']\n" + NRI_ON, "ok", "ok"),
])
def test_crio_configs(tmp_path, text, cdi, nri):
    found = check_crio(str(tmp_path), SOCK, CDI, path=write(tmp_path, text, "crio.conf"), drop_ins=str(tmp_path / "none"))
    expect(found, {"crio-cdi": cdi, "crio-nri": nri})


def test_the_drop_ins_under_the_root_override_key_by_key_in_order(tmp_path):
    root = tmp_path / "root"
    assert levels(check_crio(str(root), SOCK, CDI)) == {"crio": "skip"}
    write(root, "[crio.nri]\nenable_nri = false\nnri_listen = '/var/run/nri/nri.sock'\n", "etc/crio/crio.conf")
    assert levels(check_crio(str(root), SOCK, CDI))["crio-nri"] == "fail"
    write(root, NRI_ON, "etc/crio/crio.conf.d/10-nri.conf")  # OpenShift's MachineConfig way
    assert levels(check_crio(str(root), SOCK, CDI))["crio-nri"] == "ok"  # nri_listen of the main file kept
    write(root, "[crio.nri]\nnri_disable_connections = true\n", "etc/crio/crio.conf.d/sub/01-late.conf")
    write(root, "[crio.nri]\nnri_disable_connections = false\n", "etc/crio/crio.conf.d/05-early/99.conf")
    files = config_files(str(root / "etc/crio/crio.conf"), str(root / "etc/crio/crio.conf.d"))
    names = [f.split("crio.conf.d/")[-1] for f in files]
    assert names == [str(root / "etc/crio/crio.conf"), "05-early/99.conf", "10-nri.conf", "sub/01-late.conf"]  # Go's Walk
    assert levels(check_crio(str(root), SOCK, CDI))["crio-nri"] == "fail"


def test_a_damaged_file_is_a_warning(tmp_path):
    root = tmp_path / "root"
    write(root, "[crio.nri\n", "etc/crio/crio.conf.d/bad.conf")
    (found,) = check_crio(str(root), SOCK, CDI)
    assert found.level == "warn" and "bad.conf" in found.message


def test_a_file_nested_too_deep_is_a_warning_not_a_crash(tmp_path):
    path = write(tmp_path, "a = " + "{b = " * 5000 + "1" + "}" * 5000 + "\n", "crio.conf")
    (found,) = check_crio(str(tmp_path), SOCK, CDI, path=path, drop_ins=str(tmp_path / "none"))
    assert found.level == "warn" and "nested too deep" in found.message
