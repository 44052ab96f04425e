"""The DaemonSet's livenessProbe (deploy/helm/sysdra, rendered by the real helm) run as the
kubelet runs it, a command in the agent's container, against the real agent: it passes while a
prepare blocks for seconds in the driver (a GPU mode switch on the simulated amdgpu), fails with a
clear message while the agent's event loop is wedged, and passes again once the loop runs."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import yaml

from agent.service.status import status_socket_path
from tests.conftest import REPO, profile_root
from tests.helm import render
from tests.kubelet_standin import claim, running_agent, settings_for, store_claim
from tests.partition_node import SPX_GPU, Node, mode_of
from tests.test_partitions_allocator import gpu_bdf

POD_SOCKET = "/tmp/status.sock"  # the chart's --status-socket
SWITCH_SECONDS = 8.0  # the simulated kernel's time to bring a new mode up: longer than a probe takes


def liveness(*sets: str) -> dict | None:
    objs = [d for d in yaml.safe_load_all(render(sets=sets)) if d]
    (ds,) = [o for o in objs if o["kind"] == "DaemonSet"]
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    return c.get("livenessProbe")


PROBE = liveness()


def probe_command(socket: str) -> list[str]:
    """The probe's command, on this test's socket instead of the pod's."""
    command = PROBE["exec"]["command"]
    assert sum(a.count(POD_SOCKET) for a in command) == 1
    return [a.replace(POD_SOCKET, socket) for a in command]


# the container's `sysdra` is this checkout's (the venv's console script, importing from here)
ENV = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""), PYTHONPATH=REPO)


def run_probe(socket: str) -> subprocess.CompletedProcess:
    # no limit of the kubelet's (timeoutSeconds) here: a loaded test machine starts Python slowly
    return subprocess.run(probe_command(socket), capture_output=True, text=True, env=ENV, timeout=120)


async def probe_async(socket: str) -> int:
    proc = await asyncio.create_subprocess_exec(*probe_command(socket), env=ENV, stdout=subprocess.DEVNULL,
                                                stderr=subprocess.DEVNULL)  # fmt: skip
    return await proc.wait()


async def _wait_for(predicate, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_the_chart_probes_liveness_by_default_and_can_be_tuned_or_disabled():
    assert PROBE == {"exec": {"command": ["sh", "-c", f"sysdra status --socket={POD_SOCKET} --timeout=5 -o json >/dev/null"]},
                     "initialDelaySeconds": 10, "periodSeconds": 10, "timeoutSeconds": 10, "failureThreshold": 6}  # fmt: skip
    tuned = liveness("livenessProbe.periodSeconds=30", "livenessProbe.timeoutSeconds=20", "livenessProbe.failureThreshold=3",
                     "livenessProbe.initialDelaySeconds=60")  # fmt: skip
    assert "--timeout=10 " in tuned["exec"]["command"][2]  # the loop gets half the probe's time, the CLI's start the rest
    assert (tuned["periodSeconds"], tuned["timeoutSeconds"], tuned["failureThreshold"], tuned["initialDelaySeconds"]) == (30, 20, 3, 60)
    assert liveness("livenessProbe.enabled=false") is None


def test_a_wedged_event_loop_fails_the_probe_and_a_running_one_passes(tmp_path):
    settings = settings_for(str(tmp_path), root=profile_root("vm-numa-none"), metrics_address="", claim_status=False)
    socket = status_socket_path(settings)

    async def main() -> None:
        async with running_agent(settings):
            assert await probe_async(socket) == 0
            wedged: dict = {}
            prober = threading.Thread(target=lambda: wedged.update(result=run_probe(socket)))
            prober.start()
            prober.join()  # on the loop: the agent's event loop does nothing else until the probe is done
            result = wedged["result"]
            assert result.returncode != 0
            assert f"the agent at {socket} did not answer within 5s (event loop stuck?)" in result.stderr
            assert await probe_async(socket) == 0  # the loop runs again: alive

    asyncio.run(main())


def test_a_slow_prepare_never_fails_the_probe(tmp_path):
    node = Node(str(tmp_path), delay=SWITCH_SECONDS, partition_switch_timeout=60.0, metrics_address="", claim_status=False)
    settings = node.settings
    socket = status_socket_path(settings)
    a = store_claim(settings, claim("a", [("gpu", f"{SPX_GPU}-dpx-nps1-0")]))  # needs the GPU switched to DPX

    async def main() -> None:
        async with running_agent(settings) as kubelet:
            prepare = asyncio.create_task(kubelet.prepare(a))
            await _wait_for(lambda: mode_of(node.root, gpu_bdf(SPX_GPU)) != "SPX/NPS1" or prepare.done())
            probes = 0
            while not prepare.done():
                assert await probe_async(socket) == 0
                probes += not prepare.done()  # answered while the prepare still ran
            assert probes >= 1, "the prepare ended before a probe: the test shows nothing"
            assert not (await prepare).claims[a["metadata"]["uid"]].error

    with node.sim:
        asyncio.run(main())
