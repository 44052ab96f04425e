"""A real single-node Kubernetes v1.37.2 cluster for the tests and ``make cluster``
(docs/real-node.md): etcd, kube-apiserver, kube-scheduler and kube-controller-manager
(tests/controlplane.py), containerd v2.4.2 with Debian's runc, the kubelet, and the sysdra
agent (``sysdra run --cluster kube`` with a ServiceAccount token bound to the Node, under
deploy/'s RBAC and admission policy) on a copied fixture root whose device nodes are real.

127.0.0.1 and unix sockets only. The node runs in a private mount namespace
(tests/realnode_ns.py): the kubelet and containerd write to fixed host paths, which are the
node's own directories there. ``stop()`` leaves no process, mount, socket or file outside
``dir`` (tests/test_realnode.py checks); containerd's shims outlive containerd and ignore
SIGTERM, so every process of the namespace and every descendant of one is killed by PID.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field

import httpx2
import psutil

from tests.controlplane import REPO, ControlPlane, _die_with_parent, free_port, log_tail, peer, wait_until
from tests.realnode_setup import BUSYBOX, containerd_config, kubelet_config, real_device_nodes, write_images

DRIVER = "sysdra.io"
PROFILE = "server-2s-gpu-nic"

RUNNING = "sysdra running: node"  # the agent's line once started (its NRI plugin connects then)


@dataclass
class RealNode:
    """Attributes after ``start()``: ``plane`` (the ControlPlane: ``get``, ``create``, ``request`` ...),
    ``name`` (the Node), ``root`` (the fixture root), ``host`` (where the agent sees it),
    ``kubelet_dir``, ``cdi_dir``, ``image`` (busybox, for pods with ``imagePullPolicy: Never``)."""

    dir: str
    name: str = "sysdra-node"
    profile: str = PROFILE
    agent_args: list[str] = field(default_factory=list)
    apiserver_args: list[str] = field(default_factory=list)  # more kube-apiserver flags (bench: the audit log)
    kubelet_verbosity: int = 2  # the bench's 4 logs each NodePrepareResources call and the sandbox's creation
    plane: ControlPlane | None = None
    image: str = BUSYBOX
    procs: dict = field(default_factory=dict)
    holder: subprocess.Popen | None = None
    nri_request_timeout: str = "2s"  # containerd's plugin_request_timeout (its default)

    def __post_init__(self):
        self.dir = os.path.abspath(self.dir)
        self.root = os.path.join(self.dir, "root")
        self.host = os.path.join(self.dir, "host")  # the agent's --root: the fixture root, in its namespace only
        self.kubelet_dir = os.path.join(self.dir, "ns", "var-lib", "kubelet")
        self.cdi_dir = os.path.join(self.dir, "cdi")
        self.socket = os.path.join(self.dir, "containerd", "containerd.sock")
        # one per node directory: two nodes at once (two test sessions) never share one
        self.cgroup_root = "/sysdra-node-" + hashlib.sha256(self.dir.encode()).hexdigest()[:12]
        self.nri_socket = os.path.join(self.dir, "containerd", "nri", "nri.sock")  # containerd_config's
        self.bridge = "sdrbr" + hashlib.sha256(self.dir.encode()).hexdigest()[:8]  # the pods' CNI bridge, host network

    # --- start ---------------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> "RealNode":
        for tool in ("unshare", "nsenter", "runc", "busybox", "mount"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"the real node needs {tool!r} (Debian: util-linux, runc, busybox-static)")
        binaries = {n: peer(n) for n in ("kubelet", "kube-controller-manager", "containerd", "ctr", "containerd-shim-runc-v2")}
        os.makedirs(self.dir, exist_ok=True)
        if not os.path.isdir(self.root):
            shutil.copytree(os.path.join(REPO, "fixtures", "sysfs", self.profile), self.root, symlinks=True)
        real_device_nodes(self.root)
        for d in (self.host, self.cdi_dir, os.path.dirname(self.socket)):
            os.makedirs(d, exist_ok=True)
        try:
            self._start_namespace()
            self._start_control_plane(timeout)
            self._start_containerd(binaries, timeout)
            self.start_kubelet(timeout)
            self._apply_deploy()
            self.start_agent(timeout=timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_namespace(self) -> None:
        ready = os.path.join(self.dir, "ns", "ready")
        if os.path.exists(ready):
            os.unlink(ready)
        log = open(os.path.join(self.dir, "namespace.log"), "wb")
        self.holder = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", sys.executable, "-m", "tests.realnode_ns", self.dir, self.root, self.name],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
            env=dict(os.environ, PYTHONPATH=REPO), start_new_session=True)  # fmt: skip
        log.close()
        self._until(lambda: os.path.exists(ready), "the node's mount namespace", 30, self.holder, "namespace")

    @property
    def enter(self) -> list[str]:
        """The command prefix that runs a command in the node's mount namespace."""
        return ["nsenter", "-t", str(self.holder.pid), "-m", "--"]

    def _start_control_plane(self, timeout: float) -> None:
        pki = os.path.join(self.dir, "controlplane", "pki")
        self.plane = ControlPlane(dir=os.path.join(self.dir, "controlplane"), wrap=self.enter, extra_args=[
            "--kubelet-preferred-address-types=Hostname",
            f"--kubelet-client-certificate={pki}/admin.crt", f"--kubelet-client-key={pki}/admin.key", *self.apiserver_args,
        ])  # fmt: skip
        os.makedirs(self.plane.dir, exist_ok=True)
        self.plane.start(timeout)
        self.procs["kube-scheduler"] = self.plane.start_scheduler(timeout)
        port = free_port()
        kubeconfig, gates = self.plane.kubeconfig, self.plane.gates
        self.procs["kube-controller-manager"] = proc = self.plane._spawn("kube-controller-manager", [
            peer("kube-controller-manager"), f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}", "--leader-elect=false", "--bind-address=127.0.0.1",
            f"--secure-port={port}", f"--root-ca-file={self.plane.ca_path}", f"--service-account-private-key-file={pki}/sa.key",
            f"--flex-volume-plugin-dir={os.path.join(self.dir, 'kube-controller-manager', 'volume-plugins')}",
            "--feature-gates=" + ",".join(f"{k}={str(v).lower()}" for k, v in sorted(gates.items())), "--v=1",
        ])  # fmt: skip
        self._until(lambda: httpx2.get(f"https://127.0.0.1:{port}/healthz", verify=False, timeout=2).status_code == 200,
                    "kube-controller-manager", timeout, proc, "kube-controller-manager")  # fmt: skip

    def _spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(os.path.join(self.dir, f"{name}.log"), "ab")
        # a session of its own: Ctrl-C on `make cluster` reaches only the Python process, which stops the node in order
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.dir,
                                preexec_fn=_die_with_parent, env=env, start_new_session=True)  # fmt: skip
        log.close()
        self.procs[name] = proc
        return proc

    def _start_containerd(self, binaries: dict, timeout: float) -> None:
        cdir = os.path.dirname(self.socket)
        config = containerd_config(cdir, self.cdi_dir, self.socket, self.bridge, self.nri_request_timeout)
        path = os.path.dirname(binaries["containerd-shim-runc-v2"]) + ":" + os.environ.get("PATH", "")
        proc = self._spawn("containerd", [*self.enter, binaries["containerd"], "--config", config],
                           env=dict(os.environ, PATH=path))  # fmt: skip
        self._until(lambda: os.path.exists(self.socket), "containerd", timeout, proc, "containerd")
        archive = os.path.join(self.dir, "images.tar")
        write_images(archive, shutil.which("busybox"))
        out = subprocess.run([*self.enter, binaries["ctr"], "-a", self.socket, "-n", "k8s.io", "images", "import", archive],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"ctr images import: {out.stderr}")

    def start_kubelet(self, timeout: float = 120.0) -> subprocess.Popen:
        kdir = os.path.join(self.dir, "kubelet")
        os.makedirs(kdir, exist_ok=True)
        pki = self.plane._pki
        kubeconfig = self.plane.write_kubeconfig(os.path.join(kdir, "kubeconfig"), cert=self.plane.node_identity(self.name))
        if not hasattr(self, "kubelet_port"):
            self.kubelet_port, self.healthz_port = free_port(), free_port()
        config = kubelet_config(os.path.join(kdir, "config.yaml"), socket=self.socket, port=self.kubelet_port,
                                healthz=self.healthz_port, ca=self.plane.ca_path,
                                serving=pki.issue("kubelet-serving", self.name, server=True),
                                cgroup_root=self.cgroup_root, gates=self.plane.gates,
                                volume_plugins=os.path.join(kdir, "volume-plugins"))  # fmt: skip
        proc = self._spawn("kubelet", [
            *self.enter, peer("kubelet"), f"--config={config}", f"--kubeconfig={kubeconfig}", f"--hostname-override={self.name}",
            f"--v={self.kubelet_verbosity}",
        ])  # fmt: skip
        self._until(self.node_ready, "the kubelet (Node Ready)", timeout, proc, "kubelet")
        return proc

    def _apply_deploy(self) -> None:
        for manifest in ("namespace.yaml", "rbac.yaml", "admission-policy.yaml", "deviceclasses.yaml"):
            self.plane.apply(os.path.join(REPO, "deploy", manifest))

    def start_agent(self, *args: str, timeout: float = 60.0, wait: bool = True, name: str = "agent",
                    env: dict | None = None, propagation: str = "slave") -> subprocess.Popen:
        """``sysdra run --cluster kube`` as the DaemonSet runs it: the fixture root at ``host``
        (its own mount namespace), a ServiceAccount token bound to the Node. ``name``: its
        process and log (``<name>.log``), another for the second instance of a rolling update.
        ``propagation``: of the agent's namespace; ``shared`` as the chart's ``nvidia.mps`` runs it
        (the plugins dir Bidirectional: the MPS shm tmpfs reaches containerd)."""
        token = self.plane.token("sysdra", "sysdra", node=self.name, seconds=86400)
        kubeconfig = self.plane.write_kubeconfig(os.path.join(self.dir, "agent.kubeconfig"), token=token, namespace="sysdra")
        extra = env or {}  # a test's (SYSDRA_TEST_CRASH_AT)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SYSDRA_")}
        env.update(KUBECONFIG=kubeconfig, SYSDRA_CONFIG=os.devnull, PYTHONPATH=REPO, NODE_NAME=self.name, **extra)
        agent = [sys.executable, "-m", "agent", "run", "--root", self.host, "--node-name", self.name, "--cluster", "kube",
                 "--kubelet-dir", self.kubelet_dir, "--cdi-dir", self.cdi_dir, "--metrics-address", "",
                 # the runtime sees the host's files (the NVIDIA driver's) in the fixture root, not at /
                 "--cdi-host-root", self.root,
                 "--nri-socket", self.nri_socket, *self.agent_args, *args]  # fmt: skip
        inner = 'mount --rbind "$1" "$2" && shift 2 && cd "$0" && exec "$@"'
        registered, published, running = self.registrations(name), self.publishes(name), self._log_count(name, RUNNING)
        # slave: the pods' network namespaces mounted under /run/netns later reach the agent (NRI)
        proc = self._spawn(name, [*self.enter, "unshare", "-m", "--propagation", propagation, "sh", "-c", inner,
                                     REPO, self.root, self.host, *agent], env=env)  # fmt: skip
        if wait:  # registered, its first publish done (an earlier agent's slices may still be there), running
            self._until(lambda: self.registrations(name) > registered and self.publishes(name) > published
                        and self._log_count(name, RUNNING) > running and self.slices(),
                        "the agent registered, published and running", timeout, proc, name)  # fmt: skip
        return proc

    def registrations(self, name: str = "agent") -> int:
        """How often the kubelet has registered the agent (its NotifyRegistrationStatus, as the agent logs it)."""
        return self._log_count(name, "registered with the kubelet as DRA driver")

    def publishes(self, name: str = "agent") -> int:
        """How many agent runs logged under ``name`` finished their first publish."""
        return self._log_count(name, "ResourceSlices in sync:")

    def _log_count(self, name: str, text: str) -> int:
        try:
            with open(os.path.join(self.dir, f"{name}.log"), errors="replace") as f:
                return f.read().count(text)
        except OSError:
            return 0

    # --- state -----------------------------------------------------------------------------
    def node_ready(self) -> bool:
        r = self.plane.request("GET", f"/api/v1/nodes/{self.name}", ok=False)
        if r.status_code != 200:
            return False
        conds = r.json().get("status", {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

    def slices(self) -> list[dict]:
        return self.plane.list("ResourceSlice", fields={"spec.nodeName": self.name, "spec.driver": DRIVER})

    def log_tail(self, name: str, lines: int = 40) -> str:
        """The end of a node process's log, or of a control-plane peer's."""
        return log_tail(self.dir, name, lines) or (self.plane.log_tail(name, lines) if self.plane else "")

    def _until(self, probe, what: str, timeout: float, proc=None, log: str | None = None) -> None:
        wait_until(probe, timeout, what=what, proc=proc, tail=lambda: self.log_tail(log or what))

    # --- stop ------------------------------------------------------------------------------
    def stop_process(self, name: str, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def namespace_processes(self) -> list[psutil.Process]:
        """Every process in the node's mount namespace (containerd, its shims, the agent's
        namespace is a child of it) and every descendant of one (the containers), and every
        process running a program of the fixture root: an MPS daemon the agent started (a mount
        namespace of its own, a session of its own) is nobody's child once the agent stopped."""
        if self.holder is None or self.holder.poll() is not None:
            return []
        ns = os.stat(f"/proc/{self.holder.pid}/ns/mnt").st_ino
        found: dict[int, psutil.Process] = {}
        mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
        for p in psutil.process_iter():
            try:
                if p.pid in mine or p.pid == self.holder.pid:
                    continue
                if os.stat(f"/proc/{p.pid}/ns/mnt").st_ino == ns or self._runs_a_host_program(p):
                    found[p.pid] = p
                    found.update((c.pid, c) for c in p.children(recursive=True))
            except (psutil.Error, OSError):
                continue
        return list(found.values())

    def _runs_a_host_program(self, p: psutil.Process) -> bool:
        """The program, or the script an interpreter runs, is under the fixture root (the agent's
        view or the runtime's): never a person's ``tail`` of a log in the node's directory."""
        return any(a.startswith((self.host + "/", self.root + "/")) for a in p.cmdline()[:3])

    def stop(self) -> None:
        for name in [n for n in self.procs if n.startswith("agent")] + ["kubelet", "containerd"]:
            self.stop_process(name, timeout=15)
        for _ in range(3):  # shims ignore SIGTERM; a shim's container may be reparented mid-walk
            procs = self.namespace_processes()
            if not procs:
                break
            for p in procs:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(procs, timeout=10)
        if self.plane is not None:
            self.plane.stop()
        self.procs.clear()
        if self.holder is not None and self.holder.poll() is None:
            self.holder.kill()
            self.holder.wait(10)
        self._remove_cgroups()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)  # absent: hostNetwork pods only

    def _remove_cgroups(self) -> None:
        """runc's container cgroups under the kubelet's cgroupRoot (cgroupfs is not namespaced)."""
        base = "/sys/fs/cgroup"
        for controller in sorted(os.listdir(base)) if os.path.isdir(base) else []:
            top = os.path.join(base, controller, self.cgroup_root.lstrip("/"))
            for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda w: -w[0].count("/")):
                try:
                    os.rmdir(dirpath)
                except OSError:
                    pass
