"""bench/agentproc.py: the processes the benchmarks time run sysdra as pip installs it, from
site-packages, without the development tree's editable-install hook."""

from __future__ import annotations

import os
import subprocess

from bench.agentproc import Install
from tests.conftest import profile_root

PROBE = ("import sys, agent.cli.main, discovery.inventory\n"
         "print(agent.cli.main.__file__)\n"
         "print(sorted(m for m in sys.modules if 'editable' in m))\n")


def test_the_installed_copy_runs_without_the_editable_hook(tmp_path):
    inst = Install(str(tmp_path))
    out = subprocess.run([inst.python, "-c", PROBE], cwd=inst.cwd, check=True, capture_output=True, text=True)
    path, hooks = out.stdout.splitlines()
    assert path.startswith(os.path.join(inst.cwd, "venv")) and "site-packages" in path
    assert hooks == "[]"
    scan = subprocess.run([inst.python, "-m", "agent", "scan", "--root", profile_root("sriov-nic"), "-o", "json"],
                          cwd=inst.cwd, capture_output=True, text=True)
    assert scan.returncode == 0, scan.stderr
    assert '"devices"' in scan.stdout
