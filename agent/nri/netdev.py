"""A claim's netdev goes into its pod: at RunPodSandbox the agent moves each netdev its claims'
``netdevs`` step planned at prepare (prepare/steps/netdev.py) into the sandbox's network
namespace under its pod name, configured (prepare/netmove.py); at StopPodSandbox/RemovePodSandbox
it moves it back under its host name. A netdev whose ``NicConfig`` names an IPAM pool gets the
pool's lease for the sandbox (prepare/ipam.py), in its record before it is used, and gives it back
when it comes back.

The records are the claim's checkpoint entry, the step protocol's (prepare/records.py,
``NetdevMove``): every move is saved there before the kernel is touched (``moving``/``returning``)
and after (``in-pod``/``planned``), holding the plugin's ``serialize.lock`` as prepare and
unprepare do, so a move and an unprepare never interleave. After a crash,
:meth:`NetdevMover.synchronized` (the runtime's list of running sandboxes, sent on every
(re)connection) finishes what the records say: a move into a running sandbox is completed (its
metadata written), anything else goes back to the host. A checkpoint that cannot be read is
repaired by the in-process driver's recovery, as at the agent's start (:meth:`NetdevMover._load`).
The records of an entry a newer sysdra wrote (prepare/checkpoint_entries.py) are that one's: never
moved nor saved here (a save would drop the fields this agent does not know).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading

from pydantic import ValidationError

from agent.kubeletplugin.types import ClaimRef
from agent.nri import podmeta
from agent.nri.movelock import LOCK_TIMEOUT, MoveLock
from agent.nri.netclaims import SEEN, Claims, away, away_in, for_pod, lost_for, not_in, runs
from agent.nri.plugin import Pod
from agent.nri.sandboxes import Sandboxes
from agent.nri.ttrpc import Refusal
from agent.prepare import hostuse, netmove, rtnl
from agent.prepare.ipam import Ipam, IpamError
from agent.prepare.checkpoint import Checkpoint, CheckpointError
from agent.prepare.checkpoint_format import COMPLETED
from agent.prepare.checkpoint_view import CheckpointView
from agent.prepare.metadata.update import UpdateError
from agent.prepare.records import NetdevMove

log = logging.getLogger(__name__)
RECONCILE_INTERVAL = 10.0  # seconds between looks for pod namespaces gone unannounced


class NetdevError(Refusal):
    """A pod cannot get its netdevs: the runtime fails the sandbox with this message."""


class NetdevMover(Sandboxes):
    """Sandbox events that move claims' netdevs. ``host_netns``: the host's network namespace
    (the agent's own; a test's namespace in tests); ``settings``: for the metadata files (None:
    none written); ``status``: the claim status writer (its ``submit``), or None; ``saved``: the
    in-process driver's last save (``Driver.saved``), which spares a look reading the files;
    ``repair``: the in-process driver's recovery of a damaged checkpoint (``Driver.repair_checkpoint``),
    run holding the locks when the files cannot be read; ``on_saved``: the claims as saved, after an
    event changed records (the status board's view of which netdevs are in their pods)."""

    def __init__(self, plugin_dir: str, host_netns: str = "/proc/self/ns/net", settings=None, status=None,
                 fault=lambda point: None, lock_timeout: float = LOCK_TIMEOUT, saved=None, repair=None, on_saved=None):
        super().__init__()
        self.root = settings.root if settings is not None else "/"  # whose sysfs says a NIC function is on the bus
        self.allow_host_in_use = bool(settings is not None and settings.allow_host_in_use_nics)
        self.ipam = Ipam.of(settings) if settings is not None else None  # the node's IPAM pools (NicConfig ipamPool)
        self.checkpoint_path = os.path.join(plugin_dir, "checkpoint.json")
        self.host_netns, self.settings, self.status = host_netns, settings, status
        self.locks = MoveLock(os.path.join(plugin_dir, "serialize.lock"), lock_timeout)  # within the runtime's deadline
        self._lock = self.locks.thread
        self.fault = fault  # tests: a crash between steps
        self._view = CheckpointView(self.checkpoint_path, saved)  # the look without the plugin's lock
        self._view_lock = asyncio.Lock()  # one look at a time (a whole read runs in a thread)
        self.repair, self.on_saved = repair, on_saved
        self._recovering = False  # a Synchronize's recovery is still to be done
        self._syncs = 0  # Synchronizes so far: a recovery done is the last one's only if no other came meanwhile

    # --- events --------------------------------------------------------------
    def configured(self, request_timeout: float | None) -> None:
        self.locks.follow(request_timeout)

    async def synchronized(self, pods: list[Pod]) -> None:
        await super().synchronized(pods)
        self._recovering, self._syncs = True, self._syncs + 1  # until done: a look (``reconcile``) does it
        this = self._syncs
        try:
            done = await self._run(self._recover, dict(self.pods))
        except NetdevError as err:  # answered all the same: containerd closes a plugin whose Synchronize
            # failed, and pods started until it is back never get their netdevs
            log.warning("NRI: moves under way before are finished later (looked at every %g s): %s",
                        RECONCILE_INTERVAL, err)
            return
        if done is not None:  # None: the runtime gave up on the request first
            self._recovering = self._syncs != this
            self._report(done)  # moves completed: their pods' view

    async def pod_started(self, pod: Pod) -> None:
        await super().pod_started(pod)
        try:
            if await self._concerns(lambda entry: for_pod(entry, pod) and bool(entry.get("netdevs"))
                                    or lost_for(entry, pod)):
                self._report(await self._run(self._give, pod))
        except BaseException:  # the runtime fails the sandbox (or gave up on it): the pod's next one takes the netdevs
            self.pods.pop(pod.id, None)
            raise

    async def pod_stopped(self, pod: Pod) -> None:
        await super().pod_stopped(pod)
        await self._gone(pod)

    async def pod_removed(self, pod: Pod) -> None:
        await super().pod_removed(pod)
        await self._gone(pod)

    async def container_created(self, pod: Pod, container: str) -> None:
        """A container of a pod whose sandbox started unseen (``_late``: its claims' netdevs on the host,
        still in a sandbox of the pod that stopped unannounced, or a move a Synchronize could not finish)
        is created only once they are in the sandbox: moved now, or the creation fails and the kubelet
        tries again. Any other pod's container is answered from the look without the lock."""
        await super().container_created(pod, container)
        if await self._concerns(lambda entry: for_pod(entry, pod) and any(not_in(m, pod.id) for m in entry.get("netdevs") or ()),
                                lambda entry: isinstance(entry, dict) and for_pod(entry, pod)):
            self._report(await self._run(self._give_late, pod))

    async def _gone(self, pod: Pod) -> None:
        if await self._concerns(lambda entry: any(away_in(m, pod.id) for m in entry.get("netdevs") or ())
                                or lost_for(entry, pod)):
            await self._run(self._give_back, pod)

    async def _concerns(self, match, rejected=lambda entry: True) -> bool:
        """Whether a prepared claim's netdev record matches, read without the plugin's lock and
        only as far as saved since the last look (agent/prepare/checkpoint_view.py): every pod of
        the node starts through here, and most have no netdev to wait for a prepare's lock. The
        look is made on the loop when only records were appended (a thread hop cost more than
        reading them), in a worker thread when the files are read whole. The kubelet prepares a
        pod's claims before it asks for its sandbox, so no record of this pod is on its way. An
        unreadable checkpoint (repaired there) or a rejected entry (``rejected``: which concern the
        event) is the locked path's to report."""
        async with self._view_lock:
            try:
                claims = self._view.appended()
                if claims is None:
                    claims = await asyncio.to_thread(self._view.claims)
                refused = self._view.rejected()
            except (CheckpointError, ValueError, OSError):
                return True
        return any(rejected(entry) for entry, _ in refused.values()) or \
            any(match(e) for e in claims.values() if e.get("state") == COMPLETED)

    async def _run(self, work, *args):
        gave_up = threading.Event()  # the runtime's deadline passed: the thread, still at the locks, does nothing
        try:
            return await asyncio.to_thread(self._locked, work, *args, gave_up=gave_up)
        except asyncio.CancelledError:
            gave_up.set()
            raise
        except (UpdateError, CheckpointError, ValueError) as err:  # the locks or the checkpoint: the pod waits
            raise NetdevError(f"the claims' netdev records cannot be used now: {err}") from None

    def _report(self, claims: dict[str, dict] | None) -> None:
        """The claims' ``status.devices`` entries as the moves left them, to the status writer."""
        for uid, entry in (claims or {}).items():
            if self.status is not None and entry.get("deviceStatus") is not None and entry.get("name"):
                self.status(ClaimRef(entry["namespace"], entry["name"], uid), entry["deviceStatus"])

    # --- work (worker threads, holding the locks) ---------------------------------
    def _locked(self, work, *args, gave_up: threading.Event | None = None):
        with self.locks.held():
            claims = Claims(self._load())  # a damaged checkpoint is repaired here, whoever gave up
            if gave_up is not None and gave_up.is_set():  # its sandbox failed: a move would go into a dying netns
                log.info("netdev records not touched: the runtime gave up on the request (its deadline passed)")
                return None
            try:
                return work(claims, *args)
            finally:
                claims.save()  # what was done before a failure stays recorded
                if claims.saved and self.on_saved is not None:
                    self.on_saved(dict(claims.cp.claims))

    def _load(self) -> Checkpoint:
        """The checkpoint, under the locks. Files that cannot be read (damaged) are repaired by the
        driver's recovery, as at the agent's start (moved aside; the entries they still establish,
        else the agent's last save, kept: docs/kubelet-plugin.md), then read once more: one damaged
        file must not fail every pod of the node until the agent restarts."""
        try:
            return Checkpoint.load(self.checkpoint_path, move_corrupt=False)
        except ValueError as err:
            if self.repair is None:
                raise
            log.error("CHECKPOINT CORRUPT at a pod sandbox event: %s; the driver's recovery repairs it", err)
        try:
            self.repair()
        except Exception as err:  # noqa: BLE001 - said; the read below says what is still wrong
            log.error("the checkpoint's repair failed: %s", err, exc_info=not isinstance(err, OSError))
        return Checkpoint.load(self.checkpoint_path, move_corrupt=False)

    def _give(self, claims: Claims, pod: Pod) -> dict[str, dict]:
        if (why := claims.refusal(pod)) is not None:
            raise NetdevError(why)
        mine = [(uid, i, m) for uid, i, m in claims.moves() if pod.uid in (claims.cp.claims[uid].get("pods") or ())]
        if not mine:
            return {}
        if pod.netns is None:
            raise NetdevError(f"pod {pod.namespace}/{pod.name} uses the host network: the netdevs of its claims "
                              f"({', '.join(m.host for _, _, m in mine)}) cannot be given to it")
        for uid, i, m in mine:  # away in another sandbox: back first if that one is gone
            if m.away and m.sandbox != pod.id:
                if runs(m, self.pods):
                    raise NetdevError(f"netdev {m.host} of claim {uid} is in pod sandbox {m.sandbox}, which still runs")
                self._move_out(claims, uid, i, m)
        try:
            seen = {"sandbox": pod.id, "netns": pod.netns, "podRef": f"{pod.namespace}/{pod.name}"}
            mine = [(uid, i, NetdevMove.model_validate(claims.cp.claims[uid]["netdevs"][i]).changed(**seen)) for uid, i, _ in mine]
        except ValidationError as err:  # the runtime's words: never saved unless valid
            raise NetdevError(f"pod {pod.namespace}/{pod.name}: its sandbox is not one a record can name: {err}") from None
        try:  # each netdev on the host found as its NIC function's, whatever its name now
            mine = [(uid, i, netmove.identify(m, self.host_netns, self.root) if m.state == "planned" else m)
                    for uid, i, m in mine]
        except (rtnl.LinkError, OSError) as err:
            raise NetdevError(f"pod {pod.namespace}/{pod.name}: moving its netdevs failed: {err}{netmove.rights_hint(err)}") from None
        for uid, _, m in mine:  # the host may have taken a netdev since prepare checked (a DHCP address, a bond)
            if m.state == "planned" and (why := hostuse.refusal(lambda: self.host_netns, {m.host: m.bdf}, self.allow_host_in_use,
                                                                m.allowHostInUse, "moved into a pod", "NicConfig")):
                raise NetdevError(f"pod {pod.namespace}/{pod.name}: claim {uid}: {m.device}: {why}")
        try:
            for uid, i, m in mine:
                self._move_in(claims, uid, i, m)
        except (rtnl.LinkError, OSError, IpamError) as err:
            failed = f"pod {pod.namespace}/{pod.name}: moving its netdevs failed: {err}{netmove.rights_hint(err)}"
            try:
                self._take_back(claims, pod.id)
            except NetdevError as also:  # the move's failure first: it says why
                raise NetdevError(f"{failed}; {also}") from None
            raise NetdevError(failed) from None
        return {uid: claims.cp.claims[uid] for uid, _, _ in mine}

    def _move_in(self, claims: Claims, uid: str, i: int, move: NetdevMove) -> None:
        """``move`` into its sandbox; one on the host (``planned``) comes identified (``_give``)."""
        if move.state == "in-pod" and netmove.in_pod(move):  # said: a rolling update's two instances both get the event
            log.info("netdev %s is already %s in pod sandbox %s (the event repeated, or moved by the other instance of a "
                     "rolling update)", move.host, move.pod, move.sandbox)
            return
        leasing = move.ipamPool and not move.leased  # one lease per sandbox, recorded before it is used
        asked = {"ipamConfig": self._ipam().config_for(move.ipamPool)} if leasing and move.ipamConfig is None else {}
        claims.put(uid, i, move := move.changed(state="moving", **asked))
        claims.save()
        self.fault("netdev:recorded")
        if leasing:  # the ADD finds the netdev where CNI has it: in CNI_NETNS as CNI_IFNAME (dhcp asks over it)
            move = netmove.move_in(move, self.host_netns)
            addresses, routes = self._ipam().lease(move.ipamPool, move.sandbox, move.netns, move.pod, move.ipamConfig,
                                                  move.podRef)
            self.fault("netdev:leased")
            claims.put(uid, i, move := move.changed(leased=addresses, leasedRoutes=routes))
            claims.save()
        move = netmove.move_in(move, self.host_netns)
        self.fault("netdev:moved")
        claims.put(uid, i, move := move.changed(state="in-pod"))
        if self.settings is not None:  # before the pod's containers are created: they read it at start
            podmeta.record(self.settings, uid, claims.cp.claims[uid], move)
        claims.save()
        log.info("netdev %s is %s in pod sandbox %s", move.host, move.pod, move.sandbox)

    def _give_back(self, claims: Claims, pod: Pod) -> None:
        for uid, entry in claims.cp.claims.items():  # said at every stop: nothing else can be done
            if lost_for(entry, pod):
                log.error("pod %s/%s sandbox %s: claim %s lost its netdev records (%s); a netdev of it in the sandbox "
                          "comes back to the host only when its namespace goes, under the name it has there",
                          pod.namespace, pod.name, pod.id, uid, entry["netdevsLost"])
            if uid in claims.cp.foreign and any(away_in(m, pod.id) for m in entry.get("netdevs") or ()):
                log.error("pod %s/%s sandbox %s: claim %s was prepared by a newer sysdra: its netdevs are that one's to "
                          "move back; without it they come back when the namespace goes", pod.namespace, pod.name, pod.id, uid)
        self._take_back(claims, pod.id)

    def _take_back(self, claims: Claims, sandbox: str) -> None:
        """``sandbox``'s netdevs back on the host; ``status.devices`` keeps the pod's view (the claim
        is the pod's until unprepare)."""
        problems = []
        for uid, i, move in claims.moves():
            if move.away and move.sandbox == sandbox:
                try:
                    self._move_out(claims, uid, i, move)
                except (rtnl.LinkError, OSError, IpamError) as err:
                    problems.append(f"{move.pod}: {err}")
        if problems:  # the record stays: the next event, unprepare or start tries again
            raise NetdevError("giving netdevs back to the host failed: " + "; ".join(problems))

    def _move_out(self, claims: Claims, uid: str, i: int, move: NetdevMove) -> None:
        claims.put(uid, i, returning := move.changed(state="returning"))
        claims.save()
        self.fault("netdev:returning")
        back = netmove.move_out(returning, self.host_netns, self.root)
        self.fault("netdev:returned")
        if move.ipamPool and move.sandbox:  # a lease the sandbox may hold, recorded or not: DEL takes either
            self._ipam().release(move.ipamPool, move.sandbox, move.netns, move.pod, move.ipamConfig, move.podRef)
        claims.put(uid, i, move.changed(state="planned", host=back or move.host, leased=[], leasedRoutes=[], **dict.fromkeys(SEEN)))
        log.info("netdev %s is back on the host (from pod sandbox %s)", move.host, move.sandbox)

    def _ipam(self) -> Ipam:
        if self.ipam is None:
            raise IpamError("this mover has no IPAM pools (no settings)")
        return self.ipam

    def _reconcile(self, claims: Claims, running: dict[str, Pod]) -> dict[str, dict]:
        """Records of sandboxes whose network namespace is gone, without the runtime telling
        (containerd forgets its pods' NRI state when it restarts: their Stop/RemovePodSandbox
        never come): what the kernel gave back is renamed, the records go back to ``planned``. And
        records whose way back failed (a NIC's netdev not back from a namespace being torn down
        yet, its host name another link's), or whose move into a running sandbox a Synchronize
        could not finish (its containers may run, and wait for no event): tried again."""
        done = {}
        for uid, i, move in claims.moves():
            finish = move.state == "moving" and runs(move, running)
            if finish or move.state == "returning" or (move.state == "in-pod" and not netmove.in_pod(move)):
                try:
                    if finish:
                        self._move_in(claims, uid, i, move)
                        done[uid] = claims.cp.claims[uid]
                    else:
                        self._move_out(claims, uid, i, move)
                except (rtnl.LinkError, OSError, IpamError) as err:
                    log.error("netdev %s of pod sandbox %s (%s): %s", move.host, move.sandbox,
                              "running: its move not finished" if finish else "gone", err)
        return done

    async def reconcile(self) -> None:
        """One look for records of sandboxes gone unannounced (``_reconcile``), after the recovery
        of a Synchronize that could not have the locks. The locked look reads the whole checkpoint,
        so it is taken only while a record says a netdev is in a pod or on its way there or back."""
        if self._recovering:  # Synchronize's recovery, which its locks did not let it do
            this = self._syncs  # one that comes meanwhile (its pods) is still to be recovered after
            self._report(await asyncio.to_thread(self._locked, self._recover, dict(self.pods)))
            self._recovering = self._syncs != this
        if await self._concerns(lambda entry: any(away(m) or m.get("state") == "moving" for m in entry.get("netdevs") or ())):
            self._report(await asyncio.to_thread(self._locked, self._reconcile, dict(self.pods)))

    async def watch(self, interval: float = RECONCILE_INTERVAL) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.reconcile()
            except Exception as err:  # whatever failed (the lock, a save, a full fd table): the next round tries again
                expected = isinstance(err, (UpdateError, CheckpointError, ValueError, OSError))
                log.warning("netdev records not looked at: %s", err, exc_info=not expected)

    def _recover(self, claims: Claims, running: dict[str, Pod]) -> dict[str, dict]:
        """Moves a crash interrupted finished (into a sandbox still running, else back), then
        the netdevs of sandboxes that started unseen (``_late``), never into one they left."""
        done, left = {}, set()
        for uid, i, move in claims.moves():
            if not move.away:
                continue
            try:
                if runs(move, running) and move.state != "returning":
                    self._move_in(claims, uid, i, move)
                    done[uid] = claims.cp.claims[uid]
                else:
                    left.add(move.sandbox)
                    self._move_out(claims, uid, i, move)
            except (rtnl.LinkError, OSError, IpamError) as err:
                log.error("netdev %s of pod sandbox %s: finishing its move failed: %s", move.host, move.sandbox, err)
        return done | self._late(claims, {id_: pod for id_, pod in running.items() if id_ not in left})

    def _late(self, claims: Claims, running: dict[str, Pod]) -> dict[str, dict]:
        """Sandboxes that started while the agent was not registered with the runtime (containerd
        restarted, the agent restarting): no RunPodSandbox comes for them, and the netdevs their
        claims planned are still on the host. Each goes into its pod's running sandbox now; the
        pod's containers are refused until then (``container_created``)."""
        waiting = {p for uid, _, m in claims.moves() if not m.away for p in claims.cp.claims[uid].get("pods") or ()}
        sandboxes: dict[str, list[Pod]] = {}
        for pod in running.values():
            # the runtime lists stopped sandboxes too (their namespace gone), and one being created
            # without its namespace yet (its RunPodSandbox follows), which a host-network pod's
            # listing cannot be told from: that one's containers are refused (``container_created``)
            if pod.uid in waiting and pod.netns is not None and os.path.exists(pod.netns):
                sandboxes.setdefault(pod.uid, []).append(pod)
        done = {}
        for pods in sandboxes.values():
            pod = pods[0]
            if len(pods) > 1:
                log.error("pod %s/%s has %d running sandboxes (%s): which one its claims' netdevs go into cannot be "
                          "told; none moved", pod.namespace, pod.name, len(pods), ", ".join(p.id for p in pods))
                continue
            try:
                moved = self._give_late(claims, pod)
            except NetdevError as err:
                log.error("%s", err)
                continue
            done |= moved
        return done

    def _give_late(self, claims: Claims, pod: Pod) -> dict[str, dict]:
        moved = self._give(claims, pod)
        if moved:
            log.warning("NRI: pod %s/%s's sandbox %s started while the agent was not registered with the runtime: its "
                        "claims' netdevs moved in now, after its start", pod.namespace, pod.name, pod.id)
        return moved
