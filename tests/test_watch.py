"""Hardware change -> rescan -> republish: debouncing, fixture-tree file events, and
real kernel uevents on this machine's /sys."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from agent.service.daemon import Agent
from agent.service.watch import READ_BELOW_SYS, Debouncer, HardwareWatcher, UdevSource
from agent.tools.fstrace import traced_scan
from agent.settings import Settings
from tests.conftest import REPO, profile_root, profiles, require_root
from tests.simkernel import set_uevent_driver

DEBOUNCE = 0.1


def test_debouncer_turns_a_storm_into_a_handful_of_rescans():
    async def scenario():
        runs = []
        deb = Debouncer(0.25, lambda first: runs.append(time.monotonic() - first))
        for _ in range(100):  # 1,000 events in about a second
            for _ in range(10):
                deb.trigger()
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.4)
        return deb, runs

    deb, runs = asyncio.run(scenario())
    assert deb.events == 1000
    assert 2 <= deb.runs <= 7
    assert all(r >= 0.24 for r in runs)  # a rescan waits out the window after its first event


def test_debouncer_survives_a_failing_action():
    async def scenario():
        calls = []

        def action(first):
            calls.append(first)
            raise RuntimeError("scan failed")

        deb = Debouncer(0.01, action)
        deb.trigger()
        await asyncio.sleep(0.05)
        deb.trigger()
        await asyncio.sleep(0.05)
        return calls

    assert len(asyncio.run(scenario())) == 2


def test_a_uevent_monitor_that_fails_to_start_reports_nothing(monkeypatch):
    """A monitor that cannot start (here: no netlink socket) leaves the agent on periodic
    rescans, and health must keep polling what events would have reported."""
    def no_netlink(self, loop):
        raise OSError("Address family not supported by protocol")

    monkeypatch.setattr(UdevSource, "start", no_netlink)

    async def main():
        watcher = HardwareWatcher("/", Debouncer(1.0, lambda *_: None))
        await watcher.start()
        assert watcher.reports() == (False, False)
        watcher.stop()

    asyncio.run(main())


def test_a_held_debouncer_keeps_events_until_released():
    async def scenario():
        runs = []
        deb = Debouncer(0.01, lambda first, changed: runs.append(changed), with_changes=True, held=True)
        deb.trigger("0000:18:00.0")
        deb.trigger("0000:19:00.0")
        await asyncio.sleep(0.05)
        held = list(runs)
        deb.release()
        for _ in range(500):
            if runs:
                break
            await asyncio.sleep(0.01)
        return held, runs

    held, runs = asyncio.run(scenario())
    assert held == [] and runs == [{"0000:18:00.0", "0000:19:00.0"}]


# --- fixture tree: file events -------------------------------------------------------------
def _device_names(cluster_dir: str) -> list[str]:
    names = []
    for path in sorted(glob.glob(os.path.join(cluster_dir, "resourceslices", "*.json"))):
        try:
            with open(path) as f:
                names += [d["name"] for d in json.load(f)["spec"].get("devices", [])]
        except (OSError, ValueError):
            pass
    return names


def _slice_devices(cluster_dir: str) -> dict[str, dict]:
    out = {}
    for path in glob.glob(os.path.join(cluster_dir, "resourceslices", "*.json")):
        with open(path) as f:
            out.update({d["name"]: d for d in json.load(f)["spec"].get("devices", [])})
    return out


@pytest.fixture
def fixture_root(tmp_path):
    if "server-2s-gpu-nic" not in profiles():
        pytest.skip("fixture profile server-2s-gpu-nic not generated yet")
    root = tmp_path / "root"
    shutil.copytree(profile_root("server-2s-gpu-nic"), root, symlinks=True)
    return str(root)


async def _wait_for(predicate, timeout: float) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("slices did not change in time")
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


def test_fixture_tree_changes_republish_within_debounce(fixture_root, tmp_path):
    cluster = str(tmp_path / "cluster")
    settings = Settings(root=fixture_root, node_name="node-a", cluster=f"dir:{cluster}", debounce=DEBOUNCE,
                        resync_interval=0, kubelet_dir=str(tmp_path / "kubelet"), cdi_dir=str(tmp_path / "cdi"))
    bus = os.path.join(fixture_root, "sys/bus/pci/devices")
    bdf = "0000:18:00.0"
    gone_name = "gpu-0000-18-00-0"
    latencies = {}

    async def scenario():
        agent = Agent(settings)
        agent.start_kubelet_plugin = _no_plugin  # this test is about publishing
        stop = asyncio.Event()
        task = asyncio.get_running_loop().create_task(agent.run(stop))
        try:
            await _wait_for(lambda: gone_name in _device_names(cluster), 10)
            await asyncio.sleep(0.2)  # observer running
            # the GPU is hot-removed
            target = os.readlink(os.path.join(bus, bdf))
            os.unlink(os.path.join(bus, bdf))
            latencies["remove"] = await _wait_for(lambda: gone_name not in _device_names(cluster), 5)
            # ... and comes back
            os.symlink(target, os.path.join(bus, bdf))
            latencies["add"] = await _wait_for(lambda: gone_name in _device_names(cluster), 5)
            # its driver is unbound (discovery offers no GPU without a driver), then bound again
            driver_link = os.path.join(bus, bdf, "driver")
            driver_target = os.readlink(driver_link)
            os.unlink(driver_link)
            set_uevent_driver(os.path.join(bus, bdf), None)  # the kernel's uevent follows the link
            latencies["unbind"] = await _wait_for(lambda: gone_name not in _device_names(cluster), 5)
            os.symlink(driver_target, driver_link)
            set_uevent_driver(os.path.join(bus, bdf), os.path.basename(driver_target))
            latencies["bind"] = await _wait_for(lambda: _slice_devices(cluster).get(gone_name, {}).get("attributes", {}).get("driver"), 5)
            rescans = agent.rescans
            # a file event that changes nothing we publish rewrites nothing
            before = {p: os.stat(p).st_mtime_ns for p in glob.glob(os.path.join(cluster, "resourceslices", "*.json"))}
            with open(os.path.join(bus, bdf, "power_state"), "w") as f:
                f.write("D0\n")
            await _wait_for(lambda: agent.rescans > rescans, 5)
            await asyncio.sleep(0.1)
            after = {p: os.stat(p).st_mtime_ns for p in glob.glob(os.path.join(cluster, "resourceslices", "*.json"))}
            return before == after
        finally:
            stop.set()
            await task

    unchanged = asyncio.run(scenario())
    assert unchanged
    print("hardware change -> slice published latencies (s):", {k: round(v, 3) for k, v in latencies.items()})


async def _no_plugin():
    return None


@pytest.mark.parametrize("profile", profiles())
def test_a_fixture_roots_file_watch_covers_every_sysfs_path_discovery_reads(profile):
    root = profile_root(profile)
    _, ops = traced_scan(root)
    below_sys = {rel.split("/")[1] for rel in (os.path.relpath(path, root) for _, path in ops) if rel.startswith("sys/")}
    assert below_sys and below_sys <= set(READ_BELOW_SYS), below_sys


def test_a_fixture_roots_file_watch_leaves_out_what_discovery_never_reads(tmp_path):
    """sys/kernel (iommu_groups: 40 % of the benchmark node's directories) is not watched: its
    changes change nothing discovery reads; a function's own files are."""
    root = str(tmp_path / "root")
    shutil.copytree(profile_root("server-2s-gpu-nic"), root, symlinks=True)
    group = sorted(glob.glob(os.path.join(root, "sys/kernel/iommu_groups/*/devices")))[0]
    bdf = "0000:18:00.0"

    async def scenario():
        changed = []
        watcher = HardwareWatcher(root, Debouncer(0.05, lambda first, bdfs: changed.append(bdfs), with_changes=True))
        await watcher.start()
        try:  # one inotify queue, in order: an event of the first change would come before the second's
            os.symlink("../../../../devices/none", os.path.join(group, "0000:ff:00.0"))
            with open(os.path.join(root, "sys/bus/pci/devices", bdf, "power_state"), "w") as f:
                f.write("D3hot\n")
            await _wait_for(lambda: any(bdf in c for c in changed), 5)
            return changed
        finally:
            watcher.stop()

    changed = asyncio.run(scenario())
    assert set().union(*changed) == {bdf}, changed


def test_only_the_kernels_sysfs_is_watched_by_uevents(tmp_path):
    """A fixture tree is files (their events are the changes); the kernel's sysfs is not."""
    from discovery.sysfs import is_sysfs

    assert is_sysfs("/sys") and not is_sysfs(profile_root("h200-vm") + "/sys") and not is_sysfs(str(tmp_path / "none"))
    assert HardwareWatcher("/", Debouncer(1.0, lambda *_: None)).uevents
    assert not HardwareWatcher(profile_root("h200-vm"), Debouncer(1.0, lambda *_: None)).uevents


# --- real kernel uevents -----------------------------------------------------------------
def _first_pci_device() -> str:
    devices = sorted(os.listdir("/sys/bus/pci/devices")) if os.path.isdir("/sys/bus/pci/devices") else []
    if not devices:
        pytest.fail("no PCI devices in /sys/bus/pci/devices: cannot test real uevents")
    return devices[0]


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.parametrize("action", ["change", "add"])
def test_real_kernel_uevent_reaches_monitor_and_triggers_rescan(action):
    require_root()
    bdf = _first_pci_device()

    async def scenario():
        loop = asyncio.get_running_loop()
        seen = []
        rescans = []
        debouncer = Debouncer(0.05, lambda first: rescans.append(first))
        source = UdevSource(lambda dev: (seen.append(dev), debouncer.trigger()), source="kernel")
        source.start(loop)
        watcher = HardwareWatcher("/", debouncer)  # the daemon's own wiring, on the real root
        await watcher.start()
        try:
            await asyncio.sleep(0.05)
            with open(f"/sys/bus/pci/devices/{bdf}/uevent", "w") as f:
                f.write(action)
            deadline = time.monotonic() + 5
            while not (seen and rescans) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        finally:
            source.stop()
            watcher.stop()
        return seen, rescans

    seen, rescans = asyncio.run(scenario())
    assert seen, ("no uevent delivered over NETLINK_KOBJECT_UEVENT: uevents reach only sockets in network "
                  "namespaces owned by the initial user namespace; check `ls -l /proc/self/ns/net` and user namespaces")
    ours = [d for d in seen if d is not None and d.sys_name == bdf]
    assert ours and ours[0].action == action and ours[0].subsystem == "pci"
    assert rescans


_POD_VIEW = """
import asyncio, os, subprocess, sys, time
from agent.service.watch import Debouncer, HardwareWatcher
root, bdf = sys.argv[1], sys.argv[2]
os.makedirs(root + "/sys")
subprocess.run(["mount", "--bind", "/sys", root + "/sys"], check=True)  # as the chart's hostPath /sys at /host/sys

async def main():
    changed = []
    watcher = HardwareWatcher(root, Debouncer(0.05, lambda first, bdfs: changed.append(bdfs), with_changes=True))
    await watcher.start()
    await asyncio.sleep(0.05)
    with open(f"{root}/sys/bus/pci/devices/{bdf}/uevent", "w") as f:
        f.write("change")
    deadline = time.monotonic() + 5
    while not changed and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    watcher.stop()
    print(watcher.uevents, watcher.reports(), changed)

asyncio.run(main())
"""


@pytest.mark.slow
@pytest.mark.root
def test_a_daemonset_agent_sees_the_hosts_uevents(tmp_path):
    """The DaemonSet's agent: ``--root=/host`` with the host's /sys mounted at /host/sys, in the
    pod's own network namespace (no hostNetwork). Its sys is the kernel's, so it listens to
    kernel uevents (file events never come from sysfs), and they reach the pod's namespace: a
    change to a real PCI function is a rescan of that function."""
    require_root()
    bdf = _first_pci_device()
    run = subprocess.run(["unshare", "--mount", "--net", "--propagation", "private", sys.executable, "-c", _POD_VIEW,
                          str(tmp_path / "host"), bdf], cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"True (True, False) [{{'{bdf}'}}]", run.stdout + run.stderr


_VETH_VIEW = """
import asyncio, subprocess, sys, time
from agent.service.watch import Debouncer, HardwareWatcher
bdf = sys.argv[1]

async def main():
    changed = []
    watcher = HardwareWatcher("/", Debouncer(0.3, lambda first, bdfs: changed.append(bdfs), with_changes=True))
    await watcher.start()
    await asyncio.sleep(0.05)
    subprocess.run(["ip", "link", "add", "sysdra-v0", "type", "veth", "peer", "name", "sysdra-v1"], check=True)
    subprocess.run(["ip", "link", "del", "sysdra-v0"], check=True)
    with open(f"/sys/bus/pci/devices/{bdf}/uevent", "w") as f:  # after the veth's: it comes last
        f.write("change")
    deadline = time.monotonic() + 5
    while not any(c is None or bdf in c for c in changed) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    watcher.stop()
    print(changed)

asyncio.run(main())
"""


@pytest.mark.slow
@pytest.mark.root
def test_a_veth_coming_and_going_is_no_rescan(tmp_path):
    """A pod's start or stop adds or removes a veth (/devices/virtual/net/...): it names no PCI
    function and changes no device we publish, so it must not cost a full rescan (nor the health
    round that follows one). Real uevents, in a network namespace of its own (a netdev's uevents
    reach only its namespace; a PCI function's reach every one), the PCI one sent last."""
    require_root()
    bdf = _first_pci_device()
    run = subprocess.run(["unshare", "--net", sys.executable, "-c", _VETH_VIEW, bdf], cwd=REPO,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"[{{'{bdf}'}}]", run.stdout + run.stderr


def test_a_vfio_group_uevent_still_asks_for_a_rescan():
    """vfio group devices are virtual too, and discovery reads them (a function's /dev/vfio node).
    A stand-in for the pyudev device: no vfio group can be made on this machine."""
    from types import SimpleNamespace

    triggered = []
    watcher = HardwareWatcher("/", SimpleNamespace(trigger=triggered.append))
    watcher._uevent("kernel", SimpleNamespace(device_path="/devices/virtual/vfio/12", subsystem="vfio"))
    watcher._uevent("kernel", SimpleNamespace(device_path="/devices/virtual/net/veth1", subsystem="net"))
    watcher._uevent("kernel", None)  # events lost
    assert triggered == [None, None]
