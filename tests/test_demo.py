"""`make demo` is the README's first command: it must keep working end to end."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_demo_runs_end_to_end():
    out = subprocess.run([sys.executable, "-m", "agent.tools.demo"], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    for expected in ("kubelet picks v1.DRAPlugin", "NodePrepareResources", '"cdiVersion": "0.',
                     "metadata.resource.k8s.io/v1beta1", "12 -> 11 devices", "registered", "CDI spec still there: False",
                     "exit code 0; sockets left: none"):
        assert expected in text, expected


def test_partition_demo_switches_the_gpu_and_hands_out_the_partition():
    out = subprocess.run([sys.executable, "-m", "fixtures.simkernel.demo"], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for expected in ("counter set gpu-0000-27-00-0: xcds=8, memory=196288Mi", "16 cpx-nps1", "is in SPX/NPS1",
                     "is now in CPX/NPS1", "gpu-0000-27-00-0-cpx-nps1-3: /dev/dri/renderD139, /dev/kfd",
                     "error=''; GPU gpu-0000-27-00-0 in CPX/NPS1", "[dri/card2,dri/renderD136,kfd]  CPX/NPS1: 8 partitions",
                     "error='GPU 0000:27:00.0 runs NPS1; QPX/NPS4 needs memory mode NPS4, which amdgpu applies only at a "
                     "driver reload: set it on the node (amd-smi / sysfs, then reload amdgpu)'; GPU gpu-0000-27-00-0 in CPX/NPS1"):
        assert expected in out.stdout, expected
    devices = next(line for line in out.stdout.splitlines() if "devices: " in line)
    assert "nps4" not in devices.split("(")[0], devices  # the memory mode the GPUs run in only
