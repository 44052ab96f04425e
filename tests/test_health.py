"""KEP-4680 health over the real DRA socket with a grpcio client, on copies of fixture
trees changed under the agent (link down, status, driver unbound, device removed)."""

from __future__ import annotations

import asyncio
import os
import shutil
import time

import grpc
import pytest

from agent.health import HEALTH_SERVICES, attach
from agent.health.checks import AER_HOLD, MAX_MESSAGE, Memory, check, truncate
from agent.kubeletplugin import KubeletPlugin
from agent.kubeletplugin.claims import DirClaimSource
from agent.prepare.driver import Driver
from agent.protos import dra_health_v1_pb2, dra_health_v1_pb2_grpc, dra_health_v1alpha1_pb2, dra_health_v1alpha1_pb2_grpc
from discovery.inventory import scan
from discovery.models import DeviceNode
from discovery.sysfs import HostFS
from tests.conftest import copy_profile, write_file
from tests.kubelet_standin import KubeletStandIn, settings_for

VM_NIC = "nic-0000-05-00-0"
VM_GPU = "gpu-0000-06-00-0"
VM_NIC_NET = "sys/devices/pci0000:00/0000:00:01.4/0000:05:00.0/virtio12/net/eth0"
VM_GPU_DIR = "sys/devices/pci0000:00/0000:00:01.5/0000:06:00.0"
STUBS = {"v1": (dra_health_v1_pb2, dra_health_v1_pb2_grpc), "v1alpha1": (dra_health_v1alpha1_pb2, dra_health_v1alpha1_pb2_grpc)}


class Agent:
    """Plugin + health monitor on a fixture root, as the daemon wires them."""

    def __init__(self, tmp_path, root: str, interval: float = 0.2, inventory=None):
        self.settings = settings_for(str(tmp_path), root=root, health_interval=interval)
        self.inv = inventory or scan(root)
        self.plugin = KubeletPlugin(self.settings, Driver(self.settings, lambda: self.inv),
                                    DirClaimSource(self.settings.cluster_dir))
        self.monitor = attach(self.plugin, lambda: self.inv, self.settings)

    async def __aenter__(self):
        await self.monitor.start()
        await self.plugin.start()
        self.kubelet = KubeletStandIn(self.settings.registry_dir)
        await self.kubelet.register()
        return self

    async def __aexit__(self, *exc):
        await self.monitor.stop()
        await self.plugin.stop()


