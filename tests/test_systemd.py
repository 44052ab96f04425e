"""systemd integration: the unit verifies and is hardened, install.sh stages everything,
the example config covers every setting, and sd_notify messages arrive in order."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from agent.service import sdnotify
from agent.settings import FIELDS, build_settings
from tests.conftest import REPO, require_root, require_tool
from tests.notify_socket import NotifySocket

SYSTEMD = os.path.join(REPO, "systemd")
UNIT = os.path.join(SYSTEMD, "sysdra.service")
MAX_EXPOSURE = 3.5


def _directives(path: str) -> list[tuple[str, str]]:
    out = []
    for line in open(path, encoding="utf-8"):
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, _, value = line.partition("=")
            out.append((key.strip(), value.strip()))
    return out


@pytest.fixture
def installed(tmp_path):
    """install.sh into a staging root, ExecStart pointing at this checkout's real `sysdra`."""
    binary = os.path.join(os.path.dirname(sys.executable), "sysdra")
    if not os.access(binary, os.X_OK):
        pytest.skip(f"{binary} missing: install the package (make venv)")
    env = {**os.environ, "DESTDIR": str(tmp_path), "SYSDRA_BIN": binary}
    subprocess.run(["sh", os.path.join(SYSTEMD, "install.sh")], env=env, check=True, capture_output=True)
    return tmp_path, binary


def test_install_stages_unit_tmpfiles_and_config(installed):
    root, binary = installed
    unit = root / "etc/systemd/system/sysdra.service"
    assert (root / "etc/tmpfiles.d/sysdra.conf").is_file()
    assert (root / "etc/sysdra/config.yaml").read_text() == open(os.path.join(SYSTEMD, "config.yaml")).read()
    assert dict(_directives(str(unit)))["ExecStart"] == f"{binary} run --config /etc/sysdra/config.yaml"
    # a second install keeps the operator's config
    (root / "etc/sysdra/config.yaml").write_text("log_level: debug\n")
    env = {**os.environ, "DESTDIR": str(root), "SYSDRA_BIN": binary}
    subprocess.run(["sh", os.path.join(SYSTEMD, "install.sh")], env=env, check=True, capture_output=True)
    assert (root / "etc/sysdra/config.yaml").read_text() == "log_level: debug\n"
    assert (root / "etc/sysdra/config.yaml.example").is_file()


def test_unit_verifies(installed):
    tool = require_tool("systemd-analyze")
    root, _ = installed
    out = subprocess.run([tool, "verify", str(root / "etc/systemd/system/sysdra.service")], capture_output=True, text=True)
    assert out.returncode == 0 and not out.stderr.strip() and not out.stdout.strip(), out.stdout + out.stderr


def test_unit_exposure(installed):
    tool = require_tool("systemd-analyze")
    root, _ = installed
    out = subprocess.run([tool, "security", "--offline=true", str(root / "etc/systemd/system/sysdra.service")],
                         capture_output=True, text=True)
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", out.stdout)
    assert m, out.stdout + out.stderr
    assert float(m.group(1)) <= MAX_EXPOSURE, out.stdout


def test_unit_policy():
    d = _directives(UNIT)
    keys = dict(d)
    assert keys["Type"] == "notify" and keys["Restart"] == "on-failure"
    assert keys["RestartPreventExitStatus"].split() == ["78", "77", "65"] and keys["StartLimitIntervalSec"] == "0"
    assert "WatchdogSec" in keys and keys["ProtectSystem"] == "strict"
    assert "containerd.service" in keys["After"].split()
    for key in ("Requires", "BindsTo", "PartOf", "Requisite"):
        assert "kubelet.service" not in keys.get(key, ""), key
    assert "RuntimeDirectory" not in keys  # would delete /run/cdi specs on stop
    rw = keys["ReadWritePaths"].split()
    assert {"/run/cdi", "/var/lib/kubelet/plugins", "/var/lib/kubelet/plugins_registry"} <= set(rw)
    assert set(keys["RestrictAddressFamilies"].split()) == {"AF_UNIX", "AF_NETLINK", "AF_INET", "AF_INET6"}
    assert keys.get("PrivateDevices", "no") == "no"  # stat() of /dev nodes must see the host
    # the MPS daemons (children in the unit's cgroup) outlive a stop or restart of the agent alone;
    # "mixed" and "control-group" would kill them
    assert keys["KillMode"] == "process"
    assert keys["DevicePolicy"] == "closed"
    assert [v for k, v in d if k == "DeviceAllow"] == ["char-nvidia-frontend rw", "char-nvidia-uvm rw", "char-nvidia-caps r"]
    # every ReadWritePaths entry is created by tmpfiles.d (a missing one fails the start with 226)
    tmpfiles = {line.split()[1] for line in open(os.path.join(SYSTEMD, "sysdra.tmpfiles.conf")) if line.startswith("d ")}
    assert set(rw) <= tmpfiles


