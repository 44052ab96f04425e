"""Timer rounds when the daemon's watchers report changes (``HealthMonitor.events_report``):
a timer round re-reads only what no event reports; everything else is caught by the full
round an event starts, or by the full sweep that runs at least every ``FULL_SWEEP``."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from agent.health import monitor as monitor_mod
from agent.health.checks import Memory, polled
from agent.health.monitor import HealthMonitor
from discovery.inventory import scan
from tests.conftest import copy_profile, profile_root, write_file
from tests.kubelet_standin import settings_for

VM_NIC = "nic-0000-05-00-0"  # virtio NIC, interface eth0, no device nodes
VM_GPU = "gpu-0000-06-00-0"  # nvidia, /dev/nvidia0
VM_NIC_NET = "sys/devices/pci0000:00/0000:00:01.4/0000:05:00.0/virtio12/net/eth0"
VM_GPU_DIR = "sys/devices/pci0000:00/0000:00:01.5/0000:06:00.0"


def vm_monitor(tmp_path):
    """(root, inventory, monitor) of a private copy of the vm-numa-none node, 50 ms rounds."""
    root = copy_profile(tmp_path, "vm-numa-none")
    inv = scan(root)
    return root, inv, HealthMonitor(settings_for(str(tmp_path), root=root, health_interval=0.05), lambda: inv)


def run(coro):
    asyncio.run(asyncio.wait_for(coro, 60))


async def rounds(monitor: HealthMonitor, n: int) -> None:
    """Wait until ``n`` more rounds have run."""
    target = monitor.rounds + n
    while monitor.rounds < target:
        await asyncio.sleep(0.01)


def test_polled_names_the_signals_no_event_reports(tmp_path):
    inv = scan(profile_root("vm-numa-none"))
    nic, gpu = inv.by_name()[VM_NIC], inv.by_name()[VM_GPU]
    quiet = Memory(driver="virtio-pci", aer=False)
    assert not nic.device_nodes and gpu.device_nodes
    assert polled(nic, quiet, links_reported=False)  # its link is read every round
    assert not polled(nic, quiet, links_reported=True)  # link events and rescans report all it has
    assert polled(nic, Memory(aer=True), links_reported=True)  # an AER counter is only ever polled
    assert polled(gpu, Memory(driver="nvidia", aer=False), links_reported=True)  # device nodes
    for profile in ("accel-gaudi", "alveo"):  # habanalabs status, Alveo ready
        for dev in scan(profile_root(profile)).devices:
            if dev.kind in ("accelerator", "fpga"):
                assert polled(dev, quiet, links_reported=True), dev.name


def test_timer_rounds_skip_what_events_report_and_still_catch_polled_faults(tmp_path):
    root, inv, monitor = vm_monitor(tmp_path)

    async def main():
        await monitor.start()
        monitor.events_report(lambda: (True, True))
        try:
            assert monitor.snapshot()[VM_NIC][0] == "HEALTHY" and monitor.snapshot()[VM_GPU][0] == "HEALTHY"
            full, before = monitor.full_rounds, monitor.states[VM_NIC].checked_at
            write_file(root, VM_NIC_NET + "/carrier", "0\n")  # no event told the monitor
            os.unlink(os.path.join(root, "dev/nvidia0"))  # nothing reports this: polled
            await rounds(monitor, 3)
            assert monitor.full_rounds == full, "a timer round checked everything"
            snap = monitor.snapshot()
            assert snap[VM_GPU][0] == "UNHEALTHY" and "/dev/nvidia0 missing" in snap[VM_GPU][1]
            assert snap[VM_NIC][0] == "HEALTHY"  # carried over, not read ...
            assert monitor.states[VM_NIC].checked_at > before  # ... and reported as holding now
            monitor.on_inventory(inv)  # the rescan a file event starts: a full round at once
            await rounds(monitor, 1)
            assert monitor.full_rounds == full + 1
            assert monitor.snapshot()[VM_NIC][:2] == ("UNHEALTHY", "interface eth0 carrier 0")
        finally:
            await monitor.stop()
    run(main())


def test_a_full_sweep_catches_a_lost_event(tmp_path, monkeypatch):
    monkeypatch.setattr(monitor_mod, "FULL_SWEEP", 0.3)
    root, inv, monitor = vm_monitor(tmp_path)

    async def main():
        await monitor.start()
        monitor.events_report(lambda: (True, True))
        try:
            os.unlink(os.path.join(root, VM_GPU_DIR, "driver"))  # the unbind's event was lost
            write_file(root, VM_NIC_NET + "/operstate", "down\n")
            for _ in range(100):
                await rounds(monitor, 1)
                snap = monitor.snapshot()
                if snap[VM_NIC][0] == "UNHEALTHY":
                    break
            assert snap[VM_NIC][:2] == ("UNHEALTHY", "interface eth0 operstate down")
            assert snap[VM_GPU][:2] == ("UNHEALTHY", "driver nvidia is no longer bound to 0000:06:00.0")
            assert monitor.full_rounds >= 2
        finally:
            await monitor.stop()
    run(main())


@pytest.mark.parametrize("reported", [False, True])
def test_without_link_events_every_round_reads_links(tmp_path, reported):
    """Functions reported alone (uevents, no link events): links stay polled."""
    root, inv, monitor = vm_monitor(tmp_path)

    async def main():
        await monitor.start()
        monitor.events_report(lambda: (reported, False))
        try:
            full = monitor.full_rounds
            write_file(root, VM_NIC_NET + "/carrier", "0\n")
            await rounds(monitor, 2)
            assert monitor.snapshot()[VM_NIC][:2] == ("UNHEALTHY", "interface eth0 carrier 0")
            assert (monitor.full_rounds == full) is reported  # without events every round is full
        finally:
            await monitor.stop()
    run(main())


def test_event_checks_read_off_the_loop_one_round_at_a_time(tmp_path, monkeypatch):
    """A link, XID or MPS event's re-check (``check_devices``) reads sysfs and the NVIDIA driver's
    files in a worker thread, and holds the round lock across it: a round started meanwhile
    begins only after it, so an older verdict never lands over a newer one."""
    root, inv, monitor = vm_monitor(tmp_path)
    monitor.check_once()
    gate, seen = threading.Event(), []
    real_check, real_files = monitor_mod.check, monitor.nvidia_files.get

    def check(fs, dev, *args):
        seen.append((dev.name, gate.is_set(), threading.current_thread()))
        if len(seen) == 1:
            gate.wait(10)  # the event's check stays in its thread until the round below was started
        return real_check(fs, dev, *args)

    def files():
        seen.append(("files", gate.is_set(), threading.current_thread()))
        return real_files()

    monkeypatch.setattr(monitor_mod, "check", check)
    monitor.nvidia_files.get = files
    write_file(root, VM_NIC_NET + "/carrier", "0\n")

    async def main():
        loop_thread = threading.current_thread()
        event = asyncio.create_task(monitor.check_devices([VM_GPU, VM_NIC]))
        while not seen:
            await asyncio.sleep(0.01)
        full = asyncio.create_task(monitor.check_now())
        for _ in range(20):  # the round's turn to run, were it not for the lock
            await asyncio.sleep(0.01)
        gate.set()
        await asyncio.gather(event, full)
        assert all(t is not loop_thread for _, _, t in seen)
        assert [n for n, opened, _ in seen if not opened] == [VM_GPU], "the round ran beside the event's checks"
        assert [n for n, _, _ in seen[:3]] == [VM_GPU, "files", VM_NIC]  # the event's, in its order
        assert monitor.snapshot()[VM_NIC][:2] == ("UNHEALTHY", "interface eth0 carrier 0")
    run(main())


def test_the_agent_tells_its_monitor_what_its_watchers_report(tmp_path):
    """The daemon hands its hardware watcher's reports to the monitor (service/kubeletside.py):
    on a fixture root its file watch reports functions and links, so the running agent's timer
    rounds re-read only the polled signals (a device node gone is still caught), and a link
    change below sys/ reaches health through the rescan its file event starts, a full round."""
    from agent.service.daemon import Agent

    root = copy_profile(tmp_path, "vm-numa-none")
    agent = Agent(settings_for(str(tmp_path), root=root, metrics_address="", health_interval=0.05, debounce=0.05))

    async def until(predicate, what: str) -> None:
        for _ in range(3000):
            if predicate():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"not reached: {what}")

    async def main():
        stop = asyncio.Event()
        running = asyncio.create_task(agent.run(stop))
        try:
            await until(lambda: agent.health is not None and agent.rescans >= 2,
                        "the kubelet side, and the rescan after the file watch")
            await until(lambda: agent.watcher.reports() == (True, True), "the file watch armed")
            await rounds(agent.health, 2)  # the full round the start-up rescan asked for has run
            full = agent.health.full_rounds
            os.unlink(os.path.join(root, "dev/nvidia0"))  # no event: polled
            await until(lambda: agent.health.snapshot()[VM_GPU][0] == "UNHEALTHY", "the GPU's node missed")
            await rounds(agent.health, 3)
            assert agent.health.full_rounds == full, "the agent's timer rounds read everything"
            write_file(root, VM_NIC_NET + "/carrier", "0\n")
            await until(lambda: agent.health.snapshot()[VM_NIC][0] == "UNHEALTHY", "the file event's rescan")
            assert agent.health.full_rounds > full
        finally:
            stop.set()
            assert await asyncio.wait_for(running, 60) == 0
    run(main())


def test_a_link_event_while_a_round_adds_devices(tmp_path):
    """A hotplugged NIC's link messages come while the round its uevent started adds it (and
    others) to the devices known, in the round's worker thread: the link event's look-up on the
    loop must not fail with 'dictionary changed size during iteration' (its re-check lost)."""
    import sys

    root, inv, monitor = vm_monitor(tmp_path)
    monitor.check_once()
    nic = inv.by_name()[VM_NIC]
    more = inv.replace(devices=inv.devices + tuple(nic.replace(name=f"nic-ffff-00-{i:05x}") for i in range(20000)))
    errors = []

    async def main():
        monitor._latest = more  # what on_inventory hands over; the round's thread takes it in (_present)
        adding = asyncio.create_task(asyncio.to_thread(monitor._present))
        while not adding.done():
            try:
                monitor._on_links({"nothing-here0"})  # as LinkWatch calls it, on the loop
            except RuntimeError as err:
                errors.append(err)
                break
            await asyncio.sleep(0)
        await adding

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        run(main())
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors
