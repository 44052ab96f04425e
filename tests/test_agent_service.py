"""The whole agent as systemd runs it: sd_notify order, status socket, metrics, SIGHUP."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import REPO, profile_root
from tests.notify_socket import NotifySocket


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(tmp_path, config: str, extra_env: dict, *flags: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYSDRA_")}
    env.update(extra_env)
    cmd = [sys.executable, "-m", "agent", "run", "--config", config, "--root", profile_root("server-2s-gpu-nic"),
           "--node-name", "node-a", "--cluster", f"dir:{tmp_path / 'cluster'}", "--kubelet-dir", str(tmp_path / "kubelet"),
           "--cdi-dir", str(tmp_path / "cdi"), *flags]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return err


def test_notify_order_status_and_metrics(tmp_path):
    config = tmp_path / "config.yaml"
    port = _free_port()
    config.write_text(f"metrics_address: 127.0.0.1:{port}\n")
    with NotifySocket() as ns:
        proc = _agent(tmp_path, str(config), ns.env(watchdog_sec=1))
        try:
            ns.wait_for("READY=1", timeout=30)
            ns.wait_for("WATCHDOG=1", timeout=5)
            # the DRA and registration sockets exist once READY=1 was sent
            assert os.path.exists(tmp_path / "kubelet/plugins/sysdra.io/dra.sock")
            assert os.path.exists(tmp_path / "kubelet/plugins_registry/sysdra.io-reg.sock")
            status = subprocess.run([sys.executable, "-m", "agent", "status", "--kubelet-dir", str(tmp_path / "kubelet"),
                                     "-o", "json"], cwd=REPO, capture_output=True, text=True, timeout=10)
            assert status.returncode == 0, status.stderr
            data = json.loads(status.stdout)
            assert data["registration"]["state"] == "waiting"  # no kubelet here
            assert data["devices"]["total"] == 12 and data["devices"]["byKind"] == {"gpu": 8, "nic": 4}
            assert data["lastPublish"]["result"] == "ok"
            assert data["lastPublish"]["devices"] == 12 and data["lastPublish"]["slices"] == 1
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            assert 'sysdra_published_devices{kind="gpu"} 8.0' in body
            assert "sysdra_slice_publish_attempts_total" in body
        finally:
            err = _stop(proc)
        assert proc.returncode == 0, err
        keys = ns.keys()
        last = ns.messages[-1]
    # READY (with its STATUS) first, watchdog pings while running, STOPPING in the last datagram
    assert keys[0] == "READY" and "STATUS" in keys and "WATCHDOG" in keys, keys
    assert keys.index("READY") < keys.index("WATCHDOG") < keys.index("STOPPING"), keys
    assert "STOPPING=1" in last.split("\n"), last


def test_sighup_applies_live_settings_and_keeps_others(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("metrics_address: ''\nresync_interval: 300\n")
    with NotifySocket() as ns:
        proc = _agent(tmp_path, str(config), ns.env())
        try:
            ns.wait_for("READY=1", timeout=30)
            config.write_text("metrics_address: ''\nresync_interval: 42\ndriver_name: other.example.com\nlog_level: debug\n")
            proc.send_signal(signal.SIGHUP)
            time.sleep(1.0)
            assert proc.poll() is None, "SIGHUP must not stop the agent"
            config.write_text("metrics_address: ''\nresync_interval: -3\n")
            proc.send_signal(signal.SIGHUP)
            time.sleep(1.0)
            assert proc.poll() is None, "a bad config on SIGHUP must not stop the agent"
        finally:
            err = _stop(proc)
    assert "SIGHUP: applied" in err and "resync_interval=42.0" in err
    assert "SIGHUP: driver_name changed but need a restart" in err
    assert "new configuration rejected" in err and "resync-interval" in err


def test_scan_slices_output_is_a_valid_list():
    import kubernetes_validate

    out = subprocess.run([sys.executable, "-m", "agent", "scan", "--root", profile_root("sriov-nic"), "-o", "slices",
                          "--node-name", "node-a"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["kind"] == "List" and data["items"]
    names = []
    for item in data["items"]:
        kubernetes_validate.validate(item, "1.37", strict=True)
        assert item["spec"]["nodeName"] == "node-a"
        names += [d["name"] for d in item["spec"]["devices"]]
    assert len(names) == len(set(names))


def test_taint_unhealthy_follows_link_state(tmp_path):
    """--taint-unhealthy: a NIC losing carrier gets a NoSchedule taint in its slice; it goes on
    recovery, once the taint's hold (a second here; held while it lasts: tests/test_health.py) ends."""
    import glob
    import shutil

    import kubernetes_validate

    root = tmp_path / "root"
    shutil.copytree(profile_root("server-2s-gpu-nic"), root, symlinks=True)
    nic_net = glob.glob(str(root / "sys/bus/pci/devices/0000:1a:00.0/net/*"))[0]
    cluster = tmp_path / "cluster"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYSDRA_")}
    (tmp_path / "config.yaml").write_text("taintHold: 1\n")
    cmd = [sys.executable, "-m", "agent", "run", "--config", str(tmp_path / "config.yaml"), "--root", str(root), "--node-name", "node-a",
           "--cluster", f"dir:{cluster}", "--kubelet-dir", str(tmp_path / "kubelet"), "--cdi-dir", str(tmp_path / "cdi"),
           "--metrics-address", "", "--health-interval", "0.5", "--taint-unhealthy"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def taints() -> dict | None:
        out = {}
        try:
            for path in glob.glob(str(cluster / "resourceslices" / "*.json")):
                obj = json.load(open(path))
                for d in obj["spec"].get("devices", []):
                    out[d["name"]] = d.get("taints")
        except (OSError, ValueError):
            return None
        return out or None

    def wait(pred, what):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            t = taints()
            if t is not None and pred(t):
                return t
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
        pytest.fail(f"timed out waiting for {what}: {taints()}")

    try:
        wait(lambda t: "nic-0000-1a-00-0" in t and not t["nic-0000-1a-00-0"], "first publish")
        with open(os.path.join(nic_net, "carrier"), "w") as f:
            f.write("0\n")
        t = wait(lambda t: t.get("nic-0000-1a-00-0"), "the taint")
        (taint,) = t["nic-0000-1a-00-0"]
        assert taint["key"] == "sysdra.io/unhealthy" and taint["effect"] == "NoSchedule" and taint["value"]
        for path in glob.glob(str(cluster / "resourceslices" / "*.json")):
            obj = json.load(open(path))
            kubernetes_validate.validate(obj, "1.37", strict=True)
            assert len(obj["spec"]["devices"]) <= 64 or not any(d.get("taints") for d in obj["spec"]["devices"])
        with open(os.path.join(nic_net, "carrier"), "w") as f:
            f.write("1\n")
        wait(lambda t: not t.get("nic-0000-1a-00-0"), "the taint to go")
    finally:
        err = _stop(proc)
    assert proc.returncode == 0, err