class Stream:
    """A kubelet-like health watcher on one service version."""

    def __init__(self, endpoint: str, version: str = "v1"):
        self.pb, pb_grpc = STUBS[version]
        self.channel = grpc.aio.insecure_channel("unix:" + endpoint)
        self.call = pb_grpc.DRAResourceHealthStub(self.channel).NodeWatchResources(self.pb.NodeWatchResourcesRequest())

    async def next(self, timeout: float = 5.0) -> dict:
        resp = await asyncio.wait_for(self.call.read(), timeout)
        assert resp is not grpc.aio.EOF
        return {d.device.device_name: (self.pb.HealthStatus.Name(d.health), d.message, d) for d in resp.devices}

    async def until(self, pred, timeout: float = 5.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            got = await self.next(max(0.05, deadline - time.monotonic()))
            if pred(got):
                return got

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()


def run(coro):
    asyncio.run(asyncio.wait_for(coro, 60))


def test_registration_lists_four_services_in_order(tmp_path):
    async def main():
        async with Agent(tmp_path, copy_profile(tmp_path, "vm-numa-none")) as a:
            assert list(a.kubelet.info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin", *HEALTH_SERVICES]
            assert HEALTH_SERVICES == ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")
    run(main())


@pytest.mark.parametrize("version", ["v1", "v1alpha1"])
def test_snapshot_then_link_down_update_then_resend(tmp_path, version):
    root = copy_profile(tmp_path, "vm-numa-none")

    async def main():
        async with Agent(tmp_path, root) as a:
            s = Stream(a.plugin.dra_socket, version)
            first = await s.next()
            assert set(first) == {VM_NIC, VM_GPU}
            assert first[VM_NIC][:2] == ("HEALTHY", "interface eth0 link up")
            dev = first[VM_NIC][2]
            assert dev.device.pool_name == a.settings.node_name and abs(dev.last_updated_time - time.time()) < 5
            write_file(root, VM_NIC_NET + "/carrier", "0\n")
            got = await s.until(lambda g: g[VM_NIC][0] == "UNHEALTHY")
            assert got[VM_NIC][1] == "interface eth0 carrier 0"
            write_file(root, VM_NIC_NET + "/operstate", "down\n")
            got = await s.until(lambda g: "operstate down" in g[VM_NIC][1])
            assert got[VM_NIC][0] == "UNHEALTHY" and got[VM_GPU][0] == "HEALTHY"  # always the full list
            assert a.monitor.taints() == {VM_NIC: [{"key": "sysdra.io/unhealthy", "value": "link-down", "effect": "NoSchedule"}]}
            # nothing changes: the full list keeps coming, each before the kubelet's 30 s lease ends
            for _ in range(3):
                assert set(await s.next(timeout=30)) == {VM_NIC, VM_GPU}
            write_file(root, VM_NIC_NET + "/operstate", "up\n")
            write_file(root, VM_NIC_NET + "/carrier", "1\n")
            await s.until(lambda g: g[VM_NIC][0] == "HEALTHY")  # the stream says what is, at once
            held = {VM_NIC: [{"key": "sysdra.io/unhealthy", "value": "link-down", "effect": "NoSchedule"}]}
            assert a.monitor.taints() == held  # the taint outlasts a flap (docs/health.md)
            a.monitor.clock = lambda: time.monotonic() + a.monitor.taint_hold
            assert a.monitor.taints() == {}
            await s.close()
    run(main())


def test_driver_unbound_and_device_removed_reported_on_inventory_change(tmp_path):
    """Timer far away (10 s): the update comes from on_inventory, i.e. at once."""
    root = copy_profile(tmp_path, "vm-numa-none")

    async def main():
        async with Agent(tmp_path, root, interval=10) as a:
            s = Stream(a.plugin.dra_socket)
            assert (await s.next())[VM_GPU][0] == "HEALTHY"
            os.unlink(os.path.join(root, VM_GPU_DIR, "driver"))
            a.inv = scan(root)  # the rescan sees no driver any more
            a.monitor.on_inventory(a.inv)
            got = await s.until(lambda g: g[VM_GPU][0] == "UNHEALTHY", timeout=2)
            assert got[VM_GPU][1] == "driver nvidia is no longer bound to 0000:06:00.0"
            shutil.rmtree(os.path.join(root, VM_GPU_DIR))
            a.inv = scan(root)
            a.monitor.on_inventory(a.inv)
            got = await s.until(lambda g: "gone" in g[VM_GPU][1], timeout=2)
            assert got[VM_GPU][:2] == ("UNHEALTHY", "PCI function 0000:06:00.0 is gone from sysfs")
            assert a.monitor.snapshot()[VM_GPU][0] == "UNHEALTHY"
            await s.close()
    run(main())


def test_habanalabs_status_and_client_reconnect(tmp_path):
    root = copy_profile(tmp_path, "accel-gaudi")
    status = "sys/devices/pci0000:16/0000:16:01.0/0000:17:00.0/status"

    async def main():
        async with Agent(tmp_path, root) as a:
            s = Stream(a.plugin.dra_socket, "v1alpha1")
            first = await s.next()
            assert first["accelerator-0000-17-00-0"][0] == "HEALTHY"
            assert first["accelerator-0000-99-00-0"][:2] == ("UNHEALTHY", "habanalabs status is 'in reset', not 'operational'")
            assert first["accelerator-0000-19-00-0"][0] == "UNKNOWN"  # nothing to check is not HEALTHY
            await s.close()  # the kubelet goes away ...
            write_file(root, status, "in reset\n")
            await asyncio.sleep(0.3)
            assert not a.monitor._subscribers
            s = Stream(a.plugin.dra_socket, "v1")  # ... and comes back: snapshot at once
            got = await s.next(timeout=2)
            assert got["accelerator-0000-17-00-0"][0] == "UNHEALTHY"
            await s.close()
    run(main())


def test_long_messages_are_truncated_on_the_wire(tmp_path):
    root = copy_profile(tmp_path, "vm-numa-none")
    inv = scan(root)
    gpu = inv.by_name()[VM_GPU]
    missing = tuple(DeviceNode(path=f"/dev/missing-{'x' * 40}-{i}", host_path="/nonexistent", major=1, minor=i,
                               source="test") for i in range(40))
    inv = inv.replace(devices=(gpu.replace(device_nodes=missing),))

    async def main():
        async with Agent(tmp_path, root, inventory=inv) as a:
            s = Stream(a.plugin.dra_socket)
            health, message, _ = (await s.next())[VM_GPU]
            assert health == "UNHEALTHY" and len(message) == MAX_MESSAGE and message.endswith("...")
            await s.close()
    run(main())


def test_truncate():
    assert truncate("x" * 1024) == "x" * 1024
    assert truncate("x" * 1025) == "x" * 1021 + "..."


def test_aer_fatal_increase_is_unhealthy_for_a_while(tmp_path):
    root = copy_profile(tmp_path, "vm-numa-none")
    gpu = scan(root).by_name()[VM_GPU]
    fs, mem = HostFS(root), Memory(driver="nvidia")
    aer = os.path.join(root, VM_GPU_DIR, "aer_dev_fatal")
    write_file(root, aer, "Undefined 0\nDLP 0\nTOTAL_ERR_FATAL 2\n")
    assert check(fs, gpu, mem, now=1000).health == "HEALTHY"  # a baseline, not an increase
    write_file(root, aer, "Undefined 0\nDLP 1\nTOTAL_ERR_FATAL 3\n")
    v = check(fs, gpu, mem, now=1001)
    assert (v.health, v.reason) == ("UNHEALTHY", "aer-fatal") and "from 2 to 3" in v.message
    assert check(fs, gpu, mem, now=1001 + AER_HOLD / 2).health == "UNHEALTHY"
    assert check(fs, gpu, mem, now=1002 + AER_HOLD).health == "HEALTHY"


def test_devnode_missing_while_bound_and_unknown_without_signal(tmp_path):
    root = copy_profile(tmp_path, "vm-numa-none")
    gpu = scan(root).by_name()[VM_GPU]
    os.unlink(os.path.join(root, "dev/nvidia0"))
    v = check(HostFS(root), gpu, Memory(driver="nvidia"))
    assert (v.health, v.reason) == ("UNHEALTHY", "devnode-missing") and v.message.startswith("/dev/nvidia0 missing")
    # a device that was never bound and has nothing to look at is UNKNOWN, never HEALTHY
    os.unlink(os.path.join(root, VM_GPU_DIR, "driver"))
    v = check(HostFS(root), gpu, Memory())
    assert v.health == "UNKNOWN" and "no driver bound" in v.message


# --- kernel link events --------------------------------------------------------------------

def _rtnl(mtype: int, name: bytes, extra_attrs: bytes = b"") -> bytes:
    import struct

    from agent.health import linkwatch as lw

    attr = struct.pack("=HH", 4 + len(name) + 1, lw.IFLA_IFNAME) + name + b"\0"
    attr += b"\0" * (-len(attr) % 4)
    body = struct.pack("=BxHiII", 0, 1, 7, 0, 0) + extra_attrs + attr
    return struct.pack("=IHHII", 16 + len(body), mtype, 0, 0, 0) + body


def test_link_messages_are_parsed_and_garbage_is_ignored():
    from agent.health.linkwatch import RTM_DELLINK, RTM_NEWLINK, interface_names

    other_attr = b"\x08\x00\x04\x00\x00\x05\x00\x00"  # IFLA_MTU before the name
    two = _rtnl(RTM_NEWLINK, b"ens1f0", other_attr) + _rtnl(RTM_DELLINK, b"eth1")
    assert interface_names(two) == {"ens1f0", "eth1"}
    assert interface_names(_rtnl(20, b"addr0")) == set()  # RTM_NEWADDR: not a link message
    for cut in range(len(two)):  # truncated datagrams: what parses is kept, nothing raises
        assert interface_names(two[:cut]) <= {"ens1f0", "eth1"}
    bad_len = bytearray(two)
    bad_len[0:4] = (10).to_bytes(4, "little")  # shorter than a header
    assert interface_names(bytes(bad_len)) == set()
    bad_attr = bytearray(_rtnl(RTM_NEWLINK, b"x"))
    bad_attr[32:34] = (999).to_bytes(2, "little")  # attribute longer than its message
    assert interface_names(bytes(bad_attr)) == set()
    assert interface_names(os.urandom(4096)) is not None


def test_a_kernel_link_event_rechecks_the_nic_at_once(tmp_path):
    """Real rtnetlink events (a veth interface in a private "host" network namespace, named like
    the fixture NIC's interface) re-check that NIC without waiting for the 10 s round: heard by
    an agent in another namespace, as the DaemonSet's is in its pod's, through the host's init."""
    import json
    import subprocess
    import sys

    from tests.conftest import REPO, require_root, require_tool

    require_root()
    unshare = require_tool("unshare")
    require_tool("ip")
    require_tool("nsenter")
    proc = subprocess.run([unshare, "-n", sys.executable, "-m", "tests.health_link_scenario", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    out = json.loads(lines[-1])
    assert proc.returncode == 0, out.get("failure")
    assert out["start"] == "HEALTHY" and out["up"] == "HEALTHY"
    assert out["checks_after_unrelated_event"] == 0, "an event of an interface no device has checked a device"
    assert "link-down" in out["down_message"] or "operstate down" in out["down_message"], out["down_message"]
    assert out["rounds"] == 1, "a timer round ran: the change was not seen through the event"
    assert out["link_checks"] >= 3


@pytest.mark.parametrize("profile,gpu", [("h100-mig", "gpu-0000-18-00-0"), ("mi300x-partitions", "gpu-0000-05-00-0"),
                                         ("dynamic-mig", "gpu-0000-00-06-0")])
def test_partitions_are_reported_with_their_gpus_verdict(tmp_path, profile, gpu):
    """--partitions: the stream names every published device, each MIG instance, CPX partition and
    MIG placement with its GPU's verdict (a pod on a partition learns that its GPU failed)."""
    from agent.health.monitor import HealthMonitor
    from agent.health.service import build_response
    from agent.publish.slices import build_pool
    from tests.mig_node import MigNode

    if profile == "dynamic-mig":
        node = MigNode(str(tmp_path))
        root, inv, settings = node.root, node.inv, node.settings
    else:
        root = copy_profile(tmp_path, profile)
        inv, settings = scan(root), settings_for(str(tmp_path), root=root, partitions=True)
    nodes = [n.path for n in inv.by_name()[gpu].device_nodes]
    os.unlink(os.path.join(root, nodes[0].lstrip("/")))  # the GPU's own node: UNHEALTHY devnode-missing
    monitor = HealthMonitor(settings, lambda: inv)
    monitor.check_once()
    got = {d.device.device_name: d for d in build_response(monitor, dra_health_v1_pb2).devices}
    pool = build_pool(inv, node_name=settings.node_name, driver_name=settings.driver_name, partitions=True)
    published = [d for s in pool.slices for d in s.get("devices", [])]
    assert sorted(got) == sorted(d["name"] for d in published)
    parts = [d["name"] for d in published if d["attributes"].get("partitionOf") == {"string": gpu}]
    assert len(parts) >= 4
    if profile == "h100-mig":  # in MIG mode without NVML: the whole GPU is no device (docs/partitions.md)
        assert gpu not in got
    first = got[gpu] if gpu in got else got[parts[0]]
    health = dra_health_v1_pb2.HealthStatus.Name(first.health)
    assert health == "UNHEALTHY" and "missing" in first.message
    for name in parts:
        assert (got[name].health, got[name].message, got[name].last_updated_time) == (
            first.health, first.message, first.last_updated_time)


def test_truncate_counts_bytes_as_the_kubelet_does():
    """The kubelet (truncateHealthMessage) and the API server (allocatedResourcesStatus validation)
    take ``len()`` of a Go string: 1024 *bytes*. 600 two-byte characters are 1200 bytes: the kubelet
    would cut them at byte 1021, in the middle of a character."""
    out = truncate("é" * 600)
    assert len(out.encode()) <= MAX_MESSAGE and out == "é" * 510 + "..."
    assert truncate("é" * 512) == "é" * 512  # 1024 bytes: as is
