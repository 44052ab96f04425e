"""What the real node (tests/realnode.py) could leave on the host, taken before it starts and
compared after it stopped: processes, mounts, unix sockets, the fixed paths the kubelet,
containerd and runc write to, cgroups and the sysctls the kubelet sets."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import psutil

from tests.realnode_ns import SYSCTLS

# where the kubelet, containerd, runc, CNI and NRI write by default
WATCHED = ("/var/lib", "/var/log", "/run", "/etc", "/opt", "/usr/libexec", "/var/run")
# what the node's processes could mount (other tests on the machine mount other things meanwhile,
# /run/netns for their own network namespaces, for example)
NODE_MOUNTS = re.compile(r"kubelet|containerd|/var/log/pods|/var/log/containers|/run/netns/cni-| - overlay |sysdra-dev")
RELATED = re.compile(r"kube|containerd|cni|cdi|nri|runc|pods|containers|sysdra", re.I)


def _listing(path: str) -> set[str]:
    try:
        return {n for n in os.listdir(path) if RELATED.search(n)}
    except OSError:
        return set()


def _unix_sockets() -> set[str]:
    with open("/proc/net/unix") as f:
        return {line.split()[-1] for line in f.readlines()[1:] if len(line.split()) >= 8 and line.split()[-1].startswith("/")}


@dataclass
class HostState:
    mounts: set[str]
    sockets: set[str]
    listings: dict[str, set[str]]
    sysctls: dict[str, str]
    pids: set[int]

    @classmethod
    def take(cls) -> "HostState":
        with open("/proc/self/mountinfo") as f:
            mounts = {line.split(" ", 3)[3].strip() for line in f}  # root, mount point, options, type, source
        sysctls = {}
        for name in SYSCTLS:
            with open(f"/proc/sys/{name}") as f:
                sysctls[name] = f.read()
        return cls(mounts, _unix_sockets(), {p: _listing(p) for p in WATCHED}, sysctls, set(psutil.pids()))

    def compare(self, after: "HostState", *, node_dir: str, cgroup_root: str) -> list[str]:
        problems = [f"mount left: {m}" for m in sorted(after.mounts - self.mounts) if node_dir in m or NODE_MOUNTS.search(m)]
        # sockets at the fixed paths, on the host (/proc/net/unix also lists those bound in other
        # mount namespaces, another node's for one; other tests' sockets under /tmp come and go)
        problems += [f"socket left: {s}" for s in sorted(after.sockets - self.sockets)
                     if s.startswith(tuple(p + "/" for p in WATCHED)) and not s.startswith(node_dir + "/") and os.path.exists(s)]  # fmt: skip
        for path, names in after.listings.items():
            problems += [f"file left: {os.path.join(path, n)}" for n in sorted(names - self.listings[path])]
        problems += [f"sysctl {k} changed: {self.sysctls[k]!r} -> {v!r}" for k, v in after.sysctls.items() if v != self.sysctls[k]]
        for pid in sorted(after.pids - self.pids):
            try:
                p = psutil.Process(pid)
                with open(f"/proc/{pid}/cgroup") as f:
                    cgroups = f.read()
                if node_dir in " ".join(p.cmdline()) or cgroup_root in cgroups:
                    problems.append(f"process left: {pid} {p.cmdline()}")
            except (psutil.Error, OSError):
                continue
        base = "/sys/fs/cgroup"
        problems += [f"cgroup left: {os.path.join(base, c, cgroup_root.lstrip('/'))}" for c in sorted(os.listdir(base))
                     if os.path.isdir(os.path.join(base, c, cgroup_root.lstrip("/")))]  # fmt: skip
        return problems