# the options that give the unit a mount namespace of its own (whose mounts never reach the host)
MOUNT_NAMESPACE = {"ProtectSystem": "no", "ReadWritePaths": "", "ProtectHome": "no", "PrivateTmp": "no",
                   "ProtectKernelTunables": "no", "ProtectKernelModules": "no", "ProtectKernelLogs": "no",
                   "ProtectControlGroups": "no", "ProtectProc": "default"}


def test_the_mps_drop_in_widens_only_mps_nodes(tmp_path):
    """The base unit keeps its sandbox; the MPS drop-in (installed on request) adds what the shm
    tmpfs and the daemon's mount namespace need, and turns off exactly the settings that would
    keep the agent's mounts from the host (docs/sharing.md "MPS")."""
    base = dict(_directives(UNIT))
    assert base["CapabilityBoundingSet"] == "CAP_DAC_OVERRIDE" and base["RestrictNamespaces"] == "yes"
    assert all(base.get(k, "") != v for k, v in MOUNT_NAMESPACE.items())  # each is on in the base unit
    binary = os.path.join(os.path.dirname(sys.executable), "sysdra")
    env = {**os.environ, "DESTDIR": str(tmp_path), "SYSDRA_BIN": binary}
    subprocess.run(["sh", os.path.join(SYSTEMD, "install.sh")], env=env, check=True, capture_output=True)
    assert not (tmp_path / "etc/systemd/system/sysdra.service.d").exists()  # not by default
    subprocess.run(["sh", os.path.join(SYSTEMD, "install.sh")], env={**env, "SYSDRA_MPS": "1"}, check=True, capture_output=True)
    drop_in = tmp_path / "etc/systemd/system/sysdra.service.d/mps.conf"
    keys = dict(_directives(str(drop_in)))
    assert keys == {"CapabilityBoundingSet": "CAP_SYS_ADMIN", "RestrictNamespaces": "mnt", "SystemCallFilter": "@mount",
                    **MOUNT_NAMESPACE}


def test_the_unit_with_the_mps_drop_in_verifies(installed):
    tool = require_tool("systemd-analyze")
    root, binary = installed
    env = {**os.environ, "DESTDIR": str(root), "SYSDRA_BIN": binary, "SYSDRA_MPS": "1"}
    subprocess.run(["sh", os.path.join(SYSTEMD, "install.sh")], env=env, check=True, capture_output=True)
    out = subprocess.run([tool, "verify", str(root / "etc/systemd/system/sysdra.service")], capture_output=True, text=True)
    assert out.returncode == 0 and not out.stderr.strip() and not out.stdout.strip(), out.stdout + out.stderr


def test_tmpfiles_create_under_root(tmp_path):
    tool = require_tool("systemd-tmpfiles")
    require_root()  # it chowns to root
    conf = os.path.join(SYSTEMD, "sysdra.tmpfiles.conf")
    subprocess.run([tool, f"--root={tmp_path}", "--create", conf], check=True, capture_output=True)
    assert (tmp_path / "run/cdi").is_dir()
    assert (tmp_path / "var/lib/kubelet/plugins_registry").is_dir()
    assert oct((tmp_path / "run/cdi").stat().st_mode & 0o777) == "0o755"


def test_example_config_documents_every_setting(tmp_path):
    text = open(os.path.join(SYSTEMD, "config.yaml"), encoding="utf-8").read()
    documented = set(re.findall(r"^#(\w+):", text, re.M))
    assert documented == set(FIELDS)
    # the commented examples are themselves valid settings
    active = re.sub(r"^#(\w+:)", r"\1", text, flags=re.M)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(active)
    s = build_settings({}, config_file=str(cfg), environ={})
    assert s.metrics_address == "127.0.0.1:9478" and s.node_name == "worker-1"


# --- sd_notify ----------------------------------------------------------------------------
def test_notify_is_noop_without_socket(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.ready() is False
    assert sdnotify.watchdog_interval({}) is None


def test_watchdog_interval_from_env():
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 30.0
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}) == 30.0
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "junk"}) is None


@pytest.mark.parametrize("abstract", [False, True])
def test_notify_path_and_abstract_socket(monkeypatch, abstract):
    with NotifySocket(abstract=abstract) as ns:
        monkeypatch.setenv("NOTIFY_SOCKET", ns.address)
        assert sdnotify.status("two\nlines")
        ns.wait_for("STATUS=two lines", timeout=5)


