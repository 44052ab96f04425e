"""The real agent (``sysdra run --share gpu`` on a copied fixture node, its simulated
``nvidia-cuda-mps-control``) and the MPS control daemon of a shared NVIDIA GPU: killed, it makes
the GPU Unhealthy on the KEP-4680 stream until the agent has started it again; the agent
SIGKILLed and started again adopts the running daemon (no second one); after a reboot the
stale daemon's directories are cleaned and a new daemon serves the prepared claim."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from discovery.inventory import scan
from tests.faults.harness import DRIVER, Node, run
from tests.test_health import Stream

pytestmark = pytest.mark.slow
UID = "0000000a-0000-4000-8000-00000000e5a1"
SHARE = "0000000b-0000-4000-8000-00000000e5a1"
ENV = {"SYSDRA_SHARE": "gpu", "SYSDRA_HEALTH_INTERVAL": "10"}


def _shared_claim(node: Node, gpu: str) -> tuple[str, str, str]:
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": "mps", "namespace": "default", "uid": UID},
             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu-share.sysdra.io"}}]}},
             "status": {"allocation": {"devices": {"results": [
                 {"request": "gpu", "driver": DRIVER, "pool": node.name, "device": gpu, "shareID": SHARE,
                  "consumedCapacity": {"memory": "8Gi", "compute": "25"}}]}}}}
    d = os.path.join(node.cluster, "resourceclaims", "default")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "mps.json"), "w") as f:
        json.dump(claim, f)
    return ("default", "mps", UID)


def _record(node: Node) -> dict:
    with open(os.path.join(node.plugin_dir, "mps", "daemons.json")) as f:
        (rec,) = json.load(f)["daemons"].values()
    return rec


def _daemons_of(pipe: str) -> list[int]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if (p.info["cmdline"] or [])[-1:] == ["-f"] and p.environ().get("CUDA_MPS_PIPE_DIRECTORY") == pipe \
                    and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


async def _unhealthy_then_back(node: Node, gpu: str, pid: int) -> tuple[str, str]:
    stream = Stream(node.client.info.endpoint)
    try:
        await stream.until(lambda got: gpu in got)
        os.kill(pid, signal.SIGKILL)
        down = await stream.until(lambda got: got[gpu][0] == "UNHEALTHY", timeout=15)
        back = await stream.until(lambda got: got[gpu][0] != "UNHEALTHY", timeout=30)
        return down[gpu][1], back[gpu][1]
    finally:
        await stream.close()


def _status_until(node: Node, line: str, timeout: float = 10.0) -> str:
    """``sysdra status`` as an operator runs it, until it shows ``line`` (the supervisor reports
    after its round)."""
    deadline, text = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        text = subprocess.run([sys.executable, "-m", "agent", "status", "--socket", os.path.join(node.plugin_dir, "status.sock")],
                              capture_output=True, text=True).stdout  # fmt: skip
        if line in text.splitlines():
            return text
        time.sleep(0.2)
    raise AssertionError(f"sysdra status never showed {line!r}:\n{text}")


def test_mps_daemon_supervised_adopted_and_cleaned_after_reboot(tmp_path, faults):
    node = Node(tmp_path, boot="boot-1")
    inv = scan(node.root)
    gpu_dev = next(d for d in inv.devices if d.kind == "gpu" and d.gpu.vendor == "nvidia" and d.pci.driver == "nvidia")
    gpu, uuid = gpu_dev.name, gpu_dev.gpu.nvidia_uuid
    pipe = os.path.join(node.plugin_dir, "mps", uuid, "pipe")
    claim = _shared_claim(node, gpu)
    node.start(env=ENV)
    try:
        out = run(node.prepare(claim))
        assert not out.claims[UID].error, out.claims[UID].error
        first = _record(node)
        assert _daemons_of(pipe) == [first["pid"]]

        # killed: Unhealthy on the health stream, started again, Healthy again once it answers
        down, back = run(_unhealthy_then_back(node, gpu, first["pid"]))
        assert "MPS control daemon" in down and "MPS" not in back
        second = _record(node)
        assert second["pid"] != first["pid"] and _daemons_of(pipe) == [second["pid"]]
        assert "MPS control daemon for GPU %s started again" % uuid in open(node.log_path).read()
        shown = _status_until(node, f"  {uuid}: pid {second['pid']}, serving (1 restarts in the window)")
        assert "mps daemons:  1" in shown

        # the agent SIGKILLed and started again: the running daemon is adopted, not doubled
        node.kill()
        assert _daemons_of(pipe) == [second["pid"]]
        node.start(env=ENV)
        assert _record(node) == second and _daemons_of(pipe) == [second["pid"]]
        again = run(node.prepare(claim))  # the kubelet's re-prepare
        assert not again.claims[UID].error and _daemons_of(pipe) == [second["pid"]]

        # a reboot: every process ends, the boot ID changes; stale dirs go, a new daemon serves
        node.kill()
        os.kill(second["pid"], signal.SIGKILL)
        stale = os.path.join(pipe, "from-boot-1")
        open(stale, "w").close()
        node.set_boot_id("boot-2")
        node.start(env=ENV)
        third = _record(node)
        assert third["boot_id"] == "boot-2" and _daemons_of(pipe) == [third["pid"]] and not os.path.exists(stale)

        run(node.unprepare(claim))
        assert _daemons_of(pipe) == [] and not os.path.exists(os.path.dirname(pipe))
    finally:
        node.stop()
    faults.add("MPS daemons", "control daemon SIGKILLed; agent SIGKILLed and restarted; reboot (new boot ID)", 3,
               "GPU Unhealthy until the daemon was started again, then Healthy; the running daemon adopted (one "
               "process); after the reboot its dirs cleaned and a new daemon started")
