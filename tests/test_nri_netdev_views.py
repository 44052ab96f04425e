"""The pod's view of a claim's netdev once it is in its pod (agent/nri/podmeta.py): its name
there, MAC and addresses in the KEP-5304 metadata and in ``status.devices[].networkData``,
after a RunPodSandbox and after a move finished at the runtime's Synchronize. Real kernel
netdevs in namespaces the test makes; root only."""

from __future__ import annotations

import json
import os

import pytest

from agent.kubeletplugin.types import ClaimRef
from agent.nri.netdev import NetdevMover
from agent.prepare.checkpoint import Checkpoint
from agent.prepare.checkpoint_format import COMPLETED
from agent.prepare.driver import Driver
from agent.prepare.metadata import layout
from agent.prepare.steps.netdev import NetdevStep
from discovery.inventory import scan
from tests.conftest import profile_root
from tests.kubelet_standin import settings_for
from tests.test_nri_netdev import (CLAIM, IFNAME, NIC, POD_UID, Crash, ifname_nets, ip_json, nets, nic_claim,  # noqa: F401 - fixtures
                                   pod, run, where)


def test_prepare_plans_the_move_and_the_hook_writes_the_pods_view(tmp_path, ifname_nets):
    nets = ifname_nets
    s = settings_for(str(tmp_path), root=profile_root("server-2s-gpu-nic"))
    inv = scan(s.root)
    d = Driver(s, lambda: inv)
    netdev_step = next(st for st in d.steps if isinstance(st, NetdevStep))
    netdev_step.host_netns = lambda: nets.host
    config = {"interfaceName": "net1", "mtu": 1400, "addresses": ["192.0.2.5/24"]}
    assert d.prepare_claims([nic_claim(config)])[CLAIM].error is None
    entry = d.checkpoint.claims[CLAIM]
    assert entry["pods"] == [POD_UID] and entry["netdevs"] == [
        {"device": NIC, "request": "net1", "bdf": "0000:3c:00.0", "host": IFNAME, "pod": "net1", "mtu": 1400,
         "addresses": ["192.0.2.5/24"]}]  # the fixture has no ib_core: no RDMA link moves
    written = []
    m = NetdevMover(s.plugin_dir, host_netns=nets.host, settings=s, status=lambda ref, e: written.append((ref, e)))
    run(m.pod_started(pod(nets)))
    assert where(nets) == (False, True)
    with open(layout.host_file(s.plugin_dir, "default", "nic", "net1")) as f:
        meta = json.JSONDecoder().raw_decode(f.read())[0]  # a stream: the first object
    (dev,) = [dev for r in meta["requests"] for dev in r["devices"]]
    mac = ip_json(nets, "link", "show", "net1")[0]["address"]
    assert meta["metadata"]["generation"] == 2
    assert dev["networkData"] == {"interfaceName": "net1", "ips": ["192.0.2.5/24"], "hardwareAddress": mac}
    ((ref, entries),) = written
    assert ref == ClaimRef("default", "nic", CLAIM)
    assert entries[0]["networkData"] == {"interfaceName": "net1", "ips": ["192.0.2.5/24"], "hardwareAddress": mac}
    # unprepare while the netdev is in the pod (the runtime never said StopPodSandbox): the step undoes it
    assert d.unprepare_claims([ClaimRef("default", "nic", CLAIM)]) == {CLAIM: None}
    assert where(nets) == (True, False)


def test_without_device_metadata_the_status_still_gets_the_pods_view(tmp_path, ifname_nets):
    """``device_metadata: false`` turns off the KEP-5304 files only: ``status.devices[].networkData``
    of a NIC moved into its pod still says the pod's view (docs/cluster-integration.md), not the
    host's interface name."""
    nets = ifname_nets
    s = settings_for(str(tmp_path), root=profile_root("server-2s-gpu-nic"), device_metadata=False)
    inv = scan(s.root)
    d = Driver(s, lambda: inv)
    netdev_step = next(st for st in d.steps if isinstance(st, NetdevStep))
    netdev_step.host_netns = lambda: nets.host
    config = {"interfaceName": "net1", "addresses": ["192.0.2.5/24"]}
    assert d.prepare_claims([nic_claim(config)])[CLAIM].error is None
    assert d.checkpoint.claims[CLAIM]["deviceStatus"][0]["networkData"]["interfaceName"] == IFNAME  # the host's view
    written = []
    m = NetdevMover(s.plugin_dir, host_netns=nets.host, settings=s, status=lambda ref, e: written.append((ref, e)))
    run(m.pod_started(pod(nets)))
    assert where(nets) == (False, True)
    mac = ip_json(nets, "link", "show", "net1")[0]["address"]
    ((ref, entries),) = written
    assert entries[0]["networkData"] == {"interfaceName": "net1", "ips": ["192.0.2.5/24"], "hardwareAddress": mac}
    assert Checkpoint.load(os.path.join(s.plugin_dir, "checkpoint.json")).claims[CLAIM]["deviceStatus"] == entries
    assert d.unprepare_claims([ClaimRef("default", "nic", CLAIM)]) == {CLAIM: None}


