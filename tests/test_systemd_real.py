"""The systemd unit as shipped, run by a real systemd: its sandbox with the agent's real work, and
a shared NVIDIA GPU's MPS daemon. The node, systemd as PID 1 in a podman container of the agent's
image, is tests/systemd_node.py.

The unit alone: ``Type=notify`` start, a claim prepared with its CDI spec in /run/cdi under
``ProtectSystem=strict`` and the system call filter, ``systemctl reload`` applying a changed
setting, a clean stop; a SIGKILLed agent restarted by systemd with its claims, a bad config
(exit 78) not restarted, the watchdog fed, /sys writable to the agent only with the sysfs
drop-in. With MPS, what a host needs and only a real systemd shows: the shm tmpfs the
agent mounts must be in PID 1's mount namespace, where the container runtime resolves the CDI
mounts of the shares, so no setting of the unit with the drop-in may give the agent a mount
namespace of its own (systemd makes such a namespace a slave of the host's: its mounts never come
back). Without the drop-in the share's claim fails with the documented error and leaves nothing.
The daemon lives in the unit's cgroup, a ``systemctl restart`` keeps it (``KillMode=process``),
the next agent adopts it and starts it again when it is killed, and unprepare stops it and
unmounts the tmpfs; an override that brings a mount namespace back fails the claim clearly. NRI
(the runtime's side is tests/nri_standin.py): a claimed netdev's move is refused without the
drop-in ``sysdra-nri.conf`` and made with it.
Root and podman needed; Debian's apt mirror for the image."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time

import pytest

from tests.conftest import require_root, require_tool
from tests.controlplane import wait_until
from tests.faults.harness import run
from tests.podman import build_agent_image, podman_env
from tests.systemd_node import CLAIM, CONTAINERFILE, IMAGE, PLUGIN, SystemdNode

pytestmark = [pytest.mark.slow, pytest.mark.root]
NIC_CLAIM = ("default", "nic", "0000000c-0000-4000-8000-00000000ca11")
NIC, IFNAME = "nic-0000-3c-00-0", "enp60s0np0"  # the fixture's NIC and its netdev's name
POD = "0000000d-0000-4000-8000-00000000ca11"


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    require_root()
    for tool in ("podman", "debootstrap"):
        require_tool(tool)
    build_agent_image(str(tmp_path_factory.mktemp("image")))
    context = str(tmp_path_factory.mktemp("systemd-image"))
    with open(os.path.join(context, "Containerfile"), "w") as f:
        f.write(CONTAINERFILE)
    built = subprocess.run(["podman", "build", "--quiet", "--pull=never", "-t", IMAGE, context], env=podman_env(context),
                           capture_output=True, text=True, timeout=900)  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    node = SystemdNode(str(tmp_path_factory.mktemp("systemd-node")))
    try:
        node.start()
        yield node
    finally:
        node.remove()


def test_the_unit_as_shipped_starts_prepares_reloads_and_stops(node):
    client = node.install(mps=False)  # returns once systemd has READY=1 (Type=notify)
    try:
        assert "devices" in node.sh("systemctl show -p StatusText --value sysdra")  # the agent's STATUS=
        node.write_claim(NIC_CLAIM, {"device": "nic-0000-3c-00-0"})
        out = run(client.prepare(NIC_CLAIM)).claims[NIC_CLAIM[2]]
        assert not out.error and out.devices, f"{out.error}\n{node.log()}"
        assert NIC_CLAIM[2] in node.sh("ls /run/cdi")  # written under ProtectSystem=strict
        node.sh("echo 'resync_interval: 120' >> /etc/sysdra/config.yaml && systemctl reload sysdra")
        wait_until(lambda: "SIGHUP: applied resync_interval=120" in node.log(), 30, what="the reload", tail=node.log)
        assert not run(client.unprepare(NIC_CLAIM)).claims[NIC_CLAIM[2]].error
        assert NIC_CLAIM[2] not in node.sh("ls /run/cdi")
    finally:
        node.sh("systemctl stop sysdra")
    assert sorted(node.sh("systemctl show -p Result,ExecMainStatus,NRestarts sysdra").split()) == \
        ["ExecMainStatus=0", "NRestarts=0", "Result=success"]  # fmt: skip


def test_a_crash_is_restarted_with_its_claims_and_a_bad_config_is_not(node):
    client = node.install(mps=False)
    try:
        node.write_claim(NIC_CLAIM, {"device": "nic-0000-3c-00-0"})
        assert not run(client.prepare(NIC_CLAIM)).claims[NIC_CLAIM[2]].error
        crashed = node.main_pid()
        node.sh("systemctl kill --kill-whom=main -s SIGKILL sysdra")  # Restart=on-failure, after 2 s
        wait_until(lambda: node.sh("systemctl show -p NRestarts --value sysdra").strip() == "1"
                   and node.main_pid() not in (0, crashed), 30, what="systemd's restart", tail=node.log)  # fmt: skip
        client = node.client()
        out = run(client.unprepare(NIC_CLAIM)).claims[NIC_CLAIM[2]]  # the new agent knows the claim
        assert not out.error and NIC_CLAIM[2] not in node.sh("ls /run/cdi"), out.error
        # exit 78: RestartPreventExitStatus, no restart loop on a configuration nobody fixed
        node.sh("echo 'no_such_setting: 1' >> /etc/sysdra/config.yaml && (systemctl restart sysdra || true)")
        time.sleep(3)  # beyond RestartSec=2s
        state = sorted(node.sh("systemctl show -p ActiveState,ExecMainStatus,NRestarts sysdra").split())
        assert state == ["ActiveState=failed", "ExecMainStatus=78", "NRestarts=0"], f"{state}\n{node.log()}"
        assert "no_such_setting" in node.log()
    finally:
        node.sh("systemctl stop sysdra; systemctl reset-failed sysdra")


def test_sysfs_is_writable_to_the_agent_only_with_the_sysfs_drop_in(node):
    """VFIO binding and partition mode switches write /sys (the chart's sysfsWritable): the unit
    keeps it read-only, the drop-in opens it. Seen from the agent's own mount namespace (the
    kernel's answer to a write check; nothing is written: no PCI device here may be rebound)."""
    for sysfs, writable in ((False, "no"), (True, "yes")):
        node.install(mps=False, sysfs=sysfs)
        try:
            probe = f"nsenter -t {node.main_pid()} -m sh -c 'test -w /sys/bus/pci/drivers_probe && echo yes || echo no'"
            assert node.sh(probe).strip() == writable, (sysfs, node.sh(f"grep ' /sys ' /proc/{node.main_pid()}/mountinfo"))
        finally:
            node.sh("systemctl stop sysdra")


def test_the_watchdog_is_fed(node):
    """``WatchdogSec=`` shortened to 3 s by a drop-in of the test's (the agent pings at half the
    interval systemd gives it): after 10 s the first agent still runs, never killed for silence."""
    drop_in = "/etc/systemd/system/sysdra.service.d/test-watchdog.conf"
    node.install(mps=False)
    node.sh(f"mkdir -p {os.path.dirname(drop_in)} && printf '[Service]\\nWatchdogSec=3s\\n' > {drop_in}"
            " && systemctl daemon-reload && systemctl restart sysdra")
    try:
        pid = node.main_pid()
        time.sleep(10)
        state = sorted(node.sh("systemctl show -p ActiveState,NRestarts,WatchdogUSec sysdra").split())
        assert state == ["ActiveState=active", "NRestarts=0", "WatchdogUSec=3s"] and node.main_pid() == pid, \
            f"{state}\n{node.log()}"  # fmt: skip
    finally:
        node.sh(f"rm -f {drop_in} && systemctl daemon-reload && systemctl stop sysdra")


def test_a_claimed_netdev_moves_into_its_pod_with_the_nri_drop_in(node):
    """The NRI plugin under the unit (the runtime's side is tests/nri_standin.py: no runtime runs
    in this container): without the NRI drop-in the unit's sandbox refuses the move and the pod's
    start fails, saying so; with it the netdev (a veth here, named as the fixture's NIC) goes into
    the pod's network namespace and back when the pod stops."""
    node.sh(f"ip link add {IFNAME} type veth peer name sdrpeer0 && ip netns add pod1")
    try:
        for nri in (False, True):
            client = node.install(mps=False, nri=nri)
            runtime = node.nri_runtime(POD, "/run/netns/pod1")
            try:
                assert _said(runtime, node) == {"registered": ""}
                node.write_claim(NIC_CLAIM, {"device": NIC}, pod=POD)
                assert not run(client.prepare(NIC_CLAIM)).claims[NIC_CLAIM[2]].error
                runtime.stdin.write("run\n")
                runtime.stdin.flush()
                started = _said(runtime, node)["RunPodSandbox"]
                in_pod = "dev" in _links(node, "pod1")  # named after its request in the pod
                if nri:
                    assert started == "" and in_pod, f"{started}\n{node.log()}"
                    assert "the host's network namespace" not in node.run_log()  # the init's opened (SYS_PTRACE)
                    assert "claimed NICs cannot move" not in node.run_log()
                    runtime.stdin.write("stop\n")
                    runtime.stdin.flush()
                    assert _said(runtime, node) == {"StopPodSandbox": ""}
                else:
                    assert "not permitted" in started and "sysdra-nri.conf" in started and not in_pod, f"{started}\n{node.log()}"
                    assert "claimed NICs cannot move into their pods: the agent lacks CAP_NET_ADMIN, CAP_SYS_ADMIN" \
                        in node.run_log()  # said at start  # fmt: skip
                    # the agent's own namespace stands for the host's: right for a systemd service
                    assert "the host's network namespace: /srv/node/proc/1/ns/net: Permission denied" in node.run_log()
                assert IFNAME in _links(node) and _links(node, "pod1") == ["lo"]
                assert not run(client.unprepare(NIC_CLAIM)).claims[NIC_CLAIM[2]].error
            finally:
                runtime.stdin.close()
                runtime.wait(30)
                node.sh("systemctl stop sysdra")
    finally:
        node.sh(f"ip link del {IFNAME} 2>/dev/null; ip netns del pod1")


def _links(node: SystemdNode, netns: str | None = None) -> list[str]:
    """The link names in the container's network namespace, or in ``netns``."""
    out = node.sh(f"ip {'-n ' + netns if netns else ''} -o link show")
    return [line.split(": ")[1].split("@")[0] for line in out.splitlines()]


def _said(proc: subprocess.Popen, node: SystemdNode, timeout: float = 30) -> dict:
    """The NRI stand-in's next JSON line."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise RuntimeError(f"the NRI stand-in said nothing within {timeout:.0f}s:\n{node.log()}")
    return json.loads(proc.stdout.readline() or "{}")


def test_without_the_drop_in_an_mps_share_fails_and_leaves_nothing(node):
    client = node.install(mps=False)
    try:
        out = run(client.prepare(CLAIM)).claims[CLAIM[2]]
        assert "mounting a tmpfs" in out.error and "MPS needs CAP_SYS_ADMIN" in out.error, out.error
        assert node.pid1_mounts(node.shm) == [] and node.daemons() == [] and node.record() == {}
        assert not os.path.exists(node.host_path(f"{PLUGIN}/mps/{node.uuid}"))
    finally:
        node.sh("systemctl stop sysdra")


def test_with_the_drop_in_the_daemon_serves_from_the_hosts_mount_namespace(node):
    client = node.install(mps=True, nri=True)  # a node with GPUs and NICs: the two drop-ins together
    try:
        assert node.sh(f"readlink /proc/1/ns/mnt /proc/{node.main_pid()}/ns/mnt").split() == \
            [node.sh("readlink /proc/1/ns/mnt").strip()] * 2  # fmt: skip
        out = run(client.prepare(CLAIM)).claims[CLAIM[2]]
        assert not out.error, f"{out.error}\n{node.log()}"
        (pid,) = node.daemons()
        assert node.record()[node.uuid]["pid"] == pid
        _served_from_pid1s_namespace(node, pid)
        assert "/system.slice/sysdra.service" in node.sh(f"cat /proc/{pid}/cgroup")
        spec = node.sh(f"cat /run/cdi/*{CLAIM[2]}*")
        assert f'"hostPath":"{node.shm}"' in spec.replace(" ", ""), spec

        before = node.main_pid()
        node.sh("systemctl restart sysdra")
        assert node.main_pid() != before and node.daemons() == [pid] and node.record()[node.uuid]["pid"] == pid
        client = node.client()

        node.sh(f"kill -9 {pid}")  # the new agent supervises the daemon it adopted
        wait_until(lambda: node.record().get(node.uuid, {}).get("pid") not in (None, pid) and node.daemons(), 30,
                   what="the daemon started again", tail=node.log)  # fmt: skip
        (again,) = node.daemons()
        assert again != pid and node.record()[node.uuid]["pid"] == again, node.log()
        _served_from_pid1s_namespace(node, again)

        out = run(client.unprepare(CLAIM)).claims[CLAIM[2]]
        assert not out.error, out.error
        assert node.daemons() == [] and node.record() == {} and node.pid1_mounts(node.shm) == []
    finally:
        node.sh("systemctl stop sysdra")


def test_an_override_that_gives_the_unit_a_mount_namespace_fails_the_claim_clearly(node):
    """``systemctl edit sysdra`` adding a ``ReadWritePaths=`` (docs/operations.md's advice for
    another kubelet dir) on an MPS node: read after mps.conf, it gives the agent a mount namespace
    whose tmpfs the runtime would never see. The claim says so and nothing is left."""
    node.install(mps=True)
    override = "/etc/systemd/system/sysdra.service.d/override.conf"
    node.sh(f"printf '[Service]\\nReadWritePaths=/var/lib/kubelet/plugins\\n' > {override}"
            " && systemctl daemon-reload && systemctl restart sysdra")
    try:
        client = node.client()
        out = run(client.prepare(CLAIM)).claims[CLAIM[2]]
        assert f"the tmpfs at {node.shm} is not in the mount namespace of PID 1" in out.error, f"{out.error}\n{node.log()}"
        assert node.pid1_mounts(node.shm) == [] and node.daemons() == [] and node.record() == {}
        assert not os.path.exists(node.host_path(f"{PLUGIN}/mps/{node.uuid}"))
    finally:
        node.sh(f"rm -f {override} && systemctl daemon-reload && systemctl stop sysdra")


def _served_from_pid1s_namespace(node: SystemdNode, pid: int) -> None:
    """One tmpfs of the default 1Gi at the shm dir where PID 1 (the runtime) looks, holding what
    daemon ``pid`` wrote into its /dev/shm."""
    assert node.pid1_mounts(node.shm) == ["tmpfs rw,size=1048576k"], node.pid1_mounts(node.shm)
    assert f"fake-mps-{pid}" in node.sh(f"ls {node.shm}").split()
