"""A claim's netdev goes into its pod: at RunPodSandbox the agent moves each netdev planned at
prepare (agent/nri/moves.py) into the sandbox's network namespace under its pod name and sets
it up; at StopPodSandbox/RemovePodSandbox it moves it back under its host name.

Every move is recorded before the kernel is touched (state ``moving``/``returning``) and after
(``in-pod`` / record dropped). After a crash, :meth:`NetdevMover.synchronized` (the runtime's
list of running sandboxes, sent on every (re)connection) finishes what the records say:
a move of a running sandbox is completed, anything else goes back to the host. A physical
netdev whose namespace was destroyed is back on the host under its pod name (the kernel
moves it); it is renamed there.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading

from pydantic import ValidationError

from agent.nri import podmeta, rtnl
from agent.nri.moves import Move, MoveRecords
from agent.prepare.netdevs import NetdevPlan
from agent.nri.plugin import NriPlugin, Pod
from agent.nri.ttrpc import Refusal
from agent.nri.sandboxes import Sandboxes
from agent.prepare.checkpoint import Checkpoint
from agent.prepare.checkpoint_format import COMPLETED

log = logging.getLogger(__name__)
RECONCILE_INTERVAL = 10.0  # seconds between looks for pod namespaces gone unannounced


class NetdevError(Refusal):
    """A pod cannot get its netdevs: the runtime fails the sandbox with this message."""


class NetdevMover(Sandboxes):
    """Sandbox events that move claims' netdevs. ``host_netns``: the host's network namespace
    (the agent's own; a test's namespace in tests)."""

    def __init__(self, checkpoint_path: str, records_path: str, host_netns: str = "/proc/self/ns/net",
                 fault=lambda point: None, moved=lambda claim, plan, netns: None):
        super().__init__()
        self.moved = moved  # the device metadata's deferred update (agent/nri/podmeta.py)
        self.checkpoint_path, self.host_netns = checkpoint_path, host_netns
        self.records = MoveRecords(records_path)
        # one sandbox's moves at a time (the records file has one writer), held in the worker
        # thread: a request cancelled when the runtime goes away leaves its thread running
        self._lock = threading.Lock()
        self.fault = fault  # tests: SIGKILL between steps
        self._checkpoint: Checkpoint | None = None  # the driver's, as last read (under _lock)

    # --- events --------------------------------------------------------------
    async def synchronized(self, pods: list[Pod]) -> None:
        await super().synchronized(pods)
        await asyncio.to_thread(self._locked, self._recover, {p.id for p in pods})

    async def pod_started(self, pod: Pod) -> None:
        await super().pod_started(pod)
        await asyncio.to_thread(self._locked, self._give, pod)

    async def pod_stopped(self, pod: Pod) -> None:
        await super().pod_stopped(pod)
        await asyncio.to_thread(self._locked, self._take_back, pod.id)

    async def pod_removed(self, pod: Pod) -> None:
        await super().pod_removed(pod)
        await asyncio.to_thread(self._locked, self._take_back, pod.id)

    # --- work (worker threads) ---------------------------------------------------
    def _locked(self, work, *args):
        with self._lock:
            return work(*args)

    def planned(self, pod: Pod) -> list[tuple[str, NetdevPlan]]:
        """(claim UID, netdev) of the prepared claims reserved for ``pod``."""
        try:
            claims = self._prepared_claims()
        except (OSError, ValueError) as err:  # failing every pod of the node would be worse
            log.error("pod %s/%s: the prepared claims cannot be read, no netdevs moved: %s", pod.namespace, pod.name, err)
            return []
        out = []
        for uid, entry in claims.items():
            pods, netdevs = entry.get("pods"), entry.get("netdevs")
            if entry.get("state") != COMPLETED or not isinstance(pods, list) or pod.uid not in pods:
                continue
            try:
                out += [(uid, NetdevPlan.model_validate(raw)) for raw in netdevs]
            except (ValidationError, TypeError) as err:  # the checkpoint is input: this claim's error
                raise NetdevError(f"claim {uid}: bad netdev record: {str(err)[:200]}") from None
        return out

    def _prepared_claims(self) -> dict[str, dict]:
        """The checkpoint's entries, read again only when a save changed the files: every pod
        of the node passes here before it starts, most without a claim of ours."""
        if self._checkpoint is None:
            self._checkpoint = Checkpoint.load(self.checkpoint_path, move_corrupt=False)
        else:
            self._checkpoint.reload_if_changed()
        return self._checkpoint.claims

    def _give(self, pod: Pod) -> None:
        self.records.ensure_loaded()
        plans = self.planned(pod)
        if not plans:
            return
        if pod.netns is None:
            raise NetdevError(f"pod {pod.namespace}/{pod.name} uses the host network: the netdevs of its claims "
                              f"({', '.join(p.host for _, p in plans)}) cannot be given to it")
        try:
            for uid, plan in plans:
                self._move_in(Move(sandbox=pod.id, claim=uid, device=plan.device, host=plan.host, pod=plan.pod,
                                   netns=pod.netns, state="moving"))
        except (rtnl.LinkError, OSError) as err:
            self._take_back(pod.id)
            raise NetdevError(f"pod {pod.namespace}/{pod.name}: moving its netdevs failed: {err}") from None
        for uid, plan in plans:  # before the pod's containers are created: they read it at start
            self.moved(uid, plan, pod.netns)

    def _move_in(self, move: Move) -> None:
        current = self.records.moves.get(move.key)
        if current is not None and current.state == "in-pod":
            return  # the runtime repeated the event
        self.records.put(move)
        self.fault("netdev:recorded")
        if not rtnl.has_link(move.netns, move.pod):
            rtnl.move(self.host_netns, move.host, move.netns, move.pod)
        self.fault("netdev:moved")
        rtnl.set_up(move.netns, move.pod)
        self.records.put(move.model_copy(update={"state": "in-pod", "mac": rtnl.hardware_address(move.netns, move.pod)}))
        log.info("netdev %s is %s in pod sandbox %s", move.host, move.pod, move.sandbox)

    def _take_back(self, sandbox: str) -> None:
        self.records.ensure_loaded()
        problems = []
        for move in self.records.of_sandbox(sandbox):
            try:
                self._move_out(move)
            except (rtnl.LinkError, OSError) as err:
                problems.append(f"{move.pod}: {err}")
        if problems:  # the record stays: the next event or start tries again
            raise NetdevError("giving netdevs back to the host failed: " + "; ".join(problems))

    def _move_out(self, move: Move) -> None:
        returning = move.model_copy(update={"state": "returning"})
        self.records.put(returning)
        self.fault("netdev:returning")
        if rtnl.has_link(self.host_netns, move.host):
            pass  # never moved, or already back
        elif os.path.exists(move.netns) and _has(move.netns, move.pod):
            rtnl.move(move.netns, move.pod, self.host_netns, move.host)
        elif rtnl.has_link(self.host_netns, move.pod) and move.mac and rtnl.hardware_address(self.host_netns, move.pod) == move.mac:
            rtnl.rename(self.host_netns, move.pod, move.host)  # its namespace went away: the kernel brought it back
        else:
            log.warning("netdev %s (%s in sandbox %s) is nowhere: a virtual link dies with its namespace",
                        move.host, move.pod, move.sandbox)
        self.fault("netdev:returned")
        self.records.drop(returning)
        log.info("netdev %s is back on the host (from pod sandbox %s)", move.host, move.sandbox)

    def _reconcile(self) -> None:
        """Records of sandboxes whose network namespace is gone, without the runtime telling
        (containerd forgets its pods' NRI state when it restarts: their Stop/RemovePodSandbox
        never come): what the kernel gave back is renamed, the records go."""
        self.records.ensure_loaded()
        for move in list(self.records.moves.values()):
            if move.state == "in-pod" and not (os.path.exists(move.netns) and _has(move.netns, move.pod)):
                try:
                    self._move_out(move)
                except (rtnl.LinkError, OSError) as err:
                    log.error("netdev %s of a gone pod sandbox %s: %s", move.host, move.sandbox, err)

    async def watch(self, interval: float = RECONCILE_INTERVAL) -> None:
        while True:
            await asyncio.sleep(interval)
            await asyncio.to_thread(self._locked, self._reconcile)

    def _recover(self, running: set[str]) -> None:
        self.records.load()
        for move in list(self.records.moves.values()):
            try:
                if move.sandbox in running and move.state != "returning":
                    self._move_in(move)
                else:
                    self._move_out(move)
            except (rtnl.LinkError, OSError) as err:
                log.error("netdev %s of pod sandbox %s: finishing its move failed: %s", move.host, move.sandbox, err)


def _has(netns: str, name: str) -> bool:
    try:
        return rtnl.has_link(netns, name)
    except OSError as err:  # the namespace's file is gone or is no namespace any more
        if err.errno in (errno.ENOENT, errno.EINVAL):
            return False
        raise


def follow_pod_sandboxes(settings) -> list[asyncio.Task]:
    """The agent's NRI plugin as a task (none when ``nri_socket`` is empty): it moves the
    netdevs of the claims the driver prepared (their checkpoint) into their pods."""
    if not settings.nri_socket:
        return []
    mover = NetdevMover(os.path.join(settings.plugin_dir, "checkpoint.json"),
                        os.path.join(settings.plugin_dir, "netdev-moves.json"), host_netns(settings.root),
                        moved=podmeta.updater(settings))
    loop = asyncio.get_running_loop()
    return [loop.create_task(NriPlugin(settings.nri_socket, mover).run(), name="nri"),
            loop.create_task(mover.watch(), name="nri-netdevs")]


def host_netns(root: str) -> str:
    """The host's network namespace: its init's under ``root`` (a DaemonSet's ``/host/proc``),
    else the agent's own (a fixture root: the agent runs in the host's namespace)."""
    init = os.path.join(root, "proc", "1", "ns", "net")
    return init if os.path.exists(init) else "/proc/self/ns/net"
