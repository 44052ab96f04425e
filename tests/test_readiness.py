"""The DaemonSet's readinessProbe (deploy/helm/sysdra rendered by the real helm, and
deploy/daemonset.yaml) run as the kubelet runs it, a command in the agent's container, against a
real status socket: ready only once the kubelet has registered the agent. A surge update deletes
the old agent pod when the new one is ready, so a probe that passed on anything else (the NRI
plugin's own "registered", which may come first) left claims with no registered driver."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from agent.service.status import StatusBoard
from tests.conftest import REPO
from tests.helm import render
from tests.test_status import _Serving

POD_SOCKET = "/tmp/status.sock"  # the pod's --status-socket
ENV = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""), PYTHONPATH=REPO)


def _container(docs) -> dict:
    (ds,) = [d for d in docs if d and d["kind"] == "DaemonSet"]
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    return c


def _probes() -> dict[str, list[str]]:
    with open(os.path.join(REPO, "deploy", "daemonset.yaml")) as f:
        plain = _container(yaml.safe_load_all(f))
    chart = _container(yaml.safe_load_all(render()))
    return {"chart": chart["readinessProbe"]["exec"]["command"], "deploy": plain["readinessProbe"]["exec"]["command"]}


def _probe(command: list[str], socket: str) -> subprocess.CompletedProcess:
    assert sum(a.count(POD_SOCKET) for a in command) == 1
    command = [a.replace(POD_SOCKET, socket) for a in command]
    return subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=120)


@pytest.mark.parametrize("where", ["chart", "deploy"])
def test_ready_only_once_the_kubelet_registered_the_agent(tmp_path, where):
    command = _probes()[where]
    board = StatusBoard("node-a", "sysdra.io")
    socket = str(tmp_path / "status.sock")
    with _Serving(board, socket):
        board.set_registration("waiting")
        board.set_nri({"state": "registered", "reason": None, "socket": "/var/run/nri/nri.sock", "runtime": "containerd v2.4.2",
                       "synchronized": True})
        waiting = _probe(command, socket)
        assert waiting.returncode == 1 and "not registered with the kubelet: waiting" in waiting.stderr
        board.set_registration("failed", "none of the services supported")
        failed = _probe(command, socket)
        assert failed.returncode == 1 and "failed (none of the services supported)" in failed.stderr
        board.set_registration("registered")
        assert _probe(command, socket).returncode == 0
    gone = _probe(command, socket)  # no agent answering: not ready either
    assert gone.returncode == 1 and "sysdra status:" in gone.stderr


NRI = {"reason": None, "socket": "/var/run/nri/nri.sock", "runtime": "containerd v2.4.2"}


@pytest.mark.parametrize("where", ["chart", "deploy"])
def test_not_ready_before_the_runtime_has_the_nri_plugin_in_its_list(tmp_path, where):
    """Both instances of a surge update register with containerd as ``50-sysdra``, and containerd
    calls every plugin it has (nri adaptation.go: no check of names), so the two together move a
    NIC once (the second finds it in the pod). But containerd adds a plugin to the plugins it calls
    only once its Synchronize is done, after RegisterPlugin and Configure, and holds Synchronize
    back while pods start or stop (BlockPluginSync). Ready on the kubelet's registration alone, the
    old pod was deleted while the new plugin was not yet called: a pod started then ran without its
    netdevs, and the runtime said nothing."""
    command = _probes()[where]
    board = StatusBoard("node-a", "sysdra.io")
    socket = str(tmp_path / "status.sock")
    with _Serving(board, socket):
        board.set_registration("registered")
        for state in ({"state": "connecting", "synchronized": False}, {"state": "registered", "synchronized": False}):
            board.set_nri({**NRI, **state})
            waiting = _probe(command, socket)
            assert waiting.returncode == 1, waiting.stderr
            assert f"NRI plugin not synchronized by the runtime yet: {state['state']}" in waiting.stderr
        board.set_nri({**NRI, "state": "registered", "synchronized": True})
        assert _probe(command, socket).returncode == 0
        # no NRI in the runtime: an answer too (the old instance had none either), said in status and doctor
        board.set_nri({**NRI, "state": "failed", "reason": "no NRI socket at /var/run/nri/nri.sock", "synchronized": False})
        assert _probe(command, socket).returncode == 0
    board = StatusBoard("node-a", "sysdra.io")  # nri_socket "" (disabled)
    with _Serving(board, socket):
        board.set_registration("registered")
        assert _probe(command, socket).returncode == 0


def _failed_report(path: str) -> dict:
    """The NRI plugin's report after its first failed attempt on ``path``."""
    import asyncio

    from agent.nri.plugin import NriPlugin

    reports: list[dict] = []

    async def main():
        plugin = NriPlugin(path, None, on_state=reports.append)
        task = asyncio.get_running_loop().create_task(plugin.run())
        try:
            await asyncio.wait_for(plugin.wait_for(lambda st: st.phase == "failed"), 30)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    asyncio.run(main())
    return reports[-1]


@pytest.mark.parametrize("where", ["chart", "deploy"])
def test_not_ready_where_the_runtimes_nri_socket_is_there_but_this_instance_cannot_use_it(tmp_path, where):
    """NRI ``failed`` is ready only where the socket is missing (a runtime without NRI, which cannot be told
    from a wrong ``nri_socket``: sysdra doctor reads the runtime's config). A socket that is there and
    refuses (nobody serves it: the runtime down), or that this instance may not open, is a runtime with
    NRI this instance does not reach: before, it was ready, the surge update deleted the old instance that
    moved the NICs, and the pods started next ran without their netdevs."""
    import socket as sockets

    command = _probes()[where]
    stale = str(tmp_path / "nri.sock")
    with sockets.socket(sockets.AF_UNIX) as s:
        s.bind(stale)  # a socket file nobody listens on: connections are refused
    refused, missing = _failed_report(stale), _failed_report(str(tmp_path / "none.sock"))
    board = StatusBoard("node-a", "sysdra.io")
    socket = str(tmp_path / "status.sock")
    with _Serving(board, socket):
        board.set_registration("registered")
        board.set_nri(refused)
        waiting = _probe(command, socket)
        assert waiting.returncode == 1 and f"connection to {stale} refused" in waiting.stderr, waiting.stderr
        board.set_nri(missing)
        assert _probe(command, socket).returncode == 0
