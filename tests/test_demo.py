"""`make demo` is the README's first command: it must keep working end to end."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_demo_runs_end_to_end():
    out = subprocess.run([sys.executable, "-m", "agent.tools.demo"], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    for expected in ("kubelet picks v1.DRAPlugin", "NodePrepareResources", '"cdiVersion": "0.5.0"',
                     "metadata.resource.k8s.io/v1beta1", "12 -> 11 devices", "registered", "CDI spec still there: False",
                     "exit code 0; sockets left: none"):
        assert expected in text, expected
