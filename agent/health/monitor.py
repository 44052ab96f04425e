"""HealthMonitor: runs the checks on a timer and on inventory changes, keeps the current
verdict per device and wakes the open health streams.

Every round (at most ``health_interval`` apart, <= 10 s) wakes the streams, so each
sends the full list again; a round that changes a verdict runs right after the change
is seen (timer or ``on_inventory``) and its result goes out at once. With ``watch_links``
(the daemon turns it on when it manages the real host, root ``/``) a kernel link event
re-checks the NICs of that interface at once (``agent/health/linkwatch.py``).

A round re-reads what no event reports. Once the daemon says which changes its watchers
report (``events_report``: PCI functions added, removed, bound, unbound; NIC links), a timer
round re-checks only the devices with a polled signal (device nodes, AER, habanalabs status,
Alveo ``ready``, links without link events: ``checks.polled``) and carries the other verdicts
over: an event about them would have started a full round (``on_inventory``, lost link events)
or re-checked them (a link event). A full round still runs at least every ``FULL_SWEEP``
seconds, so even a lost event is caught within a minute.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass
from typing import Callable

from agent import rebinds
from agent.health.checks import UNHEALTHY, UNKNOWN, Memory, Verdict, check, polled, truncate
from agent.health.faults import FaultStore, KeptFaults
from agent.health.gpuevents import GpuEvents
from agent.health.gpumemory import RowRemapReader
from agent.health.linkwatch import LinkWatch
from agent.health.taints import taint_for
from agent.rtnetlink import listen_on_host
from agent.settings import Settings
from discovery.gpuways import partition_names, whole_unusable
from discovery.models import Device, Inventory
from discovery.nvidia_driver import DriverFilesCache
from discovery.sysfs import HostFS

log = logging.getLogger(__name__)

FULL_SWEEP = 60.0  # seconds: event-reported signals are re-read at least this often anyway


@dataclass(frozen=True, slots=True)
class DeviceState:
    verdict: Verdict
    checked_at: float  # Unix seconds of the check that produced it


class Subscriber:
    """One open stream: woken after every round; ``closed`` when the monitor stops."""

    def __init__(self):
        self.event = asyncio.Event()
        self.closed = False


class HealthMonitor(GpuEvents):
    """Device health: rounds, verdicts, streams; NVIDIA events and MPS daemons' faults from ``GpuEvents``."""

    def __init__(self, settings: Settings, inventory_fn: Callable[[], Inventory | None]):
        self.fs = HostFS(settings.root)
        self.nvidia_files = DriverFilesCache(settings.root, settings.nvidia_driver_root)
        self.settings = settings
        self.xid = None  # agent.health.xid.XidWatch once NVML's events are watched
        self.row_remaps: RowRemapReader | None = None  # NVIDIA GPUs' memory repairs, once NVML is open
        self.kept = KeptFaults(FaultStore(settings.plugin_dir, settings.root))  # XID/ECC faults across restarts
        self._nvml_missing = False  # watch_gpu_events found no NVML: rounds ask again
        self.nvml_up: Callable[[], None] = lambda: None  # NVML came up after the agent (the daemon rescans)
        self.pool = settings.node_name
        self.interval = settings.health_interval
        self._inventory_fn = inventory_fn
        self._latest: Inventory | None = None  # from on_inventory, preferred over inventory_fn
        self._known: dict[str, Device] = {}  # last record of every device ever discovered
        self._memory: dict[str, Memory] = {}
        self.states: dict[str, DeviceState] = {}
        self.taint_hold = settings.taint_hold  # seconds a recovered device stays tainted (taints)
        self.taint_effect, self.taint_effects = settings.taint_effect, settings.taint_effects  # (SIGHUP sets them)
        self._tainted: dict[str, tuple[float, list[dict]]] = {}  # device -> (last seen unhealthy, its taint)
        self._swapped: list[str] = []  # devices found replaced by another in their slot this round (_drop_swapped)
        self.clock = time.monotonic
        self._subscribers: set[Subscriber] = set()
        self._round = asyncio.Lock()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._links: LinkWatch | None = None
        self._link_checks: set[asyncio.Task] = set()
        self.rounds = 0
        self.full_rounds = 0
        self.link_checks = 0
        self._present_names: set[str] = set()
        self._present_of: Inventory | None = None  # the inventory _present_names was built from
        self._reports: Callable[[], tuple[bool, bool]] = lambda: (False, False)  # see events_report
        self._last_full = float("-inf")  # time.monotonic() of the last full round
        self._daemon_faults: dict[str, tuple[str, str] | None] = {}  # GPU UUID -> its MPS daemon's fault
        self._partition_names: dict[str, tuple[Device, list[str]]] = {}  # GPU -> (its record, its partitions)
        self._on_nvidia: set[str] = set()  # PCI addresses of the GPUs on nvidia as of the last round (gpuevents)
        self.partition_faults: dict[str, tuple[str, str]] = {}  # MIG device -> its own fault (code, message): gpuevents

    # --- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:
        """First round now (so the first stream has data), then the timer."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        await self.check_now()
        self._task = asyncio.create_task(self._run(), name="health-monitor")

    async def watch_links(self, kernel: bool) -> bool:
        """Re-check a NIC as soon as the kernel reports a link change on its interface, in the
        host's network namespace (``agent.rtnetlink.host_events_socket``: ``kernel``, whether the
        root's sys is the kernel's). Call after ``start``. False (logged) when none can be heard."""
        links = LinkWatch(self._on_links)
        if not await listen_on_host(links.start, self.settings.root, kernel, "link"):
            return False
        self._links = links
        return True

    def events_report(self, reports: Callable[[], tuple[bool, bool]]) -> None:
        """``reports()`` -> (functions, links): which changes the daemon's watchers report
        right now, so timer rounds need not poll them. ``functions``: PCI functions added,
        removed, bound or unbound (the watcher rescans, then ``on_inventory``); ``links``:
        NIC link state (file events on a fixture root; ``watch_links`` adds it on the host).
        Until this is called every round checks everything."""
        self._reports = reports

    def _reported(self) -> tuple[bool, bool]:
        functions, links = self._reports()
        return functions, links or self._links is not None

    def _on_links(self, interfaces: set[str] | None) -> None:
        if interfaces is None:  # events were lost: a full round
            if self._wake is not None:
                self._wake.set()
            return
        names = [n for n, d in self._known.items() if d.nic and any(i.name in interfaces for i in d.nic.interfaces)]
        if names:
            self._spawn(self.check_devices(names))

    async def stop(self) -> None:
        if self.xid is not None:
            self.xid.stop()
        if self._links is not None:
            self._links.stop()
            self._links = None
        for task in list(self._link_checks):
            task.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for sub in list(self._subscribers):
            sub.closed = True
            sub.event.set()

    def on_inventory(self, inv: Inventory) -> None:
        """Call after every rescan (from any thread): checks run again right away."""
        self._latest = inv
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _run(self) -> None:
        while True:
            woken = False  # by on_inventory or lost link events: something changed, check everything
            try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel racing the wake-up
                async with asyncio.timeout(self.interval):
                    await self._wake.wait()
                    woken = True
            except TimeoutError:
                pass
            self._wake.clear()
            full = woken or not self._reported()[0] or time.monotonic() - self._last_full >= FULL_SWEEP
            try:
                await self.check_now(full=full)
                self._watch_late_nvml()
                self._watch_new_gpus()
            except Exception:  # a bug in a rule must not stop the resends
                log.exception("health check round failed")

    # --- checks -------------------------------------------------------------------
    async def check_now(self, full: bool = True) -> dict[str, DeviceState]:
        """One round; ``full=False``: only the devices ``checks.polled`` names (timer rounds)."""
        async with self._round:
            if full:
                self._last_full = time.monotonic()
            states = await asyncio.to_thread(self._check_all, full)
            self._drop_swapped()
            changed = [n for n, st in states.items() if n not in self.states or self.states[n].verdict != st.verdict]
            self.states = states
            self.rounds += 1
            self.full_rounds += full
            self._report(changed, wake_all=True)
            return states

    async def check_devices(self, names: list[str]) -> None:
        """Check a few devices now (a link, XID or MPS event): a few sysfs reads each, and an
        NVIDIA GPU's driver files, in a worker thread as rounds are. Streams are woken only if a
        verdict changed; the next round resends all anyway."""
        async with self._round:  # the lock spans the thread: rounds share _memory and the driver-files cache
            checked = await asyncio.to_thread(self._check_some, names)
            states = dict(self.states)
            changed = []
            for name, state in checked.items():
                states[name] = state
                if name not in self.states or self.states[name].verdict != state.verdict:
                    changed.append(name)
            self.states = states
            self.link_checks += 1
            self._report(changed)

    def _check_some(self, names: list[str]) -> dict[str, DeviceState]:
        present = self._present_names  # as of the last round: a new inventory starts a round anyway
        now = time.time()
        files = functools.cache(self.nvidia_files.get)
        return {name: DeviceState(self._verdict(name, present, now, files), now) for name in names if name in self._known}

    def _report(self, changed: list[str], wake_all: bool = False) -> None:
        """Log changed verdicts; wake the streams (every round resends the full list)."""
        for name in changed:
            v = self.states[name].verdict
            log.log(logging.WARNING if v.health == UNHEALTHY else logging.INFO,
                    "device %s health %s: %s", name, v.health, v.message)
        if changed or wake_all:
            for sub in self._subscribers:
                sub.event.set()

    def _present(self) -> set[str]:
        inv = self._latest if self._latest is not None else self._inventory_fn()
        if inv is not None and inv is self._present_of:  # the same inventory as last round: same answer
            return self._present_names
        self._present_of = inv
        present = set()
        # replaced whole, never changed in place: the loop's look-ups (link events, daemon faults) go
        # through it while this runs in a round's thread
        known = dict(self._known)
        for dev in (inv.devices if inv is not None else ()):
            present.add(dev.name)
            if (was := known.get(dev.name)) is not None and was is not dev and _another(was, dev):
                log.info("device %s: another device in its slot now: the old one's health history and taint dropped",
                         dev.name)
                self._memory.pop(dev.name, None)  # its AER hold, its last driver: the old device's
                self._swapped.append(dev.name)
            known[dev.name] = dev
            mem = self._memory.get(dev.name)
            if mem is None:
                mem = self._memory[dev.name] = Memory()
                if dev.gpu is not None and dev.gpu.nvidia_uuid:  # reported before the GPU was known
                    mem.daemon_fault = self._daemon_faults.get(dev.gpu.nvidia_uuid)
            if dev.pci.driver:
                mem.driver = dev.pci.driver
        self._known = known
        self._present_names = present
        return present

    def _verdict(self, name: str, present: set[str], now: float, nvidia_files=None) -> Verdict:
        dev = self._known[name]
        if rebinds.by_agent(self.fs.path("sys/bus/pci/devices", dev.pci.bdf), dev.pci.driver if name in present else None):
            old = self.states.get(name)  # the agent's own rebind (VFIO), not yet rescanned: no news
            return old.verdict if old is not None else Verdict(UNKNOWN, "being moved to another driver by the agent")
        remaps = self.row_remaps.read if self.row_remaps is not None else None
        verdict = check(self.fs, self._known[name], self._memory[name], now, nvidia_files or self.nvidia_files.get, remaps)
        if name not in present and verdict.health != UNHEALTHY:
            verdict = Verdict(UNHEALTHY, truncate(f"no longer discovered on this node ({verdict.message})"),
                              "not-discovered")
        return verdict

    def _check_all(self, full: bool = True) -> dict[str, DeviceState]:
        seen = self._present_of
        present = self._present()
        if self.kept.refresh() or self._present_of is not seen or self.kept.pending:  # kept faults onto new GPUs too
            self.kept.apply(self._known, self._memory, self.partition_faults)
        now = time.time()
        files = functools.cache(self.nvidia_files.get)  # the driver's files looked up once a round, not once a GPU
        if full:
            return {name: DeviceState(self._verdict(name, present, now, files), now) for name in list(self._known)}
        states, links = {}, self._reported()[1]
        for name in list(self._known):
            old = self.states.get(name)
            if old is None or polled(self._known[name], self._memory[name], links):
                states[name] = DeviceState(self._verdict(name, present, now, files), now)
            else:  # no event about it came, so what was checked still holds now
                states[name] = DeviceState(old.verdict, now)
        return states

    # --- queries ------------------------------------------------------------------
    def device_states(self) -> list[tuple[str, DeviceState]]:
        """What the health stream reports, by name: every device's state, and with ``--partitions``
        each published partition with its GPU's (the checks see only the GPU; its faults are theirs),
        or its own fault (an XID in its MIG instance) while its GPU is well.
        A whole GPU in MIG mode without NVML is not published (gpuways.whole_unusable): its MIG devices are."""
        out = [(n, s) for n, s in self.states.items() if n not in self._known or not whole_unusable(self._known[n])]
        if self.settings.partitions:
            for name, state in self.states.items():
                out.extend((p, self._partition_state(p, state)) for p in self._partitions_of(name))
        return sorted(out, key=lambda x: x[0])

    def _partition_state(self, name: str, gpu: DeviceState) -> DeviceState:
        fault = self.partition_faults.get(name)
        if fault is None or gpu.verdict.health == UNHEALTHY:
            return gpu
        return DeviceState(Verdict(UNHEALTHY, truncate(fault[1]), fault[0]), gpu.checked_at)

    def _faulted_partitions(self) -> dict[str, DeviceState]:
        """The published MIG devices with a fault of their own, and their states."""
        if not self.partition_faults or not self.settings.partitions:
            return {}
        return {p: self._partition_state(p, state) for name, state in self.states.items()
                for p in self._partitions_of(name) if p in self.partition_faults}

    def _published_partition(self, name: str) -> bool:
        """``name`` is a MIG device of a GPU on the node (its own fault may have cleared)."""
        return self.settings.partitions and any(name in self._partitions_of(g) for g in self.states)

    def _partitions_of(self, name: str) -> list[str]:
        dev = self._known.get(name)
        if dev is None or dev.gpu is None or dev.gpu.partitioning is None:
            return []
        hit = self._partition_names.get(name)
        if hit is None or hit[0] is not dev:  # discovery reuses an unchanged device's object
            hit = self._partition_names[name] = (dev, partition_names(dev, self.settings.compatibility_groups))
        return hit[1]

    def snapshot(self) -> dict[str, tuple[str, str]]:
        """``{device: (HEALTHY|UNHEALTHY|UNKNOWN, message, reason)}`` for metrics, status, taints."""
        states = {**self.states, **self._faulted_partitions()}
        return {n: (s.verdict.health, s.verdict.message, s.verdict.reason) for n, s in sorted(states.items())}

    def taints(self) -> dict[str, list[dict]]:
        """``{device: [DeviceTaint]}`` for unhealthy devices (ResourceSlice encoding). A device
        that recovers keeps its taint until ``taint_hold`` seconds after it was last seen
        unhealthy: a flapping link stays tainted instead of costing a slice write per flap and
        drawing new claims between flaps. The rounds (every ``interval``) republish, so a held
        taint goes within an interval of its hold's end; a device gone from the node goes at once."""
        now = self.clock()
        states = {**self.states, **self._faulted_partitions()}  # a MIG device's own fault: its own taint
        for n, s in states.items():
            if s.verdict.health == UNHEALTHY:
                self._tainted[n] = (now, [taint_for(s.verdict.reason, self.taint_effect, self.taint_effects)])
        for n, (seen, _) in list(self._tainted.items()):
            gone = n not in states and not self._published_partition(n)  # a MIG device whose fault cleared stays
            if gone or (seen != now and now - seen >= self.taint_hold):  # (taint_hold 0: until it recovers)
                del self._tainted[n]
        return {n: taint for n, (_, taint) in sorted(self._tainted.items())}

    def check_once(self) -> dict[str, list[dict]]:
        """One full round now, in the caller's thread (no loop needed) -> ``taints()``: what the
        first published slices carry with ``--taint-unhealthy``, before the monitor runs."""
        self.states = self._check_all(full=True)
        self._drop_swapped()
        return self.taints()

    def _drop_swapped(self) -> None:
        """Another device in a slot (the round's thread found it) holds no taint of the old one's:
        on the loop, where ``taints`` runs."""
        swapped, self._swapped = self._swapped, []
        for name in swapped:
            self._tainted.pop(name, None)

    def subscribe(self) -> Subscriber:
        sub = Subscriber()
        self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self._subscribers.discard(sub)


def _another(was: Device, now: Device) -> bool:
    """Whether ``now`` is another device than ``was`` in the same slot: another PCI vendor or
    device ID, or another GPU UUID (both known)."""
    if (was.pci.vendor_id, was.pci.device_id) != (now.pci.vendor_id, now.pci.device_id):
        return True
    old, new = (d.gpu.nvidia_uuid if d.gpu is not None else None for d in (was, now))
    return None not in (old, new) and old != new


def first_round(settings: Settings, inventory: Inventory) -> tuple[dict[str, list[dict]], dict[str, tuple[str, str, str]]]:
    """The taints and health of one round on ``inventory``, for the slices published (and the
    status reported) before the monitor runs: a kept fault is tainted and reported from the start."""
    monitor = HealthMonitor(settings, lambda: inventory)
    return monitor.check_once(), monitor.snapshot()
