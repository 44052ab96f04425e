"""Kernel link events -> NIC health at once, run by test_health.py as
``unshare -n python -m tests.health_link_scenario TMP``: the agent's side in a fresh network
namespace of its own, as the DaemonSet's agent is in its pod's, and the "host" in another one
(a ``sleep`` in a second fresh namespace), reached as the DaemonSet reaches the host's: through
the init of the root's procfs (``proc/1``, here a link to that process). The veth interfaces,
named like the fixture NIC's ``eth0``, are made in the host's namespace, clash with nothing and
vanish with it. Prints one JSON line of results; exits non-zero on a failure."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time

from agent.health import UNHEALTHY, HealthMonitor
from discovery.inventory import scan
from tests.conftest import profile_root
from tests.kubelet_standin import settings_for

NIC = "nic-0000-05-00-0"
NET = "sys/devices/pci0000:00/0000:00:01.4/0000:05:00.0/virtio12/net/eth0"


HOST: list[int] = []  # the pid of the process whose network namespace is the host's


def ip(*args: str) -> None:
    subprocess.run(["nsenter", "-t", str(HOST[0]), "-n", "ip", *args], check=True, capture_output=True)


async def until(pred, timeout: float = 10.0) -> float:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("timed out")
        await asyncio.sleep(0.005)
    return time.monotonic() - t0


async def scenario(tmp: str) -> dict:
    root = os.path.join(tmp, "vm")
    shutil.copytree(profile_root("vm-numa-none"), root, symlinks=True)
    host = subprocess.Popen(["unshare", "-n", "sleep", "infinity"])
    HOST.append(host.pid)
    os.makedirs(os.path.join(root, "proc"), exist_ok=True)
    os.symlink(f"/proc/{host.pid}", os.path.join(root, "proc", "1"))  # the host's init, in its procfs
    await until(lambda: os.readlink(f"/proc/{host.pid}/ns/net") != os.readlink("/proc/self/ns/net"))
    inv = scan(root)
    monitor = HealthMonitor(settings_for(tmp, root=root, health_interval=10.0), lambda: inv)
    health = lambda: monitor.states[NIC].verdict.health  # noqa: E731
    out: dict = {}
    await monitor.start()
    try:
        assert await monitor.watch_links(kernel=True), "no netlink socket in the host's namespace"
        out["start"] = health()
        ip("link", "add", "other0", "type", "veth", "peer", "name", "other1")  # interfaces no device has
        await asyncio.sleep(0.2)
        out["checks_after_unrelated_event"] = monitor.link_checks
        ip("link", "add", "eth0", "type", "veth", "peer", "name", "peer0")  # veth: every kernel has it
        ip("link", "set", "eth0", "up")
        await until(lambda: monitor.link_checks > 0)
        with open(os.path.join(root, NET, "operstate"), "w") as f:
            f.write("down\n")  # what the kernel shows for a real NIC whose link dropped
        ip("link", "set", "eth0", "down")
        out["down_after_s"] = await until(lambda: health() == UNHEALTHY)
        out["down_message"] = monitor.states[NIC].verdict.message
        with open(os.path.join(root, NET, "operstate"), "w") as f:
            f.write("up\n")
        ip("link", "set", "eth0", "up")
        out["up_after_s"] = await until(lambda: health() != UNHEALTHY)
        out["up"] = health()
        out["rounds"] = monitor.rounds  # the start round only: the events did it, not the timer
        out["link_checks"] = monitor.link_checks
    finally:
        await monitor.stop()
        host.kill()
        host.wait()
    return out


def main(tmp: str) -> int:
    try:
        out = asyncio.run(scenario(tmp))
    except BaseException as err:
        print(json.dumps({"failure": f"{type(err).__name__}: {err}"}), flush=True)
        return 1
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
