"""A damaged checkpoint under the NRI plugin (agent/nri/netdev.py, prepare/recovery.py): the driver
prepared a NIC claim, the plugin moved its netdev into the pod, then the checkpoint's files are
damaged. The runtime's side is the NRI stand-in over its socket (tests/nri_standin.py), the pod's
namespace and the NIC (a veth end) are real, the driver is the agent's, the damage is bytes written
into the real files. Pods with nothing of ours start; the records of the netdev in the pod survive
(from the agent's last save, or what the damaged files still establish), so it comes back at
StopPodSandbox; a pod whose records cannot be told is refused with the reason. Root only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import threading
import zlib

import pytest

from agent.kubeletplugin.types import ClaimRef
from agent.nri.netdev import NetdevMover
from agent.nri.plugin import NriPlugin, Pod
from agent.nri.ttrpc import CallError
from agent.prepare.checkpoint import CORRUPT, Checkpoint
from agent.prepare.driver import Driver
from agent.prepare.steps.netdev import NetdevStep
from agent.protos import nri_v1alpha1_pb2 as api
from discovery.inventory import scan
from tests.conftest import copy_profile, profile_root
from tests.kubelet_standin import claim, settings_for
from tests.nri_standin import Runtime, sandbox
from tests.test_nri_netdev import CLAIM, IFNAME, POD_UID, ifname_nets, nets, nic_claim, run, where  # noqa: F401 - fixtures

OTHER_UID = "77777777-8888-4999-8aaa-bbbbbbbbbbbb"
NIC_NET = "sys/bus/pci/devices/0000:3c:00.0/net"  # the NIC's netdev directory in sysfs
CALLS = {"RunPodSandbox": (api.RunPodSandboxRequest, api.RunPodSandboxResponse),
         "StopPodSandbox": (api.StopPodSandboxRequest, api.StopPodSandboxResponse)}


class Agent:
    """One life of the agent: its driver (recovered at start) and the NRI plugin moving netdevs."""

    def __init__(self, tmp_path, nets, root: str | None = None):
        self.settings = s = settings_for(str(tmp_path), root=root or profile_root("server-2s-gpu-nic"))
        inv = scan(s.root)
        self.driver = d = Driver(s, lambda: inv)
        next(st for st in d.steps if isinstance(st, NetdevStep)).host_netns = lambda: nets.host
        d.recover()
        self.mover = NetdevMover(s.plugin_dir, host_netns=nets.host, settings=s, saved=lambda: d.saved,
                                 repair=d.repair_checkpoint)
        self.socket = str(tmp_path / f"nri-{id(self)}.sock")

    def serve(self, running, body):
        """``body(call)`` with the plugin registered and synchronized with ``running``;
        ``call(method, pod)`` is the runtime's request (CallError: the plugin's refusal)."""
        async def main():
            runtime = Runtime(self.socket, (tuple(running),))
            await runtime.start()
            task = asyncio.get_running_loop().create_task(NriPlugin(self.socket, self.mover).run())
            try:
                ep, *_ = await runtime.registered.get()

                async def call(method, pod):
                    request, answer = CALLS[method]
                    return await Runtime.call(ep, method, request(pod=pod), answer)
                return await body(call)
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await runtime.stop()
        return run(main())


def app(nets, sandbox_id="id-app"):
    pod = sandbox("app", nets.pod, uid=POD_UID)
    pod.id = sandbox_id
    return pod


def other():
    return sandbox("other", "/run/netns/cni-other", uid=OTHER_UID)


def in_pod(tmp_path, nets) -> Agent:
    """The claim prepared and its netdev moved into the app's sandbox by the agent."""
    agent = Agent(tmp_path, nets)
    assert agent.driver.prepare_claims([nic_claim()])[CLAIM].error is None

    async def start(call):
        await call("RunPodSandbox", app(nets))
    agent.serve([], start)
    assert where(nets) == (False, True)
    return agent


def append_after_damage(path: str) -> None:
    """A damaged line at the journal's end, then a whole record (another claim removed): a damage,
    not a torn append."""
    with open(path + ".journal", "r+b") as f:
        end = len(f.read().rstrip(b"\0"))
        body = b'{"uid":"%s","entry":null}' % OTHER_UID.encode()
        f.seek(end)
        f.write(b"0badc0de {\"uid\":\"\x00\xff\"}\n%08x %s\n" % (zlib.crc32(body), body))


