"""GPU faults kept across agent restarts (agent/health/faults.py, docs/health.md "Kept faults"):
an XID from the simulated NVML (tests/simnvml.py: NVML's event API; no GPU can run here) makes
the GPU unhealthy and is written down; a fresh monitor over the same plugin dir, and a real
`sysdra run` process, still find it unhealthy and tainted; a new boot ID forgets it; `sysdra
health clear` clears it, also under a running agent. The file is untrusted input."""

from __future__ import annotations

import asyncio
import glob
import json
import logging
import os
import subprocess
import sys
import time

import pytest

from agent.fsutil import make_dirs
from agent.health.checks import HEALTHY, UNHEALTHY
from agent.health.faults import FILE, FaultStore, KeptFaults
from agent.health.monitor import HealthMonitor
from agent.health.taints import effect_for
from discovery.inventory import scan
from tests.conftest import REPO, copy_profile
from tests.kubelet_standin import settings_for
from tests.simnvml import SimNvmlEvents, open_sim

BDF, GPU, UUID = "0000:00:06.0", "gpu-0000-00-06-0", "GPU-7e3a1c52-0d4b-4f6e-9a81-2b3c4d5e6f70"
BOOT_ID = "proc/sys/kernel/random/boot_id"


@pytest.fixture
def node(tmp_path):
    """The H200 fixture node with a boot ID of its own, and a plugin dir the agent would make."""
    root = copy_profile(tmp_path, "h200-vm")
    set_boot(root, "1b0c7d8e-0000-4000-8000-000000000001")
    s = settings_for(str(tmp_path), root=root, nvidia_driver_root="/usr/local/nvidia", nvml=False,
                     taint_unhealthy=True, taint_hold=0)
    make_dirs(s.plugin_dir, 0o750)
    return s


def set_boot(root: str, boot: str) -> None:
    os.makedirs(os.path.dirname(os.path.join(root, BOOT_ID)), exist_ok=True)
    with open(os.path.join(root, BOOT_ID), "w") as f:
        f.write(boot + "\n")


def cli_flags(s) -> list[str]:
    """The flags a `sysdra health` command needs to find the agent's plugin dir and root."""
    return ["--kubelet-dir", os.path.dirname(os.path.dirname(s.plugin_dir)), "--driver-name", s.driver_name, "--root", s.root]


async def watching_xid_79(s, inv, sim) -> HealthMonitor:
    """A started monitor of ``inv`` watching ``sim``'s events, after an XID 79 of the GPU is kept."""
    monitor = HealthMonitor(s, lambda: inv)
    await monitor.start()
    assert await monitor.watch_gpu_events(nvml=open_sim(s.root, sim))
    sim.emit(BDF, sim.nvmlEventTypeXidCriticalError, 79)
    await until(lambda: (UUID, None) in FaultStore(s.plugin_dir, s.root).load())
    return monitor


async def until(predicate, timeout: float = 30.0):
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


async def _fault(s, xid: int = 79) -> None:
    """A monitor that sees XID ``xid`` on the GPU and writes it down, then stops (the agent's end)."""
    inv, sim = scan(s.root), SimNvmlEvents()
    monitor = HealthMonitor(s, lambda: inv)
    await monitor.start()
    try:
        assert monitor.states[GPU].verdict.health == HEALTHY
        assert await monitor.watch_gpu_events(nvml=open_sim(s.root, sim))
        sim.emit(BDF, sim.nvmlEventTypeXidCriticalError, xid)
        await until(lambda: (UUID, None) in FaultStore(s.plugin_dir, s.root).load())
        assert monitor.states[GPU].verdict.reason == f"xid-{xid}"
    finally:
        await monitor.stop()


async def _faulted_and_restarted(s) -> HealthMonitor:
    """A monitor started after another kept an XID 79 of the GPU: the GPU unhealthy from the file."""
    await _fault(s)
    monitor = await _restarted(s)
    assert monitor.states[GPU].verdict.reason == "xid-79"
    return monitor


async def _restarted(s) -> HealthMonitor:
    """A fresh monitor over the same plugin dir, its first round done (no NVML: no event comes again)."""
    inv = scan(s.root)
    monitor = HealthMonitor(s, lambda: inv)
    await monitor.start()
    return monitor


