"""`sysdra run`'s start-up order, seen from inside a real agent process: the first slices are
written before anything the kubelet side needs is even imported (gRPC, the kubelet plugin,
health), the YAML parser is not loaded for an empty config file, nor prometheus_client without a
metrics endpoint, nor libcurl (the API client's) with an offline cluster directory, and the kubelet's registration socket appears only after the first publish
(publishing to a directory; to the API it comes first: tests/test_startup_registration.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO, profile_root

SCENARIO = r"""
import glob, json, os, signal, sys, threading, time

from agent.publish import dirstore

kubelet, cluster, config, root = sys.argv[1:5]
registry = os.path.join(kubelet, "plugins_registry")
seen = {}
write = dirstore.DirStore._write


def first_write(self, obj):
    if "at_first_slice" not in seen:
        seen["at_first_slice"] = {
            "loaded": sorted(m for m in ("grpc", "yaml", "prometheus_client", "agent.kubeletplugin.plugin",
                                                  "agent.health", "agent.prepare.driver")
                             if m in sys.modules),
            "registration_socket": bool(glob.glob(os.path.join(registry, "*.sock"))),
        }
    return write(self, obj)


dirstore.DirStore._write = first_write


def stop_once_registered():
    deadline = time.monotonic() + 30
    while not glob.glob(os.path.join(registry, "*.sock")) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)
    seen["running"] = {"grpc_loaded": "grpc" in sys.modules,
                       "prometheus_loaded": "prometheus_client" in sys.modules, "curl_loaded": "pycurl" in sys.modules}
    os.kill(os.getpid(), signal.SIGTERM)


threading.Thread(target=stop_once_registered, daemon=True).start()
from agent.cli.main import main

rc = main(["run", "--config", config, "--root", root, "--node-name", "node-a", "--cluster", "dir:" + cluster,
           "--kubelet-dir", kubelet, "--cdi-dir", os.path.join(os.path.dirname(kubelet), "cdi"), "--metrics-address", ""])
print(json.dumps(seen))
sys.exit(rc)
"""


def test_first_publish_comes_before_the_kubelet_side_is_loaded(tmp_path):
    config = tmp_path / "empty.yaml"
    config.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYSDRA_")}
    proc = subprocess.run([sys.executable, "-c", SCENARIO, str(tmp_path / "kubelet"), str(tmp_path / "cluster"),
                           str(config), profile_root("server-2s-gpu-nic")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    first = seen["at_first_slice"]
    assert first["loaded"] == [], f"loaded before the first publish: {first['loaded']}"
    assert first["registration_socket"] is False, "the kubelet could register before the first publish"
    assert seen["running"] == {"grpc_loaded": True, "prometheus_loaded": False, "curl_loaded": False}


def test_sigterm_while_the_grpc_servers_start_stops_cleanly(tmp_path, monkeypatch):
    """A stop that lands inside grpc.aio's server start: the kubelet side is let finish its
    start and is then stopped in order (cancelling that start broke gRPC's own shutdown)."""
    import asyncio
    import glob

    from agent.kubeletplugin import plugin
    from agent.service.daemon import Agent
    from tests.kubelet_standin import settings_for

    settings = settings_for(str(tmp_path), root=profile_root("server-2s-gpu-nic"), metrics_address="")
    stop = asyncio.Event()
    start = plugin._Server.start

    async def start_then_stop(self, add_services):
        stop.set()  # SIGTERM now, while the server starts
        await start(self, add_services)

    monkeypatch.setattr(plugin._Server, "start", start_then_stop)

    async def main():
        return await asyncio.wait_for(Agent(settings).run(stop), 60)

    assert asyncio.run(main()) == 0
    assert not glob.glob(os.path.join(settings.registry_dir, "*.sock")) and not os.path.exists(
        os.path.join(settings.plugin_dir, "dra.sock"))


def test_api_mode_without_a_kubeconfig_exits_78_with_one_line(tmp_path):
    """No kubeconfig yet (installed as a step of its own) and no in-cluster account: a config
    error systemd does not restart in a loop, one line saying what is missing, no traceback."""
    import subprocess
    import sys

    from tests.conftest import REPO, profile_root

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SYSDRA_", "KUBERNETES_"))}
    env.update(KUBECONFIG=str(tmp_path / "absent.kubeconfig"), HOME=str(tmp_path))
    argv = [sys.executable, "-m", "agent", "run", "--config", os.devnull, "--root", profile_root("vm-numa-none"),
            "--node-name", "n", "--cluster", "kube", "--kubelet-dir", str(tmp_path / "k"), "--cdi-dir", str(tmp_path / "cdi"),
            "--metrics-address", ""]
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 78, out.stderr
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("sysdra:")]
    assert "the API server's connection settings" in line and "absent.kubeconfig" in line
    assert "Traceback" not in out.stderr