def test_a_checkpoint_damaged_while_serving_is_repaired_and_the_netdev_still_comes_back(tmp_path, ifname_nets, caplog):
    """The snapshot fails its checksum (nothing of the files can be trusted): the NRI plugin asks the
    driver to recover, with the agent's last save (the plugin's own: the netdev in the pod)."""
    nets = ifname_nets
    agent = in_pod(tmp_path, nets)
    path = agent.driver.checkpoint_path
    counted = CORRUPT.values.get((), 0)

    async def events(call):
        with open(path, "r+b") as f:  # while the plugin is connected and synchronized
            f.seek(os.path.getsize(path) // 2)
            f.write(b"\x00garbage\x00")
        await call("RunPodSandbox", other())  # nothing of ours: starts (it failed until a restart)
        assert os.path.exists(agent.driver.recovery.corrupt_checkpoint)
        await call("StopPodSandbox", app(nets))  # the record of the move was kept: it comes back
    with caplog.at_level(logging.INFO):
        agent.serve([app(nets)], events)
    assert where(nets) == (True, False)
    assert "CHECKPOINT CORRUPT" in caplog.text and CORRUPT.values[()] == counted + 1
    assert agent.driver.recovery.from_memory == [CLAIM] and not agent.driver.recovery.netdevs_lost
    entry = Checkpoint.load(path, move_corrupt=False).claims[CLAIM]
    assert entry["name"] == "nic" and entry["pods"] == [POD_UID] and entry["netdevs"][0].get("state", "planned") == "planned"

    async def again(call):
        await call("RunPodSandbox", app(nets, "id-app-2"))
    agent.serve([], again)
    assert where(nets) == (False, True)
    assert agent.driver.unprepare_claims([claim_ref()]) == {CLAIM: None}  # the driver goes on with the repaired files
    assert where(nets) == (True, False)


def test_a_prepare_that_finds_the_checkpoint_damaged_repairs_it_without_losing_the_move(tmp_path, ifname_nets):
    """The driver's memory does not know the plugin's moves (it reads them back at its next call):
    a prepare that finds the files damaged repairs them as the plugin does, from the newest save of
    the process (the move), and never writes its own older memory over them."""
    nets = ifname_nets
    agent = in_pod(tmp_path, nets)
    path = agent.driver.checkpoint_path
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\x00garbage\x00")
    second = claim("nic2", [("net1", "nic-0000-bd-00-0")], uid=OTHER_UID)
    assert agent.driver.prepare_claims([second])[OTHER_UID].error is None
    assert agent.driver.recovery.corrupt_checkpoint and CLAIM in agent.driver.recovery.from_memory
    assert set(Checkpoint.load(path, move_corrupt=False).claims) == {CLAIM, OTHER_UID}

    async def stop(call):
        await call("StopPodSandbox", app(nets))
    agent.serve([app(nets)], stop)
    assert where(nets) == (True, False)


def test_a_damaged_journal_at_start_keeps_the_records_that_follow_the_damage(tmp_path, ifname_nets):
    """The agent restarts with a journal line damaged before the move's records: those records are
    the claim's last word, kept; the netdev comes back when the pod stops."""
    nets = ifname_nets
    first = in_pod(tmp_path, nets)
    path = first.driver.checkpoint_path
    with open(path + ".journal", "r+b") as f:
        lines = f.read().rstrip(b"\0").split(b"\n")
        f.seek(len(lines[0]) + 1 + 12)  # inside the first record (prepare's PrepareCompleted save)
        f.write(b"~~~~")
    agent = Agent(tmp_path, nets)  # the start's recovery: no memory of the agent's saves
    assert agent.driver.recovery.corrupt_checkpoint and CLAIM in agent.driver.recovery.salvaged

    async def events(call):
        await call("RunPodSandbox", other())
        await call("StopPodSandbox", app(nets))
    agent.serve([app(nets)], events)
    assert where(nets) == (True, False)


def test_a_pod_whose_netdev_records_cannot_be_told_is_refused_and_others_start(tmp_path, ifname_nets, caplog):
    """The damage follows the claim's last record: the damaged line may have been the claim's (its
    netdev given back, say). At the next start its entry is only a stale one: the claim is adopted
    from its spec, its pod refused with the reason, its netdev never moved on a guess."""
    nets = ifname_nets
    first = in_pod(tmp_path, nets)
    append_after_damage(first.driver.checkpoint_path)
    agent = Agent(tmp_path, nets)
    assert agent.driver.recovery.netdevs_lost == [CLAIM]

    async def events(call):
        with pytest.raises(CallError, match=f"claim {CLAIM} of pod ns/app lost its netdev records .*damaged"):
            await call("RunPodSandbox", app(nets, "id-app-2"))
        await call("RunPodSandbox", other())
        await call("StopPodSandbox", app(nets))  # nothing to move: said loudly
    with caplog.at_level(logging.ERROR):
        agent.serve([app(nets)], events)
    assert where(nets) == (False, True)  # where the kernel has it: untouched
    assert f"claim {CLAIM} lost its netdev records" in caplog.text
    assert agent.driver.unprepare_claims([claim_ref()]) == {CLAIM: None}  # the kubelet ends it


def test_the_kubelets_prepare_again_keeps_a_claims_netdev_records_lost(tmp_path, ifname_nets):
    """The kubelet prepares the adopted claim again after the restart: its entry is filled in from
    the claim, still marked. Before, it was prepared anew (the adopted entry knew no allocation):
    the mark gone, the pod's next sandbox failed on a netdev not on the host, said as such."""
    nets = ifname_nets
    first = in_pod(tmp_path, nets)
    append_after_damage(first.driver.checkpoint_path)
    agent = Agent(tmp_path, nets)
    assert agent.driver.prepare_claims([nic_claim()])[CLAIM].error is None
    entry = Checkpoint.load(agent.driver.checkpoint_path, move_corrupt=False).claims[CLAIM]
    assert entry["netdevsLost"] and entry["name"] == "nic" and "netdevs" not in entry

    async def events(call):
        with pytest.raises(CallError, match=f"claim {CLAIM} of pod ns/app lost its netdev records"):
            await call("RunPodSandbox", app(nets, "id-app-2"))
    agent.serve([app(nets)], events)
    assert where(nets) == (False, True)


def test_an_adopted_claims_netdev_still_on_the_host_goes_into_its_pod(tmp_path, ifname_nets):
    """The plugin dir wiped before the claim's pod started: adopted from its spec, the kubelet's
    re-prepare fills its entry in with the netdev's move planned (nothing of it had moved), so the
    pod gets it; filled in without (before the re-prepare planned it anew), the pod started without."""
    nets = ifname_nets
    first = Agent(tmp_path, nets)
    assert first.driver.prepare_claims([nic_claim()])[CLAIM].error is None
    for name in os.listdir(first.settings.plugin_dir):
        if name.startswith("checkpoint.json"):
            os.unlink(os.path.join(first.settings.plugin_dir, name))
    agent = Agent(tmp_path, nets)
    assert agent.driver.recovery.adopted == [CLAIM]
    assert agent.driver.prepare_claims([nic_claim()])[CLAIM].error is None

    async def start(call):
        await call("RunPodSandbox", app(nets))
    agent.serve([], start)
    assert where(nets) == (False, True)
    assert agent.driver.unprepare_claims([claim_ref()]) == {CLAIM: None} and where(nets) == (True, False)


@pytest.mark.parametrize("sysfs", ["shows", "hides"])
def test_an_adopted_claims_netdev_in_its_pod_refuses_the_pods_next_sandbox(tmp_path, ifname_nets, sysfs):
    """The plugin dir wiped while the claim's netdev is in its pod: the kernel has it in the pod's
    namespace, not on the host, so the kubelet's re-prepare marks the adopted claim's netdev records
    lost and the pod's next sandbox is refused with the reason. Before, its move was planned as if
    never made: the next sandbox failed on a netdev not on the host (retried for good), and where
    sysfs hid the netdev (a real host) nothing was planned: the sandbox started without it."""
    nets = ifname_nets
    first = in_pod(tmp_path, nets)
    for name in os.listdir(first.settings.plugin_dir):
        if name.startswith("checkpoint.json"):
            os.unlink(os.path.join(first.settings.plugin_dir, name))
    root = copy_profile(tmp_path, "server-2s-gpu-nic")
    if sysfs == "hides":  # a real host's sysfs lists no netdev of another namespace: its net/ is there, empty
        shutil.rmtree(os.path.join(root, NIC_NET, IFNAME))
    agent = Agent(tmp_path, nets, root)
    assert agent.driver.recovery.adopted == [CLAIM]
    assert agent.driver.prepare_claims([nic_claim()])[CLAIM].error is None
    entry = Checkpoint.load(agent.driver.checkpoint_path).claims[CLAIM]
    assert "not on the host" in entry.get("netdevsLost", "") and "netdevs" not in entry and entry["pods"] == [POD_UID]

    async def events(call):
        with pytest.raises(CallError, match=f"claim {CLAIM} of pod ns/app lost its netdev records .*not on the host"):
            await call("RunPodSandbox", app(nets, "id-app-2"))
        await call("RunPodSandbox", other())
    agent.serve([app(nets)], events)
    assert where(nets) == (False, True)  # where the kernel has it: untouched
    assert agent.driver.unprepare_claims([claim_ref()]) == {CLAIM: None}


def test_an_adopted_claims_nic_that_has_no_netdev_is_not_taken_for_one_in_a_pod(tmp_path, ifname_nets):
    """A NIC with no netdev at all (an RDMA-only function, EFA, one whose driver is still probing:
    no ``net/`` under it) is not one whose netdev sysfs hides in a pod: the adopted claim's re-prepare
    marks nothing lost and its pod starts. Before, its pods were refused for a netdev it never had."""
    nets = ifname_nets
    root = copy_profile(tmp_path, "server-2s-gpu-nic")
    shutil.rmtree(os.path.join(root, NIC_NET))
    first = Agent(tmp_path, nets, root)
    assert first.driver.prepare_claims([nic_claim()])[CLAIM].error is None
    for name in os.listdir(first.settings.plugin_dir):
        if name.startswith("checkpoint.json"):
            os.unlink(os.path.join(first.settings.plugin_dir, name))
    agent = Agent(tmp_path, nets, root)
    assert agent.driver.recovery.adopted == [CLAIM]
    assert agent.driver.prepare_claims([nic_claim()])[CLAIM].error is None
    assert "netdevsLost" not in Checkpoint.load(agent.driver.checkpoint_path).claims[CLAIM]

    async def start(call):
        await call("RunPodSandbox", app(nets))
    agent.serve([], start)
    assert where(nets) == (True, False)  # the host's veth of the same name is no netdev of this NIC's


def claim_ref():
    return ClaimRef("default", "nic", CLAIM)


def test_a_rejected_entry_with_netdevs_refuses_its_pod_after_the_start_moved_it_aside(tmp_path, ifname_nets):
    """An entry that passes its checksum but not its checks (a netdev record with MTU 12) is moved
    aside at start and its claim adopted: the pod stays refused after the files no longer hold the
    entry (before, it then started without its netdev)."""
    nets = ifname_nets
    first = Agent(tmp_path, nets)
    assert first.driver.prepare_claims([nic_claim()])[CLAIM].error is None
    cp = Checkpoint.load(first.driver.checkpoint_path)
    cp.claims[CLAIM] = {**cp.claims[CLAIM], "netdevs": [{**cp.claims[CLAIM]["netdevs"][0], "mtu": 12}]}
    cp.save(changed=[CLAIM])
    agent = Agent(tmp_path, nets)
    assert agent.driver.recovery.rejected == [CLAIM] and agent.driver.recovery.netdevs_lost == [CLAIM]
    assert Checkpoint.load(agent.driver.checkpoint_path, move_corrupt=False).rejected == {}

    async def events(call):
        with pytest.raises(CallError, match=f"claim {CLAIM} of pod ns/app lost its netdev records .*not valid.*mtu"):
            await call("RunPodSandbox", app(nets))
        await call("RunPodSandbox", other())
    agent.serve([], events)
    assert where(nets) == (True, False)


def test_a_repair_that_outlasts_the_runtimes_deadline_moves_nothing_into_the_failed_sandbox(tmp_path, ifname_nets):
    """The repair runs in the thread of the pod event that found the files damaged; the runtime
    gives up on the event meanwhile (its 2 s): the files are repaired, the netdev stays on the host
    for the pod's next sandbox."""
    nets = ifname_nets
    agent = Agent(tmp_path, nets)
    assert agent.driver.prepare_claims([nic_claim()])[CLAIM].error is None
    path = agent.driver.checkpoint_path
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\x00garbage\x00")
    entered, release, repair = threading.Event(), threading.Event(), agent.mover.repair
    agent.mover.repair = lambda: (entered.set(), release.wait(30), repair())[-1]

    async def given_up():
        task = asyncio.create_task(agent.mover.pod_started(Pod.of(app(nets))))
        assert await asyncio.to_thread(entered.wait, 30)
        task.cancel()  # what the plugin's handler gets at the runtime's deadline
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
    run(given_up())  # returns once the worker thread has
    assert where(nets) == (True, False) and agent.driver.recovery.corrupt_checkpoint
    assert Checkpoint.load(path, move_corrupt=False).claims[CLAIM]["pods"] == [POD_UID]
    run(agent.mover.pod_started(Pod.of(app(nets, "id-app-2"))))  # the kubelet's retry
    assert where(nets) == (False, True)