def test_a_fault_outlives_a_restart_and_a_reboot_forgets_it(node, caplog):
    async def main():
        await _fault(node)
        kept = json.load(open(os.path.join(node.plugin_dir, FILE)))
        (entry,) = kept["faults"]
        assert entry["uuid"] == UUID and entry["bdf"] == BDF and entry["reason"] == "xid-79"
        assert entry["bootId"] == "1b0c7d8e-0000-4000-8000-000000000001"
        again = await _restarted(node)
        try:
            assert again.states[GPU].verdict.health == UNHEALTHY and again.states[GPU].verdict.reason == "xid-79"
            assert again.taints()[GPU] == [{"key": "sysdra.io/unhealthy", "value": "xid-79", "effect": "NoSchedule"}]
        finally:
            await again.stop()
        set_boot(node.root, "1b0c7d8e-0000-4000-8000-000000000002")  # the node rebooted: the GPU was reset
        caplog.set_level(logging.INFO, logger="agent.health.faults")
        rebooted = await _restarted(node)
        try:
            assert rebooted.states[GPU].verdict.health == HEALTHY and GPU not in rebooted.taints()
        finally:
            await rebooted.stop()
        assert any("of boot 1b0c7d8e-0000-4000-8000-000000000001 ignored: the node rebooted" in r.getMessage()
                   for r in caplog.records)

    asyncio.run(main())


def test_a_first_publish_carries_the_kept_faults_taint_with_its_effect(node):
    """The slices published before the monitor runs (first_round), with NoExecute for XIDs."""
    import kubernetes_validate

    from agent.health.monitor import first_round
    from agent.publish.slices import slices_list

    asyncio.run(_fault(node, xid=48))
    s = node.replace(taint_effects={"xid-79": "None", "xid-*": "NoExecute"})
    taints, health = first_round(s, scan(s.root))
    assert taints == {GPU: [{"key": "sysdra.io/unhealthy", "value": "xid-48", "effect": "NoExecute"}]}
    assert health[GPU][0] == "UNHEALTHY"  # what `sysdra status` reports until the monitor runs
    for obj in slices_list(scan(s.root), s, taints=taints)["items"]:
        kubernetes_validate.validate(obj, "1.37", strict=True)


def test_the_status_before_the_monitor_runs_agrees_with_the_first_taints(node):
    """The first scan's slices carry the kept fault's taint; `sysdra status` read in the same
    moment (before the monitor's first round) says the GPU is unhealthy, not unknown."""
    from agent.service.daemon import Agent

    asyncio.run(_fault(node))

    async def main():
        agent = Agent(node)
        await agent.rescan()
        assert agent.health is None  # the monitor has not started
        assert agent.pool is not None and agent.board.devices_by_health.get("unhealthy") == 1

    asyncio.run(main())


def test_a_gpu_discovered_later_gets_its_kept_fault(node):
    """The GPU is not in the first inventory (its driver loaded after the agent started): the
    kept fault is its own the moment a rescan finds it."""
    async def main():
        await _fault(node)
        inv = scan(node.root)
        without = inv.replace(devices=tuple(d for d in inv.devices if d.name != GPU))
        monitor = HealthMonitor(node, lambda: without)
        await monitor.start()
        try:
            assert GPU not in monitor.states
            monitor.on_inventory(inv)
            await until(lambda: GPU in monitor.states)
            assert monitor.states[GPU].verdict.reason == "xid-79"
        finally:
            await monitor.stop()

    asyncio.run(main())


def test_a_gpu_without_a_uuid_in_discovery_is_matched_by_nvmls(node):
    """Discovery could not read the GPU's UUID (procfs ``information`` without it): the fault is
    kept under NVML's UUID, and found again by the GPU's PCI address; clearing it works so too."""
    from agent.health.faults import FaultStore as Store

    inv = scan(node.root)
    gpu = inv.by_name()[GPU]
    plain = inv.replace(devices=tuple(d.replace(gpu=gpu.gpu.replace(nvidia_uuid=None)) if d.name == GPU else d
                                      for d in inv.devices))
    sim = SimNvmlEvents()

    async def main():
        monitor = HealthMonitor(node, lambda: plain)
        await monitor.start()
        try:
            assert await monitor.watch_gpu_events(nvml=open_sim(node.root, sim)) and monitor.xid.uuids == {BDF: UUID}
            sim.emit(BDF, sim.nvmlEventTypeDoubleBitEccError)
            await until(lambda: (UUID, None) in Store(node.plugin_dir, node.root).load())
        finally:
            await monitor.stop()
        again = HealthMonitor(node, lambda: plain)
        await again.start()
        try:
            assert again.states[GPU].verdict.reason == "ecc-double-bit"
            assert [f.uuid for f in Store(node.plugin_dir, node.root).clear(GPU)] == [UUID]
            await again.check_now()
            assert again.states[GPU].verdict.health == HEALTHY
        finally:
            await again.stop()

    asyncio.run(main())


