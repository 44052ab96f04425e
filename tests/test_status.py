"""StatusBoard served over a real unix socket; `sysdra status` against it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import socket
import stat
import threading

import psutil
import pytest

from agent.cli.main import main as cli_main
from agent.service.status import AgentNotRunning, StatusBoard, StatusServer, query_status, resolve_status_socket
from discovery.inventory import scan
from tests.conftest import profile_root


class _Serving:
    """Run a StatusServer on a private loop in a thread so blocking clients can talk to it."""

    def __init__(self, board: StatusBoard, path: str):
        self.board, self.path = board, path
        self.loop = asyncio.new_event_loop()
        self.server = StatusServer(board, path)

    def __enter__(self):
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(5)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def board():
    inv = scan(profile_root("server-2s-gpu-nic"))
    b = StatusBoard("node-a", "sysdra.io", clock=lambda: 1000.0)
    b.set_registration("registered")
    b.set_inventory(inv, health={inv.devices[0].name: "unhealthy"})
    b.set_prepared_claims({"uid-1": {"namespace": "ns", "name": "c1", "state": "PrepareCompleted",
                                     "devices": [{"device": inv.devices[0].name}]}})
    b.record_publish(True, devices=len(inv.devices), slices=1)
    b.record_error("prepare", "claim ns/c2: device gone")
    return b, inv


def test_snapshot_over_socket_mode_0600(tmp_path, board):
    b, inv = board
    path = str(tmp_path / "status.sock")
    with _Serving(b, path):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        s = query_status(path)
    assert not os.path.exists(path)  # removed on close
    assert s["registration"]["state"] == "registered"
    assert s["devices"]["total"] == len(inv.devices)
    assert sum(s["devices"]["byHealth"].values()) == len(inv.devices) and s["devices"]["byHealth"]["unhealthy"] == 1
    assert s["preparedClaims"]["count"] == 1 and s["preparedClaims"]["claims"][0]["name"] == "c1"
    assert s["lastPublish"]["result"] == "ok"
    assert s["lastError"]["where"] == "prepare"
    assert b.summary().startswith(f"registered; {len(inv.devices)} devices (")


def test_cli_text_and_json(tmp_path, board, capsys):
    b, inv = board
    path = str(tmp_path / "status.sock")
    with _Serving(b, path):
        assert cli_main(["status", "--socket", path]) == 0
        text = capsys.readouterr().out
        assert cli_main(["status", "--socket", path, "-o", "json"]) == 0
        doc = json.loads(capsys.readouterr().out)
    assert "registration: registered" in text and "ns/c1 (uid-1)" in text
    assert "last error:   prepare: claim ns/c2: device gone" in text
    for kind, n in doc["devices"]["byKind"].items():
        assert f"{kind} {n}" in text
    proc = doc["process"]  # this test process serves the socket: its own figures, as psutil reads them
    me = psutil.Process()
    assert proc["startTime"] == me.create_time() and proc["maxFds"] == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert proc["rssBytes"] > 0 and proc["threads"] >= 2 and 0 < proc["openFds"] <= proc["maxFds"]
    assert re.search(rf"process: +[0-9.]+ MB resident, [0-9.]+ s CPU, \d+ threads, \d+ of {proc['maxFds']} file descriptors",
                     text)  # (an earlier query than the JSON one: the counts may differ)


@pytest.mark.parametrize("bad", ["0", "-1", "x", "nan", "3601"])
def test_cli_timeout_must_be_seconds(bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["status", "--timeout", bad])
    assert exit_.value.code == 2 and "not a number of seconds" in capsys.readouterr().err


def test_cli_agent_not_running(tmp_path, capsys):
    assert cli_main(["status", "--socket", str(tmp_path / "none.sock")]) == 1
    assert "is the agent running" in capsys.readouterr().err
    # a stale socket file (agent crashed)
    stale = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(stale)
    s.close()
    with pytest.raises(AgentNotRunning, match="not running"):
        query_status(stale)


def test_stale_socket_replaced_but_not_other_files(tmp_path, board):
    b, _ = board
    stale = str(tmp_path / "status.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(stale)
    s.close()
    with _Serving(b, stale):
        assert query_status(stale)["nodeName"] == "node-a"
    regular = tmp_path / "file.sock"
    regular.write_text("x")
    with pytest.raises(OSError, match="not a socket"):
        asyncio.run(StatusServer(b, str(regular)).start())
    assert regular.read_text() == "x"


def test_socket_path_resolution(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("kubelet_dir: /k\ndriver_name: x.io\n")
    assert resolve_status_socket(config_file=str(cfg), environ={}) == "/k/plugins/x.io/status.sock"
    assert resolve_status_socket(kubelet_dir="/f", config_file=str(cfg), environ={}) == "/f/plugins/x.io/status.sock"
    assert resolve_status_socket(config_file=str(cfg), environ={"SYSDRA_STATUS_SOCKET": "/s.sock"}) == "/s.sock"
    assert resolve_status_socket("/flag.sock", config_file=str(cfg), environ={}) == "/flag.sock"


def test_board_feeds_metrics():
    from agent.service.metrics import Metrics

    m = Metrics(process=False, bridge_global=False)
    b = StatusBoard(metrics=m)
    b.set_registration("waiting")
    assert m.registry.get_sample_value("sysdra_registration", {"sysdra_registration": "waiting"}) == 1
