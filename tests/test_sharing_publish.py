"""--share: which devices are published multi-allocatable, with which capacities and policies,
and bad policies refused at start with exit 78 (agent/publish/sharing.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agent.publish.sharing import DEFAULT_POLICIES, share_plan
from tests.conftest import REPO, profile_root
from tests.test_allocator import devices, kind, published


def test_nothing_is_shared_by_default():
    assert share_plan((), None) is None
    assert not any("allowMultipleAllocations" in d for d in devices(published("server-2s-gpu-nic")).values())


def test_only_the_shared_kinds_are_multi_allocatable():
    slices = published("server-2s-gpu-nic", share=share_plan(("nic",), None))
    for d in devices(slices).values():
        assert d.get("allowMultipleAllocations") is (True if kind(d) == "nic" else None), d["name"]


def test_capacity_values_come_from_discovery():
    by = devices(published("workstation-deep-bridges", share=share_plan(("gpu", "nic"), None)))
    amd = by["gpu-0000-0d-00-0"]["capacity"]  # mem_info_vram_total
    assert amd["memory"]["value"] == "24560Mi" and amd["compute"]["value"] == "100"
    assert "memory" not in by["gpu-0000-0a-00-0"]["capacity"]  # VRAM unknown: not accounted there
    nv = devices(published("server-2s-gpu-nic", share=share_plan(("gpu", "nic"), None)))
    # 10de:2330 (H100 SXM5 80GB) from the PCI ID table: the datasheet's 80 GB in decimal units
    assert nv["gpu-0000-18-00-0"]["capacity"]["memory"]["value"] == "80G"
    assert nv["nic-0000-1a-00-0"]["capacity"]["bandwidth"]["value"] == "400G"  # ports/1/rate "400 Gb/sec (4X NDR)"
    assert nv["nic-0000-bd-00-0"]["capacity"]["bandwidth"]["value"] == "10G"
    assert nv["nic-0000-1a-00-0"]["capacity"]["slots"] == {"value": "32", "requestPolicy": {
        "default": "1", "validRange": {"min": "1", "step": "1"}}}  # fmt: skip


def test_operator_policies_replace_a_capacitys_default_or_drop_it():
    plan = share_plan(("gpu",), {"gpu": {"memory": None, "compute": {"value": 8, "default": 1, "validValues": [1, 2, 4, 8]}}})
    gpu = devices(published("server-2s-gpu-nic", share=plan))["gpu-0000-18-00-0"]
    assert gpu["capacity"] == {"compute": {"value": "8", "requestPolicy": {"default": "1", "validValues": ["1", "2", "4", "8"]}}}


@pytest.mark.parametrize("share,policies,message", [
    (("tpu",), None, "share: 'tpu' cannot be shared"),
    (("gpu",), {"nic": {}}, "share-policies.nic: a request policy needs allowMultipleAllocations"),
    (("gpu",), {"gpu": {"compute": {"value": 100, "default": 10, "validValues": [50, 10]}}}, "ascending"),
    (("gpu",), {"gpu": {"compute": {"value": 100, "default": 5, "validValues": list(range(5, 60, 5))}}}, "at most 10"),
    (("gpu",), {"gpu": {"compute": {"value": 100, "default": 0, "validRange": {"min": 1, "max": 100}}}}, "default is less than validRange.min"),
    (("gpu",), {"gpu": {"compute": {"value": 100, "default": 101, "validRange": {"min": 1, "max": 100}}}}, "default is more than validRange.max"),
    (("gpu",), {"gpu": {"compute": {"value": 100, "default": 15, "validRange": {"min": 10, "step": 10}}}}, "multiple of validRange.step"),
    (("gpu",), {"gpu": {"compute": {"value": 50, "default": 10, "validRange": {"min": 1, "max": 100}}}}, "larger than the capacity value"),
    (("gpu",), {"gpu": {"memory": {"default": "1Gi", "validRange": {"min": "1Gi"}, "stepp": "1Gi"}}}, "unknown field"),
    (("gpu",), {"gpu": {"memory": {"default": "lots"}}}, "not a quantity"),
    (("gpu",), {"gpu": {"memory": {"default": "1Gi", "validRange": {"min": "1Gi", "stpe": "1Gi"}}}}, "mapping of min, max, step"),
    (("gpu",), {"gpu": {f"c{i}": {"value": 1, "default": 1, "validValues": [1]} for i in range(7)}}, "9 capacities, at most 8"),
    (("gpu",), {"gpu": {"bad-name": {"default": "1"}}}, "share-policies.gpu.bad-name"),
])  # fmt: skip
def test_bad_policies_are_refused(share, policies, message):
    with pytest.raises(ValueError, match=message):
        share_plan(share, policies)


def test_eight_capacities_are_allowed():
    policies = {"memory": None, "compute": None, **{f"c{i}": {"value": 1, "default": 1, "validValues": [1]} for i in range(8)}}
    assert len(share_plan(("gpu",), {"gpu": policies}).policies["gpu"]) == 8


@pytest.mark.parametrize("command", ["run", "scan"])
def test_a_bad_policy_stops_run_and_scan_with_exit_78(tmp_path, command):
    config = tmp_path / "config.yaml"
    config.write_text("share: [gpu]\nshare_policies:\n  gpu:\n    compute: {value: 100, default: 10, validValues: [50, 10]}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYSDRA_")}
    argv = [sys.executable, "-m", "agent", command, "--config", str(config), "--root", profile_root("vm-numa-none"), "--node-name", "n"]
    if command == "scan":
        argv += ["-o", "slices"]
    else:
        argv += ["--cluster", f"dir:{tmp_path}/c", "--kubelet-dir", str(tmp_path / "k"), "--cdi-dir", str(tmp_path / "cdi"), "--metrics-address", ""]
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 78, out.stderr
    assert "share-policies.gpu.compute" in out.stderr and "ascending" in out.stderr


def test_share_flag_reaches_scan_output():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYSDRA_")} | {"SYSDRA_CONFIG": os.devnull}
    out = subprocess.run([sys.executable, "-m", "agent", "scan", "-o", "slices", "--root", profile_root("server-2s-gpu-nic"),
                          "--node-name", "n", "--share", "gpu"], cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert '"allowMultipleAllocations": true' in out.stdout


def test_defaults_are_valid_policies():
    plan = share_plan(tuple(DEFAULT_POLICIES), None)
    assert plan is not None and set(plan.kinds) == {"gpu", "nic"}


def test_shared_gpus_and_gpu_partitions_are_refused_together(monkeypatch, capsys):
    from agent.cli import main as cli

    for key in [k for k in os.environ if k.startswith("SYSDRA_")]:
        monkeypatch.delenv(key)
    code = cli.main(["scan", "-o", "slices", "--config", os.devnull, "--root", profile_root("vm-numa-none"),
                     "--node-name", "n", "--share", "gpu", "--partitions"])
    assert code == 78 and "gpu cannot be combined with partitions" in capsys.readouterr().err


def test_a_nics_bandwidth_is_its_fastest_port():
    # a stand-in device: discovered_value reads only these fields, and ports of two rates are the case
    from types import SimpleNamespace as NS

    from agent.sharecaps import discovered_value

    ports = NS(kind="nic", nic=NS(rdma=[], interfaces=[NS(speed_mbps=10000), NS(speed_mbps=25000), NS(speed_mbps=0)]))
    assert discovered_value(ports, "bandwidth") == "25G"
    rdma = NS(kind="nic", nic=NS(rdma=[NS(rate_gbps=200), NS(rate_gbps=400)], interfaces=[NS(speed_mbps=100000)]))
    assert discovered_value(rdma, "bandwidth") == "400G"  # the RDMA ports' rates, where known