# A small agent-shaped program: READY after local setup, STATUS, watchdog from the
# loop, STOPPING on SIGTERM. Blocking the loop for a while must stop the pings.
PROGRAM = r"""
import asyncio, signal, sys, time
from agent.service import sdnotify

async def main():
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    sdnotify.ready()
    sdnotify.status("registered; 3 devices (1 gpu, 2 nic); 0 claims prepared")
    task = sdnotify.start_watchdog()
    await asyncio.sleep(0.5)
    time.sleep(1.0)  # a stuck loop: no pings for a second
    print("unblocked", flush=True)
    await stop.wait()
    sdnotify.stopping()
    task.cancel()

asyncio.run(main())
"""


def test_notify_order_and_watchdog_from_loop():
    with NotifySocket() as ns:
        env = {**os.environ, **ns.env(watchdog_sec=0.2), "PYTHONPATH": REPO}
        proc = subprocess.Popen([sys.executable, "-c", PROGRAM], env=env, stdout=subprocess.PIPE, text=True)
        try:
            ns.wait_for("READY=1")
            ns.wait_for("WATCHDOG=1")
            assert proc.stdout.readline().strip() == "unblocked"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
        ns.wait_for("STOPPING=1")
        assert ns.keys() == ["READY", "STATUS", "WATCHDOG", "STOPPING"]
        assert "STATUS=registered; 3 devices (1 gpu, 2 nic); 0 claims prepared" in ns.assignments()
        assert ns.assignments().count("WATCHDOG=1") >= 3


def test_watchdog_stops_while_loop_blocks(monkeypatch):
    import asyncio

    with NotifySocket() as ns:
        monkeypatch.setenv("NOTIFY_SOCKET", ns.address)

        async def main():
            task = asyncio.get_running_loop().create_task(sdnotify.watchdog_loop(0.1))
            await asyncio.sleep(0.2)
            time.sleep(0.6)  # a blocked loop
            await asyncio.sleep(0.2)
            task.cancel()

        asyncio.run(main())
        time.sleep(0.1)
        pings = [t for t, m in zip(ns.arrivals, ns.messages) if m == "WATCHDOG=1"]
        gaps = [b - a for a, b in zip(pings, pings[1:])]
        assert len(pings) >= 4
        assert max(gaps) >= 0.5  # systemd would have seen the silence
        assert sorted(gaps)[len(gaps) // 2] < 0.2  # otherwise at half the interval


def test_the_nri_drop_in_adds_only_what_netdev_moves_need(installed):
    """Installed on request (SYSDRA_NRI=1): the capabilities and the network namespaces a move
    needs (docs/networking.md), nothing of the file-system sandbox; the unit with it verifies."""
    tool = require_tool("systemd-analyze")
    root, binary = installed
    env = {**os.environ, "DESTDIR": str(root), "SYSDRA_BIN": binary, "SYSDRA_NRI": "1"}
    subprocess.run(["sh", os.path.join(SYSTEMD, "install.sh")], env=env, check=True, capture_output=True)
    keys = dict(_directives(str(root / "etc/systemd/system/sysdra.service.d/nri.conf")))
    assert keys == {"CapabilityBoundingSet": "CAP_NET_ADMIN CAP_SYS_ADMIN CAP_SYS_PTRACE", "RestrictNamespaces": "net"}
    out = subprocess.run([tool, "verify", str(root / "etc/systemd/system/sysdra.service")], capture_output=True, text=True)
    assert out.returncode == 0 and not out.stderr.strip() and not out.stdout.strip(), out.stdout + out.stderr


def test_the_sysfs_drop_in_opens_only_sys(installed):
    """SYSDRA_SYSFS=1: /sys writable for VFIO and partition mode switches (the chart's
    sysfsWritable), no path setting (the MPS drop-in needs the unit without a mount namespace);
    CAP_SYS_PTRACE, to see which processes hold a device open before unbinding it."""
    tool = require_tool("systemd-analyze")
    root, binary = installed
    env = {**os.environ, "DESTDIR": str(root), "SYSDRA_BIN": binary, "SYSDRA_SYSFS": "1", "SYSDRA_MPS": "1", "SYSDRA_NRI": "1"}
    subprocess.run(["sh", os.path.join(SYSTEMD, "install.sh")], env=env, check=True, capture_output=True)
    assert dict(_directives(str(root / "etc/systemd/system/sysdra.service.d/sysfs.conf"))) == {
        "ProtectKernelTunables": "no", "CapabilityBoundingSet": "CAP_SYS_PTRACE"}
    out = subprocess.run([tool, "verify", str(root / "etc/systemd/system/sysdra.service")], capture_output=True, text=True)
    assert out.returncode == 0 and not out.stderr.strip() and not out.stdout.strip(), out.stdout + out.stderr