def test_the_pods_view_drops_the_hosts_addresses_the_move_took_away(tmp_path):
    """A NIC the host used (``allowHostInUse``) had a host address at prepare, which its status
    entry named. Moving the link into the pod's namespace takes its addresses away: with no
    ``NicConfig`` addresses and no lease the pod's view has no IPs (docs/networking.md: the
    config's addresses and the lease), not the host's."""
    from agent.nri import podmeta
    from agent.prepare.records import NetdevMove

    s = settings_for(str(tmp_path))
    host_net = {"interfaceName": IFNAME, "hardwareAddress": "a0:88:c2:1e:5a:20", "ips": ["2001:db8::5/64"]}
    dev = {"driver": "sysdra.io", "pool": "node-1", "name": NIC,
           "networkData": {"interfaceName": IFNAME, "hardwareAddress": "a0:88:c2:1e:5a:20"}}
    entry = {"state": COMPLETED, "namespace": "default", "name": "nic",
             "metadata": {"podClaimName": None, "requests": {"net1": {"generation": 1, "requests": [
                 {"name": "net1", "devices": [dev]}]}}},
             "deviceStatus": [{"driver": "sysdra.io", "pool": "node-1", "device": NIC, "networkData": dict(host_net)}]}
    move = NetdevMove(device=NIC, request="net1", host=IFNAME, pod="net1", state="in-pod", mac="0e:ba:7d:38:24:8f")
    assert podmeta.record(s, CLAIM, entry, move)
    pods_view = {"interfaceName": "net1", "hardwareAddress": "0e:ba:7d:38:24:8f"}
    assert entry["metadata"]["requests"]["net1"]["requests"][0]["devices"][0]["networkData"] == pods_view
    assert entry["deviceStatus"][0]["networkData"] == pods_view


def test_a_move_finished_at_synchronization_reports_the_pods_view(tmp_path, ifname_nets):
    """A crash after the kernel moved the netdev, before its record said ``in-pod``: the runtime's
    Synchronize lists the sandbox still running, the move is completed (metadata written), and the
    claim's ``status.devices[].networkData`` follows as after a RunPodSandbox: the name in the pod."""
    nets = ifname_nets
    s = settings_for(str(tmp_path), root=profile_root("server-2s-gpu-nic"))
    inv = scan(s.root)
    d = Driver(s, lambda: inv)
    next(st for st in d.steps if isinstance(st, NetdevStep)).host_netns = lambda: nets.host
    assert d.prepare_claims([nic_claim({"interfaceName": "net1"})])[CLAIM].error is None

    def crash(at):
        if at == "netdev:moved":
            raise Crash(at)

    with pytest.raises(Crash):
        run(NetdevMover(s.plugin_dir, host_netns=nets.host, settings=s, fault=crash).pod_started(pod(nets)))
    written = []
    m = NetdevMover(s.plugin_dir, host_netns=nets.host, settings=s, status=lambda ref, e: written.append((ref, e)))
    run(m.synchronized([pod(nets)]))
    assert where(nets, IFNAME) == (False, True) and Checkpoint.load(d.checkpoint_path).claims[CLAIM]["netdevs"][0]["state"] == "in-pod"
    mac = ip_json(nets, "link", "show", "net1")[0]["address"]
    assert [(ref, e[0]["networkData"]) for ref, e in written] == [
        (ClaimRef("default", "nic", CLAIM), {"interfaceName": "net1", "hardwareAddress": mac})]
