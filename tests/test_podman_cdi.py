"""End to end with a real container runtime: prepare over the gRPC socket, then podman
(runc) injects the claim's CDI devices; after unprepare the IDs no longer resolve.

podman 4.3 reads CDI specs only from /etc/cdi and /var/run/cdi, so podman runs in a
private mount namespace with the test's CDI dir bound over /var/run/cdi. The image is a
busybox rootfs imported locally (no registry access). Needs root, podman, runc,
unshare and busybox (busybox-static): under CI=true a missing one fails the test.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import subprocess
import tempfile

import pytest

from agent.kubeletplugin import KubeletPlugin
from agent.kubeletplugin.claims import DirClaimSource
from agent.prepare.driver import Driver
from tests.conftest import copy_profile, require_podman
from tests.podman import podman_env
from tests.kubelet_standin import KubeletStandIn, claim, gpu, inventory, nic, settings_for, store_claim
from tests.test_nvidia_driver import add_video_libraries, prepare_gpu

pytestmark = [pytest.mark.slow, pytest.mark.root]
IMAGE = "localhost/sysdra-busybox:test"


class Podman:
    def __init__(self, tmp: str, cdi_dir: str):
        # podman refuses a runroot longer than 50 characters: keep its state in a short dir
        self.state = tempfile.mkdtemp(prefix="sysdra-pm", dir="/tmp")
        self.tmp, self.cdi_dir = tmp, cdi_dir
        self.env = podman_env(tmp)
        self.base = ["podman", "--root", os.path.join(self.state, "storage"), "--runroot", os.path.join(self.state, "run"),
                     "--storage-driver", "vfs"]

    def cleanup(self) -> None:
        shutil.rmtree(self.state, ignore_errors=True)

    def import_busybox(self, busybox: str) -> None:
        rootfs = os.path.join(self.tmp, "rootfs")
        for d in ("bin", "dev", "proc", "sys", "etc", "tmp"):
            os.makedirs(os.path.join(rootfs, d))
        shutil.copy(busybox, os.path.join(rootfs, "bin", "busybox"))
        os.symlink("busybox", os.path.join(rootfs, "bin", "sh"))
        tar = os.path.join(self.tmp, "rootfs.tar")
        subprocess.run(["tar", "-C", rootfs, "-cf", tar, "."], check=True)
        out = subprocess.run(self.base + ["import", tar, IMAGE], env=self.env, capture_output=True, text=True)
        assert out.returncode == 0, f"podman import: {out.stderr}"

    def run(self, cdi_ids: list[str], script: str) -> subprocess.CompletedProcess:
        devices = " ".join(f"--device {shlex.quote(i)}" for i in cdi_ids)
        podman = " ".join(map(shlex.quote, self.base))
        inner = (f"mount --bind {shlex.quote(self.cdi_dir)} /var/run/cdi && "
                 f"{podman} run --rm --network none {devices} {IMAGE} /bin/busybox sh -c {shlex.quote(script)}")
        os.makedirs("/var/run/cdi", exist_ok=True)
        return subprocess.run(["unshare", "-m", "sh", "-c", inner], env=self.env, capture_output=True, text=True,
                              timeout=120)


def test_podman_gets_prepared_devices(tmp_path):
    busybox = require_podman()

    host = str(tmp_path / "host")
    os.makedirs(os.path.join(host, "dev", "dri"))
    # a harmless "GPU": a real char device node with the numbers of /dev/null
    os.mknod(os.path.join(host, "dev", "dri", "renderD128"), 0o666 | 0o020000, os.makedev(1, 3))
    s = settings_for(str(tmp_path), root=host)
    inv = inventory(gpu(0, root=host, major=1, minor=3), nic(0, "ens9f0"), root=host)
    podman = Podman(str(tmp_path), s.cdi_dir)
    try:
        podman.import_busybox(busybox)
        asyncio.run(_prepare_and_run(s, inv, podman))
    finally:
        podman.cleanup()


async def _prepare_and_run(s, inv, podman: Podman) -> None:
    """Register like the kubelet, prepare, run containers with the returned IDs, unprepare."""
    plugin = KubeletPlugin(s, Driver(s, lambda: inv), DirClaimSource(s.cluster_dir))
    await plugin.start()
    try:
        kubelet = KubeletStandIn(s.registry_dir)
        await kubelet.register()
        c = store_claim(s, claim("c", [("gpu", "gpu-0000-1b-00-0"), ("net", "nic-0000-40-00-0")]))
        uid = c["metadata"]["uid"]
        resp = await kubelet.prepare(c)
        assert resp.claims[uid].error == ""
        ids = [i for d in resp.claims[uid].devices for i in d.cdi_device_ids]
        script = ("/bin/busybox stat -c '%F %t:%T' /dev/dri/renderD128; "
                  "/bin/busybox env | /bin/busybox grep ^SYSDRA_ | /bin/busybox sort")
        out = await asyncio.to_thread(podman.run, ids, script)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0] == "character special file 1:3"
        assert sorted(lines[1:]) == sorted([
            f"SYSDRA_CLAIM_UID={uid}",
            "SYSDRA_DEVICES=gpu-0000-1b-00-0,nic-0000-40-00-0",
            "SYSDRA_GPU_PCI_BUS_IDS=0000:1b:00.0",
            "SYSDRA_NIC_PCI_BUS_IDS=0000:40:00.0",
            "SYSDRA_NIC_INTERFACES=ens9f0",
            "SYSDRA_DEVICE_GPU_0000_1B_00_0=0000:1b:00.0",
            "SYSDRA_DEVICE_NIC_0000_40_00_0=0000:40:00.0",
        ])
        # a container that only asked for the NIC request gets no render node
        nic_ids = [i for d in resp.claims[uid].devices if list(d.request_names) == ["net"] for i in d.cdi_device_ids]
        out = await asyncio.to_thread(podman.run, nic_ids, "test -e /dev/dri/renderD128 && echo yes || echo no")
        assert out.returncode == 0 and out.stdout.strip() == "no", out.stderr

        assert (await kubelet.unprepare(c)).claims[uid].error == ""
        out = await asyncio.to_thread(podman.run, ids, "true")
        assert out.returncode != 0 and "unresolvable CDI devices" in out.stderr, out.stderr
    finally:
        await plugin.stop()


def test_podman_gets_an_nvidia_gpus_driver(tmp_path):
    """The driver edits of an NVIDIA GPU (docs/nvidia.md) as runc applies them: a compute and a
    video library under the names programs load them by, read-only, and nvidia-cdi-hook's two
    createContainer hooks run in the spec's order. The h200-vm fixture's driver (the spec's host
    paths point into the copy), its device nodes made by runc from the numbers; the hook is a
    script that logs its arguments (its text names enable-cuda-compat, as the real binary does)."""
    busybox = require_podman()
    root = copy_profile(tmp_path, "h200-vm")
    add_video_libraries(os.path.join(root, "usr/local/nvidia/lib64"))
    calls = tmp_path / "hook-calls"
    hook = os.path.join(root, "usr/local/nvidia/toolkit/nvidia-cdi-hook")
    os.makedirs(os.path.dirname(hook))
    with open(hook, "w") as f:
        f.write(f"#!/bin/sh\n# enable-cuda-compat, update-ldcache\necho \"$*\" >> {calls}\n")
    os.chmod(hook, 0o755)
    res, _, d = prepare_gpu(tmp_path, root, "gpu-0000-00-06-0", nvidia_driver_root="/usr/local/nvidia", cdi_host_root=root)
    assert res.error is None, res.error
    podman = Podman(str(tmp_path), d.settings.cdi_dir)
    try:
        podman.import_busybox(busybox)
        lib = "/usr/local/nvidia/lib64"
        script = (f"/bin/busybox cat {lib}/libcuda.so.1 {lib}/libnvcuvid.so.1 {lib}/libnvidia-opticalflow.so; "
                  f"/bin/busybox touch {lib}/libnvcuvid.so.1 2>/dev/null || echo read-only")
        out = podman.run([i for dev in res.devices for i in dev.cdi_ids], script)
    finally:
        podman.cleanup()
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["fixture: libcuda.so.580.159.04", "fixture: libnvcuvid.so.580.159.04",
                                       "fixture: libnvidia-opticalflow.so.580.159.04", "read-only"]
    assert calls.read_text().splitlines() == ["enable-cuda-compat --host-driver-version=580.159.04",
                                              "update-ldcache --folder /usr/local/nvidia/lib64"]


def test_podman_container_reads_device_metadata(tmp_path):
    """KEP-5304: the metadata file is at the exact in-container path, read-only, and says
    what the claim says."""
    busybox = require_podman()
    s = settings_for(str(tmp_path))
    inv = inventory(nic(0, "ens9f0"), nic(1, "ens9f1"))
    podman = Podman(str(tmp_path), s.cdi_dir)
    try:
        podman.import_busybox(busybox)
        asyncio.run(_prepare_and_read_metadata(s, inv, podman))
    finally:
        podman.cleanup()


async def _prepare_and_read_metadata(s, inv, podman: Podman) -> None:
    from agent.prepare.metadata import decode

    plugin = KubeletPlugin(s, Driver(s, lambda: inv), DirClaimSource(s.cluster_dir))
    await plugin.start()
    try:
        kubelet = KubeletStandIn(s.registry_dir)
        await kubelet.register()
        c = claim("net-claim", [("nets/fast", "nic-0000-40-00-0"), ("nets/fast", "nic-0000-41-00-0")])
        c["metadata"]["annotations"] = {"resource.kubernetes.io/pod-claim-name": "pod-nets"}
        store_claim(s, c)
        uid = c["metadata"]["uid"]
        resp = await kubelet.prepare(c)
        assert resp.claims[uid].error == ""
        ids = [i for d in resp.claims[uid].devices for i in d.cdi_device_ids]
        path = f"/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/pod-nets/nets/{s.driver_name}-metadata.json"
        script = f"/bin/busybox cat {path} && (echo x > {path} 2>/dev/null && echo WRITABLE || echo READONLY)"
        out = await asyncio.to_thread(podman.run, ids, script)
        assert out.returncode == 0, out.stderr
        assert out.stdout.rstrip().endswith("READONLY")
        obj = decode(out.stdout.rsplit("READONLY", 1)[0])
        assert obj["apiVersion"] == "metadata.resource.k8s.io/v1beta1"
        assert obj["metadata"] == {"name": "net-claim", "namespace": "default", "uid": uid, "generation": 1}
        assert obj["podClaimName"] == "pod-nets"
        assert obj["requests"] == [{"name": "nets/fast", "devices": [
            {"driver": s.driver_name, "pool": s.node_name, "name": "nic-0000-40-00-0", "networkData": {"interfaceName": "ens9f0"}},
            {"driver": s.driver_name, "pool": s.node_name, "name": "nic-0000-41-00-0", "networkData": {"interfaceName": "ens9f1"}},
        ]}]
        assert (await kubelet.unprepare(c)).claims[uid].error == ""
        out = await asyncio.to_thread(podman.run, ids, "true")
        assert out.returncode != 0 and "unresolvable CDI devices" in out.stderr, out.stderr
    finally:
        await plugin.stop()
