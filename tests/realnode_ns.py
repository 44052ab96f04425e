"""The real node's private mount namespace (tests/realnode.py): run as
``unshare -m --propagation private python -m tests.realnode_ns DIR ROOT``, it mounts the
node's own views over the fixed host paths the kubelet and containerd write to, writes
``DIR/ns/ready`` and then holds the namespace (sleeps) until it is killed. Every node process
enters it with ``nsenter -t <pid> -m``; nothing mounted here is seen outside, and the namespace
goes away with its last process.

- ``/var/lib``, ``/var/log``, ``/run``: directories under ``DIR/ns`` (the kubelet's
  ``/var/lib/kubelet/device-plugins``, ``/var/log/pods``, ``/var/log/containers``, runc's and the
  shims' state in ``/run/containerd``).
- ``/etc/hosts``: ``127.0.0.1 <node>``; the API server reaches the kubelet by hostname, because
  the kubelet refuses a loopback node IP.
- the six sysctls the kubelet sets at start (``setupKernelTunables``): plain files with the
  host's values, so the host's kernel settings stay as they are.
- ``/dev``: a tmpfs with every entry of the host's ``/dev`` bound back, plus the fixture root's
  device nodes made again at their host paths (``/dev/nvidia0`` ...). The agent sees them under
  its root (``<root>/dev/nvidia0``), containerd at ``/dev/nvidia0``, as on a real node where the
  DaemonSet mounts the host at ``/host``.
- the kubelet's plugins dir (``DIR/ns/var-lib/kubelet/plugins``, the agent's): a shared mount.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys

SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
           "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")  # fmt: skip
DIRS = {"/var/lib": "var-lib", "/var/log": "var-log", "/run": "run"}


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def bind(src: str, dst: str, recursive: bool = False) -> None:
    mount("--rbind" if recursive else "--bind", src, dst)


def private_dirs(ns: str, node: str) -> None:
    # the host's own /run/netns mount (`ip netns` makes one), hidden below the node's /run, would
    # stay in mountinfo under the same mount point: containerd takes the first of them, private,
    # and refuses a HostToContainer mount of /var/run/netns (the chart's, for the NRI plugin)
    # (a bind mount of the same file system: os.path.ismount cannot tell, mountinfo can)
    for _ in range(16):  # stacked ones too
        with open("/proc/self/mountinfo") as f:
            if not any(line.split()[4] == "/run/netns" for line in f):
                break
        subprocess.run(["umount", "-l", "/run/netns"], check=True)
    for target, name in DIRS.items():
        os.makedirs(os.path.join(ns, name), exist_ok=True)
        bind(os.path.join(ns, name), target)
    # containerd mounts pod network namespaces here; shared, so that the agent's own mount
    # namespace (a slave of this one) sees them, as a DaemonSet's HostToContainer mount does
    os.makedirs("/run/netns", exist_ok=True)
    bind("/run/netns", "/run/netns")
    mount("--make-shared", "/run/netns")
    hosts = os.path.join(ns, "hosts")
    with open(hosts, "w") as f:
        f.write(f"127.0.0.1 localhost {node}\n::1 localhost\n")
    bind(hosts, "/etc/hosts")
    for name in SYSCTLS:
        copy = os.path.join(ns, "sysctl", name.replace("/", "."))
        os.makedirs(os.path.dirname(copy), exist_ok=True)
        with open(f"/proc/sys/{name}") as src, open(copy, "w") as dst:
            dst.write(src.read())
        bind(copy, f"/proc/sys/{name}")


def private_dev(ns: str, root: str) -> None:
    host = os.path.join(ns, "hostdev")
    os.makedirs(host, exist_ok=True)
    bind("/dev", host, recursive=True)
    mount("-t", "tmpfs", "-o", "mode=755,nosuid", "sysdra-dev", "/dev")
    for name in sorted(os.listdir(host)):
        src, dst = os.path.join(host, name), os.path.join("/dev", name)
        st = os.lstat(src)
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(src), dst)
            continue
        if stat.S_ISDIR(st.st_mode):
            os.mkdir(dst)
        else:
            open(dst, "w").close()
        bind(src, dst, recursive=stat.S_ISDIR(st.st_mode))
    mount("--make-rprivate", host)
    subprocess.run(["umount", "-l", host], check=True)
    fixture = os.path.join(root, "dev")
    for dirpath, dirs, files in os.walk(fixture):
        rel = os.path.relpath(dirpath, fixture)
        target = os.path.normpath(os.path.join("/dev", rel))
        os.makedirs(target, exist_ok=True)
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISCHR(st.st_mode) and not os.path.lexists(os.path.join(target, name)):
                os.mknod(os.path.join(target, name), st.st_mode, st.st_rdev)


def main(argv: list[str]) -> None:
    dir_, root, node = argv
    ns = os.path.join(dir_, "ns")
    private_dirs(ns, node)
    private_dev(ns, root)
    # the kubelet's plugins dir a shared mount, as on a systemd host: an agent whose namespace
    # propagates its mounts back (the chart's nvidia.mps, Bidirectional) mounts the MPS daemons'
    # shm tmpfs there, and containerd, here, binds it into the shares' containers
    plugins = os.path.join(ns, "var-lib", "kubelet", "plugins")
    os.makedirs(plugins, exist_ok=True)
    bind(plugins, plugins)
    mount("--make-shared", plugins)
    # the node's root (its NVIDIA driver root too) shared, as / is on a systemd host: the chart
    # mounts a driver root other than / HostToContainer (a driver container mounts it later)
    bind(root, root, recursive=True)
    mount("--make-rshared", root)
    with open(os.path.join(ns, "ready"), "w") as f:
        f.write(str(os.getpid()))
    os.execvp("sleep", ["sleep", "2147483647"])


if __name__ == "__main__":
    main(sys.argv[1:])
