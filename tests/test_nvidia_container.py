"""The NVIDIA driver files of a claim's CDI spec, seen from inside a container: the spec the agent
prepared for the h200-vm fixture (its /usr/local/nvidia driver root, with the video libraries
added) applied to a busybox rootfs by
tests/hardware/cdirun.py, the runner of the real-GPU check. Needs root (mount namespaces) and
busybox; a real runtime on the real node is tests/ for the node (docs/control-plane.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, copy_profile
from tests.test_nvidia_driver import add_video_libraries, prepare_gpu

pytestmark = [pytest.mark.slow, pytest.mark.root]
CDIRUN = os.path.join(REPO, "tests", "hardware", "cdirun.py")


def test_a_container_sees_the_driver_at_the_specs_paths(tmp_path):
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.fail("busybox is required (apt-get install busybox-static)")
    root = copy_profile(tmp_path, "h200-vm")
    add_video_libraries(os.path.join(root, "usr/local/nvidia/lib64"))
    res, spec, _ = prepare_gpu(tmp_path, root, "gpu-0000-00-06-0", nvidia_driver_root="/usr/local/nvidia",
                               cdi_host_root=root)
    assert res.error is None, res.error
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    rootfs = tmp_path / "rootfs"
    for d in ("bin", "dev", "proc", "sys"):
        (rootfs / d).mkdir(parents=True)
    shutil.copy(busybox, rootfs / "bin" / "busybox")
    script = ("cd /usr/local/nvidia/lib64; cat libcuda.so.1 libnvidia-ptxjitcompiler.so.1 libnvcuvid.so.1 libnvidia-encode.so.1; "
              "echo LD=$LD_LIBRARY_PATH; echo VISIBLE=$NVIDIA_VISIBLE_DEVICES; /bin/busybox ls /usr/bin /lib/firmware/nvidia/580.159.04; "
              "echo x > /usr/local/nvidia/lib64/libcuda.so || echo read-only")
    out = subprocess.run([sys.executable, CDIRUN, "--spec", str(spec_path), "--device", spec["devices"][0]["name"],
                          "--rootfs", str(rootfs), "--", "/bin/busybox", "sh", "-c", script],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:4] == ["fixture: libcuda.so.580.159.04", "fixture: libnvidia-ptxjitcompiler.so.580.159.04",
                         "fixture: libnvcuvid.so.580.159.04", "fixture: libnvidia-encode.so.580.159.04"]
    assert "LD=/usr/local/nvidia/lib:/usr/local/nvidia/lib64" in lines
    assert "VISIBLE=void" in lines  # a default nvidia-container-runtime's legacy hook adds no GPU
    for name in ("nvidia-smi", "nvidia-cuda-mps-control", "gsp_ga10x.bin"):
        assert name in out.stdout
    assert lines[-1] == "read-only"
