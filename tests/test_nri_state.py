"""Whether NRI works is never silent (docs/networking.md, "Is NRI working?"): the plugin's state
(connecting, registered, failed with the reason) over the real NRI protocol (the runtime's side is
tests/nri_standin.py; tests/test_realnode_nic.py has containerd's own), its log lines (a WARNING
the first time, then rate-limited), and in a real `sysdra run`: `sysdra status`, the
`sysdra_nri_connected` metric, a NIC claim prepared while NRI is not registered (logged, named in
status and doctor), then the runtime's NRI socket served and the plugin registered."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from agent.nri import plugin as nri_plugin
from agent.nri.plugin import NriPlugin
from agent.nri.ttrpc import RUNTIME_CONN, Endpoint
from tests.conftest import REPO
from tests.kubelet_standin import KubeletStandIn, claim
from tests.nri_standin import Runtime
from tests.test_agent_service import _agent, _free_port, _stop
from tests.test_node_operations import _wait
from tests.test_nri_protocol import Recorder
from tests.test_nri_netdev import nets  # noqa: F401  (the fixture)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def _running(plugin: NriPlugin):
    task = asyncio.get_running_loop().create_task(plugin.run())
    return task


async def _stopped(task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "agent.nri.plugin" and r.levelno == logging.WARNING]


def test_an_absent_socket_then_the_runtime_comes(tmp_path, caplog):
    """No socket: failed with the reason, one WARNING however often it is tried, reported at each
    change; then the runtime serves it: registered (INFO, with the failed attempts), reported."""
    caplog.set_level(logging.DEBUG, logger="agent.nri.plugin")
    path = str(tmp_path / "nri.sock")
    reports: list[dict] = []

    async def main():
        plugin = NriPlugin(path, Recorder(), on_state=reports.append)
        task = await _running(plugin)
        try:
            await plugin.wait_for(lambda s: s.failures >= 3)  # 0.5 s, 1 s, 2 s apart
            assert plugin.state.phase == "failed" and f"no NRI socket at {path}" in plugin.state.reason
            assert reports[0]["state"] == "connecting" and reports[-1]["state"] == "failed"
            assert reports[-1]["failedAttempts"] >= 3 and reports[-1]["socket"] == path
            assert len(_warnings(caplog)) == 1 and "claimed NICs' netdevs stay on the host" in _warnings(caplog)[0]
            runtime = Runtime(path)
            await runtime.start()
            try:
                await plugin.wait_for(lambda s: s.phase == "registered" and s.synchronized)
                assert reports[-1]["state"] == "registered" and reports[-1]["reason"] is None
                assert reports[-1]["runtime"] == "test 1" and reports[-1]["failedAttempts"] == 0
                assert any("registered as 50-sysdra" in r.getMessage() and "failed attempts" in r.getMessage()
                           for r in caplog.records)
            finally:
                await runtime.stop()
            await plugin.wait_for(lambda s: s.phase == "failed")  # the runtime went: said at once
            assert "closed the connection" in plugin.state.reason or "lost" in plugin.state.reason
            assert len(_warnings(caplog)) == 2
        finally:
            await _stopped(task)

    run(main())


def test_a_refusing_socket_and_the_warning_repeated_after_a_while(tmp_path, caplog):
    """A socket file nobody listens on (a runtime that died): refused. The same failure is logged
    again only after WARN_EVERY, with how many attempts failed meanwhile."""
    caplog.set_level(logging.INFO, logger="agent.nri.plugin")
    path = str(tmp_path / "nri.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()

    async def main():
        plugin = NriPlugin(path, Recorder())
        now = [1000.0]
        plugin.clock = lambda: now[0]
        task = await _running(plugin)
        try:
            await plugin.wait_for(lambda s: s.failures >= 2)
            assert "refused: nobody serves it" in plugin.state.reason and len(_warnings(caplog)) == 1
            now[0] += nri_plugin.WARN_EVERY
            n = plugin.state.failures
            await plugin.wait_for(lambda s: s.failures > n)
            assert len(_warnings(caplog)) == 2 and "attempts failed before" in _warnings(caplog)[1]
        finally:
            await _stopped(task)

    run(main())


def test_a_refused_registration_says_the_runtimes_reason(tmp_path):
    path = str(tmp_path / "nri.sock")

    async def refuse(payload: bytes):
        raise ValueError("plugin index 50 is taken")

    async def accept(reader, writer):
        await Endpoint(reader, writer, {(RUNTIME_CONN, f"{nri_plugin.PKG}.Runtime/RegisterPlugin"): refuse}).serve()

    async def main():
        server = await asyncio.start_unix_server(accept, path)
        plugin = NriPlugin(path, Recorder())
        task = await _running(plugin)
        try:
            await plugin.wait_for(lambda s: s.phase == "failed")
            assert plugin.state.reason.startswith(f"registration on {path} refused") and "index 50 is taken" in plugin.state.reason
        finally:
            await _stopped(task)
            server.close()

    run(main())


# --- the real agent ------------------------------------------------------------------------------
def _nri_connected(port: int, name: str = "sysdra_nri_connected") -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def _cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "agent", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    return out.stdout


def _until(probe, proc, what: str):
    return _wait(what, probe, proc)


def test_the_agent_says_whether_nri_works(tmp_path):
    nic = "nic-0000-1a-00-0"
    sock = str(tmp_path / "nri" / "nri.sock")
    os.makedirs(os.path.dirname(sock))
    port = _free_port()
    config = tmp_path / "config.yaml"
    config.write_text(f"metrics_address: 127.0.0.1:{port}\nnri_socket: {sock}\n")
    kubelet_dir = tmp_path / "kubelet"
    c = claim("net-0", [("net1", nic)], namespace="ml", pool="node-a")
    path = os.path.join(tmp_path / "cluster", "resourceclaims", "ml", "net-0.json")
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        json.dump(c, f)
    status = ["status", "-o", "json", "--kubelet-dir", str(kubelet_dir)]
    doctor = ["doctor", "-o", "json", "--kubelet-dir", str(kubelet_dir), "--cluster", f"dir:{tmp_path / 'cluster'}",
              "--no-api", "--config", str(config)]
    proc = _agent(tmp_path, str(config), {})
    runtime = None
    try:
        doc = _until(lambda: (d := json.loads(_cli(*status) or "null")) and d["nri"]["state"] == "failed" and d,
                     proc, "NRI failed")
        assert f"no NRI socket at {sock}" in doc["nri"]["reason"] and _nri_connected(port) == 0
        assert _nri_connected(port, "sysdra_nri_claims_waiting") == 0  # failed, but no claim waits (no alert)
        kubelet = KubeletStandIn(str(kubelet_dir / "plugins_registry"))

        async def prepare():
            await kubelet.register()
            resp = await kubelet.prepare(c)
            assert resp.claims[c["metadata"]["uid"]].error == ""

        asyncio.run(prepare())
        doc = _until(lambda: (d := json.loads(_cli(*status))) and d["nri"]["claimsWaiting"] and d, proc, "the claim named")
        (waiting,) = doc["nri"]["claimsWaiting"]
        assert (waiting["namespace"], waiting["name"], waiting["uid"]) == ("ml", "net-0", c["metadata"]["uid"])
        assert _nri_connected(port, "sysdra_nri_claims_waiting") == 1  # SysdraNetdevsWaitForNri
        assert "ml/net-0 (" in _cli(*status[:1], *status[3:]) and "stay on the host" in _cli(*status[:1], *status[3:])
        (finding,) = [f for f in json.loads(_cli(*doctor)) if f["check"] == "nri"]
        assert finding["level"] == "fail" and "ml/net-0" in finding["message"] and "disable = false" in finding["fix"]
        runtime = subprocess.Popen([sys.executable, "-m", "tests.nri_standin", sock, "uid-none", "/run/netns/none"], cwd=REPO,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert json.loads(runtime.stdout.readline()) == {"registered": ""}
        doc = _until(lambda: (d := json.loads(_cli(*status))) and d["nri"]["state"] == "registered" and d, proc, "registered")
        assert doc["nri"]["claimsWaiting"] == [] and doc["nri"]["socket"] == sock and _nri_connected(port) == 1
        assert _nri_connected(port, "sysdra_nri_claims_waiting") == 0
        (finding,) = [f for f in json.loads(_cli(*doctor)) if f["check"] == "nri"]
        assert finding["level"] == "ok"
    finally:
        if runtime is not None:
            runtime.stdin.close()
            runtime.wait(30)
        err = _stop(proc)
    lines = [line for line in err.splitlines() if "NRI: no NRI socket" in line]
    assert len(lines) == 1 and "WARNING" in lines[0], err  # once, however often it was tried
    told = [line for line in err.splitlines() if "claim ml/net-0 prepared with netdev(s)" in line]
    assert len(told) == 1 and "WARNING" in told[0] and "NRI is failed" in told[0], err


def test_the_board_and_metrics_follow_the_plugin(caplog):
    """Without NRI (nri_socket ""): disabled, 0; a NIC claim prepared meanwhile is named (INFO:
    the operator chose it); registered: 1 and nothing waits; the text of `sysdra status`."""
    from agent.cli.status import render_text
    from agent.service.metrics import Metrics
    from agent.service.status import StatusBoard

    metrics = Metrics(process=False, bridge_global=False)
    board = StatusBoard("node-a", "sysdra.io", metrics=metrics)

    def sample(name: str, **labels) -> float:
        return metrics.registry.get_sample_value(name, labels or None)

    assert board.snapshot()["nri"]["state"] == "disabled" and sample("sysdra_nri_connected") == 0
    assert sample("sysdra_nri", sysdra_nri="disabled") == 1
    caplog.set_level(logging.INFO, logger="sysdra.daemon")
    entry = {"namespace": "ml", "name": "net-0", "state": "PrepareCompleted", "devices": [{"device": "nic-0"}],
             "netdevs": [{"device": "nic-0", "request": "net1", "host": "ens1f0", "pod": "net1"},
                         {"device": "nic-1", "request": "net1", "host": "ens2f0", "pod": "net2", "state": "in-pod"}]}
    board.set_prepared_claims({"u1": entry, "u2": {**entry, "name": "gpu-0", "netdevs": []}})
    board.set_prepared_claims({"u1": entry})  # told once
    (told,) = [r for r in caplog.records if "prepared with netdev(s)" in r.getMessage()]
    assert told.levelno == logging.INFO and "ml/net-0" in told.getMessage() and "ens1f0" in told.getMessage()
    assert board.snapshot()["nri"]["claimsWaiting"] == [{"uid": "u1", "namespace": "ml", "name": "net-0", "netdevs": ["ens1f0"]}]
    text = render_text(board.snapshot())
    assert "nri:          disabled: nri_socket is empty\n" in text and "ml/net-0 (u1): netdev(s) ens1f0 stay on the host" in text
    board.set_nri({"state": "registered", "reason": None, "since": 1.0, "socket": "/s", "runtime": "containerd v2.4.2"})
    assert board.snapshot()["nri"]["claimsWaiting"] == [] and sample("sysdra_nri_connected") == 1
    assert sample("sysdra_nri", sysdra_nri="registered") == 1 and sample("sysdra_nri", sysdra_nri="disabled") == 0
    assert "nri:          registered with containerd v2.4.2 on /s" in render_text(board.snapshot())
    board.set_nri({"state": "failed", "reason": "no NRI socket at /s", "since": 2.0, "socket": "/s"})
    assert sample("sysdra_nri_connected") == 0 and board.snapshot()["lastError"]["where"] == "nri"
    assert board.summary().endswith("; NRI failed (sysdra status)")
    assert [r.levelno for r in caplog.records if "prepared with netdev(s)" in r.getMessage()] == [logging.INFO]


def test_a_claim_prepared_again_while_nri_is_away_is_named_again(caplog):
    """A ResourceClaim the pods of a Job use one after another is unprepared and prepared again
    under its UID: each prepare while NRI is away is news (and the board keeps no claim it no
    longer has: NIC claims come and go for months on a node with NRI off)."""
    from agent.service.status import StatusBoard

    board = StatusBoard("node-a", "sysdra.io")
    board.set_nri({"state": "failed", "reason": "no NRI socket at /s", "since": 1.0, "socket": "/s"})
    caplog.set_level(logging.INFO, logger="sysdra.daemon")
    entry = {"namespace": "ml", "name": "net-0", "state": "PrepareCompleted", "devices": [{"device": "nic-0"}],
             "netdevs": [{"device": "nic-0", "request": "net1", "host": "ens1f0", "pod": "net1"}]}
    for _ in range(2):
        board.set_prepared_claims({"u1": entry})
        board.set_prepared_claims({"u1": entry})  # (saved again by the same prepare: once)
        board.set_prepared_claims({})  # unprepared
    assert [r.levelno for r in caplog.records if "ml/net-0 prepared with netdev(s)" in r.getMessage()] == [logging.WARNING] * 2


def test_netdevs_in_their_pods_do_not_wait_for_nri_when_it_goes(tmp_path, nets):
    """The board learns each move as it is saved (the mover's ``on_saved``), so an NRI connection
    lost later counts only the claims whose netdevs are still on the host; NRI off on purpose
    (``nri_socket: ""``) counts none in the metric. Real kernel namespaces (tests/test_nri_netdev.py)."""
    from agent.prepare.checkpoint import Checkpoint
    from agent.service.metrics import Metrics
    from agent.service.status import StatusBoard
    from tests.test_nri_netdev import mover, pod, run, write_checkpoint

    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    metrics = Metrics(process=False)
    board = StatusBoard("node-a", "sysdra.io", metrics=metrics)
    board.set_prepared_claims(Checkpoint.load(str(tmp_path / "checkpoint.json")).claims)  # as prepare left them
    waiting = lambda: metrics.registry.get_sample_value("sysdra_nri_claims_waiting")  # noqa: E731
    board.set_nri({"state": "registered", "socket": "/run/nri.sock"})
    run(mover(tmp_path, nets, on_saved=board.set_prepared_claims).pod_started(pod(nets)))
    board.set_nri({"state": "failed", "reason": "connection to /run/nri.sock lost"})
    assert board.nri_waiting == [] and waiting() == 0  # the netdev is in its pod
    run(mover(tmp_path, nets, on_saved=board.set_prepared_claims).pod_stopped(pod(nets)))
    assert [c["netdevs"] for c in board.nri_waiting] == [[nets.nic]] and waiting() == 1  # back: its next sandbox waits
    board.set_nri({"state": "disabled", "reason": "nri_socket is empty"})
    assert board.nri_waiting and waiting() == 0  # NRI off on purpose: no alert (sysdra status still lists it)
