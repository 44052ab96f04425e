"""The real-GPU check's wheels (tests/hardware/wheels.sh): the GPU machine has no network and not
all of the agent's dependencies, so they travel as wheels. Downloaded here for this Python (the
GPU machine's is 3.12), installed into a site dir of their own as tests/hardware/on_device.sh does,
and used by an interpreter that sees nothing else (``-S``: no site-packages): the agent imports and
``sysdra scan`` runs. A dependency the set misses fails here, not on the lent machine. PyPI needed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, profile_root

pytestmark = pytest.mark.slow


def test_the_wheels_alone_run_the_agent(tmp_path):
    wheels, site = tmp_path / "whl", tmp_path / "site"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    got = subprocess.run([os.path.join(REPO, "tests", "hardware", "wheels.sh")], capture_output=True, text=True,
                         env=dict(os.environ, PYVER=version, WHEELS=str(wheels), VENV_PYTHON=sys.executable), timeout=600)  # fmt: skip
    assert got.returncode == 0, got.stderr
    assert any(n.startswith("pycurl-") for n in os.listdir(wheels)), os.listdir(wheels)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--disable-pip-version-check",
                    "--target", str(site), *(str(wheels / n) for n in os.listdir(wheels))], check=True, timeout=300)  # fmt: skip
    alone = dict(os.environ, PYTHONPATH=f"{site}:{REPO}")
    imported = subprocess.run([sys.executable, "-S", "-c", "import agent.cli.main, agent.service.daemon, agent.kubeletplugin.claims"],
                              capture_output=True, text=True, env=alone, cwd=REPO, timeout=120)  # fmt: skip
    assert imported.returncode == 0, imported.stderr
    scan = subprocess.run([sys.executable, "-S", "-m", "agent", "scan", "--root", profile_root("server-2s-gpu-nic"), "-o", "json"],
                          capture_output=True, text=True, env=alone, cwd=REPO, timeout=120)  # fmt: skip
    assert scan.returncode == 0 and '"gpu-0000-18-00-0"' in scan.stdout, scan.stderr
