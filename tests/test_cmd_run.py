"""``sysdra run``: settings precedence, bad values (exit 78), and the daemon end to end
in offline mode: publishes slices, then exits cleanly on SIGTERM."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import kubernetes_validate
import pytest

from agent.cli import main as cli
from agent.cli.run import settings_from_args
from agent.settings import EX_CONFIG
from tests.conftest import REPO, profile_root, profiles


def _settings(argv, monkeypatch, env=None):
    for key in [k for k in os.environ if k.startswith("SYSDRA_")]:
        monkeypatch.delenv(key)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    return settings_from_args(cli.build_parser().parse_args(["run", *argv]))


def test_flags_beat_environment_beat_config_file(tmp_path, monkeypatch):
    config = tmp_path / "config.yaml"
    config.write_text("debounce: 0.3\nresyncInterval: 60\nnode-name: from-file\ndriver_name: file.example.com\npf_vf_exclusive: true\n")
    env = {"SYSDRA_DEBOUNCE": "0.2", "SYSDRA_NODE_NAME": "from-env"}
    s = _settings(["--config", str(config), "--debounce", "0.1", "--cluster", "dir:/tmp/x"], monkeypatch, env)
    assert s.debounce == 0.1  # flag
    assert s.node_name == "from-env"  # environment over file
    assert s.resync_interval == 60 and s.driver_name == "file.example.com" and s.pf_vf_exclusive  # file over defaults
    assert s.cluster_dir == "/tmp/x" and s.list_attributes is False  # default


def test_switch_flags(tmp_path, monkeypatch):
    s = _settings(["--config", _empty_config(tmp_path), "--list-attributes", "--pf-vf-exclusive"], monkeypatch)
    assert s.list_attributes and s.pf_vf_exclusive


@pytest.mark.parametrize("argv,env,setting", [
    (["--debounce", "-1"], {}, "debounce"),
    (["--resync-interval", "soon"], {}, "resync-interval"),
    (["--cluster", "etcd"], {}, "cluster"),
    (["--root", "relative/path"], {}, "root"),
    ([], {"SYSDRA_DRIVER_NAME": "Not_A_Domain"}, "driver-name"),
])
def test_bad_value_exits_78_naming_the_setting(argv, env, setting, monkeypatch, capsys, tmp_path):
    for key in [k for k in os.environ if k.startswith("SYSDRA_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code = cli.main(["run", "--config", _empty_config(tmp_path), *argv])
    assert code == EX_CONFIG
    assert setting in capsys.readouterr().err


def _empty_config(tmp_path) -> str:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    return str(path)


def test_run_offline_publishes_then_stops_on_sigterm(tmp_path):
    if "server-2s-gpu-nic" not in profiles():
        pytest.skip("fixture profile server-2s-gpu-nic not generated yet")
    cluster = tmp_path / "cluster"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYSDRA_")}
    env["SYSDRA_METRICS_ADDRESS"] = ""
    cmd = [sys.executable, "-m", "agent", "run", "--config", _empty_config(tmp_path), "--root", profile_root("server-2s-gpu-nic"),
           "--node-name", "node-a", "--cluster", f"dir:{cluster}", "--kubelet-dir", str(tmp_path / "kubelet"),
           "--cdi-dir", str(tmp_path / "cdi"), "--debounce", "0.05"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        files, sockets = [], []
        # slices go out first, the kubelet side starts after them: SIGTERM once both are up
        while not (files and sockets) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
            files = glob.glob(str(cluster / "resourceslices" / "*.json"))
            sockets = glob.glob(str(tmp_path / "kubelet" / "plugins_registry" / "*.sock"))
        assert files, proc.stderr.read() if proc.poll() is not None else "no slices published"
        assert sockets, "the registration socket never appeared"
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    (path,) = files
    obj = json.loads(open(path).read())
    kubernetes_validate.validate(obj, "1.37", strict=True)
    assert obj["spec"]["nodeName"] == "node-a" and len(obj["spec"]["devices"]) == 12
    assert "stopping" in err