def test_the_file_holds_this_boots_last_fault_of_each_gpu(tmp_path):
    """A new fault of a GPU replaces its earlier one, and a write leaves out the faults of earlier
    boots: the file does not grow towards its entry limit (past it, the whole file is damaged)."""
    FaultStore(str(tmp_path), boot_id="boot-a").record("GPU-aaaa", "0000:00:06.0", "xid-79", "before the reboot")
    store = FaultStore(str(tmp_path), boot_id="boot-b")
    store.record("GPU-bbbb", "0000:00:07.0", "xid-79", "first")
    store.record("GPU-bbbb", "0000:00:07.0", "xid-48", "second")
    doc = json.load(open(tmp_path / FILE))
    assert [(f["uuid"], f["reason"], f["bootId"]) for f in doc["faults"]] == [("GPU-bbbb", "xid-48", "boot-b")]
    assert os.stat(tmp_path / FILE).st_mode & 0o777 == 0o600
    kept = KeptFaults(store)  # the monitor's view: a repeat costs no write, a new reason is one
    kept.refresh()
    kept.record("GPU-bbbb", "0000:00:07.0", "ecc-double-bit", "third")
    assert store.load()[("GPU-bbbb", None)].reason == "ecc-double-bit"
    store.record("GPU-cccc", "0000:00:08.0", "xid-79", "another GPU")
    assert [f.uuid for f in store.clear(None)] == ["GPU-bbbb", "GPU-cccc"]  # `sysdra health clear --all`
    assert store.load() == {}


def test_taint_effects_by_reason():
    rules = {"xid-*": "NoExecute", "xid-79": "None", "link-*": "NoSchedule"}
    assert effect_for("xid-79", "NoSchedule", rules) == "None"  # exact first, whatever the order
    assert effect_for("xid-48", "NoSchedule", rules) == "NoExecute"
    assert effect_for("ecc-double-bit", "NoSchedule", rules) == "NoSchedule"
    assert effect_for("ecc-double-bit", "NoExecute", {}) == "NoExecute"


def test_clear_under_a_running_monitor(node):
    """`sysdra health clear` (in-process here; a real process below) while the agent runs: the next
    round finds the GPU healthy; a fault recorded meanwhile is kept."""
    from agent.cli.main import main as cli

    flags = cli_flags(node)

    async def main():
        monitor = await _faulted_and_restarted(node)
        try:
            assert cli(["health", "clear", *flags, "nothing-like-it"]) == 1
            assert cli(["health", "clear", *flags, BDF]) == 0
            await monitor.check_now()
            assert monitor.states[GPU].verdict.health == HEALTHY
            assert cli(["health", "clear", *flags, "--all"]) == 0  # nothing left: not an error
        finally:
            await monitor.stop()

    asyncio.run(main())


@pytest.mark.parametrize("content, why", [
    (b"{not json", "not JSON"),
    (b'{"version": 2, "faults": []}', "version"),
    (b'{"version": 1, "faults": {}}', "faults"),
    (b"[]", "top level"),
    (b" " * (2 << 20), "larger than"),
])
def test_a_damaged_file_is_said_and_counts_as_empty(node, caplog, content, why):
    with open(os.path.join(node.plugin_dir, FILE), "wb") as f:
        f.write(content)
    caplog.set_level(logging.WARNING, logger="agent.health.faults")
    assert FaultStore(node.plugin_dir, node.root).load() == {}
    (line,) = [r.getMessage() for r in caplog.records]
    assert why in line and "treated as empty" in line and FILE in line
    monitor = asyncio.run(_check_once(node))
    assert monitor == HEALTHY
    asyncio.run(_fault(node))  # a new fault writes the file anew: the damaged one is kept aside, not overwritten
    (aside,) = glob.glob(os.path.join(node.plugin_dir, FILE + ".damaged-*"))
    assert open(aside, "rb").read() == content and list(FaultStore(node.plugin_dir, node.root).load()) == [(UUID, None)]


async def _check_once(s) -> str:
    monitor = await _restarted(s)
    await monitor.stop()
    return monitor.states[GPU].verdict.health


