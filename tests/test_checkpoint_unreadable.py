"""A checkpoint file that is there but cannot be read (agent/prepare/checkpoint_format.py
``read_file``): a directory where the file should be (a hostPath the kubelet made for a file that
was missing), no permission. Nothing of it was read, so it is no damage to move aside: the agent
stops with one clear line and exit 65, its claims and files untouched."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agent.kubeletplugin.types import ClaimRef
from agent.prepare import cdifiles
from agent.prepare.checkpoint import CheckpointError
from agent.prepare.driver import Driver
from agent.prepare.metadata.update import NetworkData, UpdateError, update_request
from agent.service.startup import EX_DATAERR
from tests.conftest import REPO, profile_root
from tests.kubelet_standin import claim
from tests.test_checkpoint import make_env, new_driver


@pytest.mark.parametrize("which", ["checkpoint.json", "checkpoint.json.journal"])
def test_a_directory_where_a_checkpoint_file_should_be_is_a_clear_error_and_nothing_is_touched(tmp_path, which):
    s, state = make_env(tmp_path)
    c = claim("c", [("a", "gpu-0000-1b-00-0")])
    assert new_driver(s, state).prepare_claims([c])[c["metadata"]["uid"]].error is None
    path = os.path.join(s.plugin_dir, which)
    os.replace(path, path + ".kept")
    os.mkdir(path)
    with pytest.raises(CheckpointError, match=f"{which} cannot be read \\(Is a directory\\)"):
        Driver(s, lambda: state["inv"]).recover()  # raised IsADirectoryError
    assert os.path.isdir(path) and list(cdifiles.list_claim_specs(s.cdi_dir, s.driver_name)) == [c["metadata"]["uid"]]
    with pytest.raises(UpdateError, match="cannot read the checkpoint: .* cannot be read"):  # the CLI's: a traceback
        update_request(s, ClaimRef("default", "c", c["metadata"]["uid"]), "a", NetworkData("eth1"))


def test_the_agent_exits_65_with_one_line(tmp_path):
    plugin = tmp_path / "kubelet" / "plugins" / "sysdra.io"
    os.makedirs(plugin / "checkpoint.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYSDRA_")}
    cmd = [sys.executable, "-m", "agent", "run", "--config", os.devnull, "--root", profile_root("server-2s-gpu-nic"),
           "--node-name", "node-a", "--cluster", f"dir:{tmp_path / 'cluster'}", "--kubelet-dir", str(tmp_path / "kubelet"),
           "--cdi-dir", str(tmp_path / "cdi"), "--metrics-address", ""]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == EX_DATAERR, done.stderr[-2000:]
    assert f"sysdra: {plugin / 'checkpoint.json'} cannot be read (Is a directory)" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_scans_and_doctor_read_past_an_unreadable_checkpoint(tmp_path):
    """The scans ask which netdevs are in pods (service/inpod.py): they keep what they knew; doctor
    names the file and the fix."""
    from agent.service.inpod import InPodNetdevs
    from agent.tools.doctor_files import check_checkpoint

    plugin = tmp_path / "plugin"
    os.makedirs(plugin / "checkpoint.json")
    assert InPodNetdevs(str(plugin))() == {}
    (finding,) = [f for f in check_checkpoint(str(plugin)) if f.check == "checkpoint"]
    assert finding.level == "fail" and "cannot be read (Is a directory)" in finding.message
    assert finding.fix == "make it the agent's file again"
