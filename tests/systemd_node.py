"""A node where systemd is PID 1, for tests/test_systemd_real.py: a podman container of the
agent's own image (deploy/image/build.sh) plus Debian's systemd, booted with ``--systemd=always``;
``systemd/install.sh`` installs the unit (and with ``SYSDRA_MPS=1`` the drop-in ``sysdra-mps.conf``)
as on a host. The agent runs the fixture node's simulated ``nvidia-cuda-mps-control`` (no NVIDIA
driver can run here) and claims come from the directory store (the container has no network); the
store lies under the kubelet's plugins dir, which the unit may write, so the unit runs exactly as
shipped."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

from discovery.inventory import scan
from tests.conftest import REPO, profile_root
from tests.controlplane import wait_until
from tests.faults.harness import BOOT_ID, DRIVER, FreshKubeletClient, run
from tests.podman import podman_env

VERSION = "0.1.0"
IMAGE = "localhost/sysdra-systemd-node:test"
CONTAINERFILE = f"""\
FROM ghcr.io/sysdra/sysdra:{VERSION}
USER 0:0
RUN apt-get update -qq \\
 && apt-get install -y -qq --no-install-recommends systemd iproute2 >/dev/null \\
 && rm -rf /var/lib/apt/lists/*
ENTRYPOINT ["/lib/systemd/systemd"]
"""
KUBELET = "/var/lib/kubelet"
PLUGIN = f"{KUBELET}/plugins/{DRIVER}"
CONFIG = f"""\
root: /srv/node
node_name: node-1
cluster: dir:{KUBELET}/plugins/test-cluster
share: [gpu]
metrics_address: ""
"""
CLAIM = ("default", "mps", "0000000a-0000-4000-8000-00000000ca11")
SHARE = "0000000b-0000-4000-8000-00000000ca11"


class SystemdNode:
    """The container: systemd as PID 1, the fixture node at /srv/node, the kubelet's dir bound
    from the test's own (its sockets reached from here), the repository's systemd/ read-only."""

    def __init__(self, tmp: str):
        self.tmp = tmp
        self.name = f"sysdra-systemd-{os.getpid()}"
        self.env = podman_env(tmp)
        self.kubelet = os.path.join(tmp, "kubelet")
        os.makedirs(self.kubelet)
        root = os.path.join(tmp, "srv", "node")
        shutil.copytree(profile_root("server-2s-gpu-nic"), root, symlinks=True)
        os.makedirs(os.path.dirname(os.path.join(root, BOOT_ID)), exist_ok=True)
        with open(os.path.join(root, BOOT_ID), "w") as f:
            f.write("boot-1\n")
        os.symlink("/proc/1", os.path.join(root, "proc", "1"))  # the node's init (systemd) in its procfs
        with open(os.path.join(tmp, "srv", "config.yaml"), "w") as f:
            f.write(CONFIG)
        gpu = next(d for d in scan(root).devices if d.kind == "gpu" and d.gpu.vendor == "nvidia" and d.pci.driver == "nvidia")
        self.gpu, self.uuid = gpu.name, gpu.gpu.nvidia_uuid
        self.shm = f"{PLUGIN}/mps/{self.uuid}/shm"
        self.write_claim(CLAIM, {"device": self.gpu, "shareID": SHARE, "consumedCapacity": {"memory": "8Gi", "compute": "25"}})

    def write_claim(self, claim: tuple[str, str, str], result: dict, pod: str | None = None) -> None:
        """A claim allocated on this node with one result in the store (reserved for ``pod``)."""
        ns, name, uid = claim
        obj = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name, "namespace": ns, "uid": uid},
               "spec": {"devices": {"requests": [{"name": "dev", "exactly": {"deviceClassName": "x.sysdra.io"}}]}},
               "status": {"allocation": {"devices": {"results": [{"request": "dev", "driver": DRIVER, "pool": "node-1", **result}]}}}}
        if pod:
            obj["status"]["reservedFor"] = [{"resource": "pods", "name": "app", "uid": pod}]
        d = self.host_path(f"{KUBELET}/plugins/test-cluster/resourceclaims/{ns}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"{name}.json"), "w") as f:
            json.dump(obj, f)

    def host_path(self, path: str) -> str:
        """Where a path under the container's kubelet dir is here."""
        assert path.startswith(KUBELET)
        return self.kubelet + path[len(KUBELET) :]

    # --- the container --------------------------------------------------------------------
    def start(self) -> None:
        subprocess.run(["podman", "run", "-d", "--name", self.name, "--privileged", "--systemd=always", "--network=none",
                        "-v", f"{self.tmp}/srv:/srv", "-v", f"{self.kubelet}:{KUBELET}",
                        "-v", f"{REPO}:/opt/sysdra-src:ro", IMAGE],
                       env=self.env, check=True, capture_output=True, timeout=120)  # fmt: skip
        # empty while systemd's bus is not up yet
        wait_until(lambda: self.sh("systemctl is-system-running --wait 2>/dev/null || true", timeout=120).strip()
                   in ("running", "degraded"), 120, what="systemd in the container",
                   tail=lambda: self.sh("systemctl --failed"))  # fmt: skip

    def remove(self) -> None:
        subprocess.run(["podman", "rm", "-f", "-t", "0", self.name], env=self.env, capture_output=True, timeout=120)

    def sh(self, script: str, timeout: float = 60) -> str:
        out = subprocess.run(["podman", "exec", self.name, "bash", "-c", script], env=self.env, capture_output=True,
                             text=True, timeout=timeout)  # fmt: skip
        assert out.returncode == 0, f"{script}: exit {out.returncode}\n{out.stdout}{out.stderr}"
        return out.stdout

    def log(self) -> str:
        return self.sh("journalctl -u sysdra --no-pager | tail -40")

    def run_log(self) -> str:
        """The running agent's whole log (this start's)."""
        return self.sh("journalctl --no-pager _SYSTEMD_INVOCATION_ID=$(systemctl show -p InvocationID --value sysdra)")

    # --- the unit ---------------------------------------------------------------------------
    def install(self, mps: bool, nri: bool = False, sysfs: bool = False) -> FreshKubeletClient:
        """The unit with the drop-ins asked for (and none other), the test's config; started afresh."""
        drop_ins = "/etc/systemd/system/sysdra.service.d"
        self.sh(f"rm -rf {drop_ins} && SYSDRA_MPS={int(mps)} SYSDRA_NRI={int(nri)} SYSDRA_SYSFS={int(sysfs)}"
                " SYSDRA_BIN=/opt/sysdra/bin/sysdra"
                " /opt/sysdra-src/systemd/install.sh && rm -f /etc/sysdra/config.yaml.example"
                " && install -m 0644 /srv/config.yaml /etc/sysdra/config.yaml"
                " && systemctl daemon-reload && systemctl restart sysdra")  # fmt: skip
        return self.client()

    def nri_runtime(self, pod: str, netns: str) -> subprocess.Popen:
        """tests/nri_standin.py at the agent's default NRI socket, in the container (no runtime
        runs there): once the agent registered, ``run``/``stop`` on its stdin start and stop pod
        ``pod`` in ``netns``."""
        self.sh("mkdir -p /run/nri && rm -f /run/nri/nri.sock")
        proc = subprocess.Popen(["podman", "exec", "-i", "-w", "/opt/sysdra-src", "-e", "PYTHONPATH=/opt/sysdra-src",
                                 self.name, "/opt/sysdra/bin/python", "-m", "tests.nri_standin", "/run/nri/nri.sock",
                                 pod, netns], env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        wait_until(lambda: "/run/nri/nri.sock" in self.sh("ls /run/nri/nri.sock 2>/dev/null || true"), 30,
                   what="the NRI stand-in's socket", proc=proc)  # fmt: skip
        return proc

    def client(self) -> FreshKubeletClient:
        """Registered like the kubelet (a restarted agent's new socket may take a moment); its
        DRA endpoint reached through the bound kubelet dir."""
        def registered() -> FreshKubeletClient | None:
            client = FreshKubeletClient(self.host_path(f"{KUBELET}/plugins_registry"))
            try:
                run(client.register(), timeout=5)
            except Exception:  # not serving yet: no socket, or a refused or failing call
                return None
            client.info.endpoint = self.host_path(client.info.endpoint)
            return client

        return wait_until(registered, 30, what="the agent's registration", tail=self.log)

    def main_pid(self) -> int:
        return int(self.sh("systemctl show -p MainPID --value sysdra"))

    # --- what PID 1 sees --------------------------------------------------------------------
    def pid1_mounts(self, path: str) -> list[str]:
        """The mounts at ``path`` in PID 1's namespace: fstype and super options of each."""
        out = []
        for line in self.sh("cat /proc/1/mountinfo").splitlines():
            fields = line.split()
            if fields[4] == path:
                fstype, _, opts = line.split(" - ", 1)[1].split(" ", 2)
                out.append(f"{fstype} {opts}")
        return out

    def daemons(self) -> list[int]:
        """PIDs of the running simulated MPS control daemons (zombies left out)."""
        script = ('for p in /proc/[0-9]*; do c=$(tr "\\0" " " < $p/cmdline 2>/dev/null); s=$(cut -d" " -f3 $p/stat'
                  ' 2>/dev/null); case "$c" in *nvidia-cuda-mps-control\\ -f\\ ) [ "$s" != Z ] && echo ${p#/proc/};; esac;'
                  ' done; true')  # fmt: skip
        return sorted(int(p) for p in self.sh(script).split())

    def record(self) -> dict:
        """The daemons' records (agent/prepare/mps_records.py) as the agent left them."""
        path = self.host_path(f"{PLUGIN}/mps/daemons.json")
        if not os.path.exists(path):
            return {}
        with open(path) as f:
            return json.load(f)["daemons"]