def test_a_bad_entry_is_that_entrys_problem(node, caplog):
    boot = "1b0c7d8e-0000-4000-8000-000000000001"
    good = {"uuid": UUID, "bdf": BDF, "reason": "ecc-double-bit", "message": "m", "since": 1.0, "bootId": boot,
            "fromANewerSysdra": True}
    bad = [dict(good, uuid="../../etc"), dict(good, reason="xid-79; rm -rf"), dict(good, message="x" * 5000), "text"]
    with open(os.path.join(node.plugin_dir, FILE), "w") as f:
        json.dump({"version": 1, "faults": [*bad, good]}, f)
    caplog.set_level(logging.WARNING, logger="agent.health.faults")
    assert list(FaultStore(node.plugin_dir, node.root).load()) == [(UUID, None)]
    assert len([r for r in caplog.records if "skipped" in r.getMessage()]) == 4
    assert asyncio.run(_check_once(node)) == UNHEALTHY


def test_not_a_regular_file(node, caplog):
    os.mkfifo(os.path.join(node.plugin_dir, FILE))  # a FIFO would block a plain open()
    caplog.set_level(logging.WARNING, logger="agent.health.faults")
    assert FaultStore(node.plugin_dir, node.root).load() == {}
    assert "not a regular file" in caplog.text
    os.unlink(os.path.join(node.plugin_dir, FILE))
    elsewhere = os.path.join(node.plugin_dir, "elsewhere")
    os.mkdir(elsewhere)
    FaultStore(elsewhere, node.root).record(UUID, BDF, "xid-79", "a fault file of another place")
    os.symlink(os.path.join(elsewhere, FILE), os.path.join(node.plugin_dir, FILE))
    caplog.clear()
    assert FaultStore(node.plugin_dir, node.root).load() == {} and "unreadable" in caplog.text  # not followed


# --- the real agent ---------------------------------------------------------------------------
def _taints(cluster: str) -> dict:
    out = {}
    for path in glob.glob(os.path.join(cluster, "resourceslices", "*.json")):
        try:
            obj = json.load(open(path))
        except (OSError, ValueError):
            return {}
        out.update({d["name"]: d.get("taints") for d in obj["spec"].get("devices", [])})
    return out


def _wait(pred, what: str, proc: subprocess.Popen, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (got := pred()) is not None:
            return got
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def test_the_real_agent_restarted_keeps_the_fault_and_the_cli_clears_it(node, tmp_path):
    asyncio.run(_fault(node))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYSDRA_")}
    env["PYTHONPATH"] = REPO  # this tree's agent, whatever the venv's editable install points at
    config = tmp_path / "config.yaml"
    config.write_text("taintHold: 0\nnvidiaDriverRoot: /usr/local/nvidia\nnvml: false\ntaintEffects: {xid-*: NoExecute}\n")
    kubelet = os.path.dirname(os.path.dirname(node.plugin_dir))
    common = ["--config", str(config), "--root", node.root, "--kubelet-dir", kubelet]
    cluster = node.cluster_dir
    proc = subprocess.Popen([sys.executable, "-m", "agent", "run", *common, "--node-name", node.node_name,
                             "--driver-name", node.driver_name, "--cluster", node.cluster, "--cdi-dir", node.cdi_dir,
                             "--metrics-address", "", "--health-interval", "0.5", "--taint-unhealthy", "--nri-socket", ""],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sysdra = [sys.executable, "-m", "agent"]
    try:
        taint = _wait(lambda: _taints(cluster).get(GPU), "the kept fault's taint", proc)
        assert taint == [{"key": "sysdra.io/unhealthy", "value": "xid-79", "effect": "NoExecute"}]
        status = _wait(lambda: _status(sysdra, common, env), "status", proc)
        assert status["devices"]["byHealth"].get("unhealthy") == 1
        assert status["devices"]["unhealthy"] == [{"device": GPU, "reason": "xid-79", "message": "NVML: critical XID 79"}]
        listed = subprocess.run([*sysdra, "health", "list", *common, "--driver-name", node.driver_name],
                                cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout
        assert GPU in listed and UUID in listed and "xid-79" in listed
        subprocess.run([*sysdra, "health", "clear", *common, "--driver-name", node.driver_name, GPU],
                       cwd=REPO, env=env, capture_output=True, text=True, check=True)
        _wait(lambda: True if GPU in _taints(cluster) and not _taints(cluster)[GPU] else None, "the taint gone", proc)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def _status(sysdra, common, env) -> dict | None:
    out = subprocess.run([*sysdra, "status", "-o", "json", "--kubelet-dir", common[-1], "--driver-name", "sysdra.io",
                          "--config", common[1]], cwd=REPO, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        return None
    doc = json.loads(out.stdout)
    return doc if doc["devices"]["byHealth"] else None
