"""The NVIDIA driver files of a claim's CDI spec, seen from inside a container: the spec the agent
prepared for the h200-vm fixture (its /usr/local/nvidia driver root) applied to a busybox rootfs by
tests/hardware/cdirun.py, the runner of the real-GPU check. Needs root (mount namespaces) and
busybox; a real runtime on the real node is tests/ for the node (docs/control-plane.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, profile_root
from tests.test_nvidia_driver import prepare_gpu

pytestmark = [pytest.mark.slow, pytest.mark.root]
CDIRUN = os.path.join(REPO, "tests", "hardware", "cdirun.py")


def _run(tmp_path, spec: dict, device: str, script: str) -> subprocess.CompletedProcess:
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.fail("busybox is required (apt-get install busybox-static)")
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    rootfs = tmp_path / f"rootfs-{device}"
    for d in ("bin", "dev", "proc", "sys"):
        (rootfs / d).mkdir(parents=True)
    shutil.copy(busybox, rootfs / "bin" / "busybox")
    out = subprocess.run([sys.executable, CDIRUN, "--spec", str(spec_path), "--device", device,
                          "--rootfs", str(rootfs), "--", "/bin/busybox", "sh", "-c", script],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out


def test_a_container_sees_the_driver_at_the_specs_paths(tmp_path):
    root = profile_root("h200-vm")
    res, spec, _ = prepare_gpu(tmp_path, root, "gpu-0000-00-06-0", nvidia_driver_root="/usr/local/nvidia",
                               cdi_host_root=root)
    assert res.error is None, res.error
    script = ("cat /usr/local/nvidia/lib64/libcuda.so.1 /usr/local/nvidia/lib64/libnvidia-ptxjitcompiler.so.1; "
              "echo LD=$LD_LIBRARY_PATH; echo VISIBLE=$NVIDIA_VISIBLE_DEVICES; "
              "/bin/busybox ls /usr/bin /lib/firmware/nvidia/580.159.04; "
              "echo x > /usr/local/nvidia/lib64/libcuda.so || echo read-only")
    out = _run(tmp_path, spec, spec["devices"][0]["name"], script)
    lines = out.stdout.splitlines()
    assert lines[:2] == ["fixture: libcuda.so.580.159.04", "fixture: libnvidia-ptxjitcompiler.so.580.159.04"]
    assert "LD=/usr/local/nvidia/lib:/usr/local/nvidia/lib64" in lines
    assert "VISIBLE=void" in lines  # nvidia-container-runtime's legacy hook adds no GPU
    for name in ("nvidia-smi", "nvidia-cuda-mps-control", "gsp_ga10x.bin"):
        assert name in out.stdout
    assert lines[-1] == "read-only"


def test_a_container_given_only_the_claims_nic_gets_no_driver(tmp_path):
    root = profile_root("server-2s-gpu-nic")
    res, spec, _ = prepare_gpu(tmp_path, root, "gpu-0000-18-00-0", "nic-0000-1a-00-0", cdi_host_root=root)
    assert res.error is None, res.error
    script = ("echo LD=$LD_LIBRARY_PATH; echo VISIBLE=$NVIDIA_VISIBLE_DEVICES; "
              "/bin/busybox ls /usr/local/nvidia/lib64 || echo no-driver")
    gpu, nic = (d["name"] for d in spec["devices"])
    assert _run(tmp_path, spec, nic, script).stdout.splitlines() == ["LD=", "VISIBLE=", "no-driver"]
    lines = _run(tmp_path, spec, gpu, script).stdout.splitlines()
    assert lines[:2] == ["LD=/usr/local/nvidia/lib:/usr/local/nvidia/lib64", "VISIBLE=void"] and "libcuda.so.1" in lines
