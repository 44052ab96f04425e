"""Run a command in a plain rootfs with one CDI device's edits applied, as a container runtime
would apply them: device nodes (mknod), bind mounts (read-only where the spec says so) and
environment, in new mount, IPC and PID namespaces, then ``chroot``. Hooks are not run (the
runner reports them and fails): what the check proves must come from the spec's own edits.

A stand-in for runc where no runtime is installed (the GPU machine has none); needs root.

    python3 cdirun.py --spec SPEC.json --device NAME --rootfs DIR [--keep-env NAME ...] -- CMD ARG...
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import stat
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID = 0x00020000, 0x08000000, 0x20000000
_libc = ctypes.CDLL(None, use_errno=True)


def mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    if _libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {src} -> {target}: {os.strerror(err)}")


def edits_of(spec: dict, device: str) -> list[dict]:
    found = [d for d in spec["devices"] if d["name"] == device]
    if not found:
        raise SystemExit(f"cdirun: no device {device!r} in the spec")
    return [spec.get("containerEdits") or {}, found[0].get("containerEdits") or {}]


def inside(rootfs: str, path: str) -> str:
    return os.path.join(rootfs, path.lstrip("/"))


def apply(rootfs: str, edits: list[dict]) -> dict[str, str]:
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    mount("tmpfs", inside(rootfs, "/dev"), "tmpfs", MS_NOSUID, "mode=755")
    mount("proc", inside(rootfs, "/proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    try:
        mount("/sys", inside(rootfs, "/sys"), None, MS_BIND | MS_REC)
        mount(None, inside(rootfs, "/sys"), None, MS_BIND | MS_REMOUNT | MS_RDONLY)
    except OSError as err:  # what a CUDA program reads of /sys is optional
        print(f"cdirun: /sys: {err}", file=sys.stderr)
    for e in edits:
        if e.get("hooks"):
            raise SystemExit(f"cdirun: the spec has hooks this runner does not run: {e['hooks']}")
        for node in e.get("deviceNodes") or []:
            path = inside(rootfs, node["path"])
            os.makedirs(os.path.dirname(path), exist_ok=True)
            kind = stat.S_IFBLK if node.get("type") == "b" else stat.S_IFCHR
            try:
                os.mknod(path, kind | node.get("fileMode", 0o666), os.makedev(node["major"], node["minor"]))
                os.chmod(path, node.get("fileMode", 0o666))
            except OSError as err:  # a sandbox that refuses mknod: the host's node, bind-mounted
                print(f"cdirun: mknod {node['path']}: {err.strerror}; bind-mounting the host's node", file=sys.stderr)
                open(path, "w").close()
                mount(node.get("hostPath") or node["path"], path, None, MS_BIND)
        for m in e.get("mounts") or []:
            target = inside(rootfs, m["containerPath"])
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if os.path.isdir(m["hostPath"]):
                os.makedirs(target, exist_ok=True)
            elif not os.path.exists(target):
                open(target, "w").close()
            opts = m.get("options") or []
            mount(m["hostPath"], target, None, MS_BIND | (MS_REC if "rbind" in opts else 0))
            flags = ((MS_RDONLY if "ro" in opts else 0) | (MS_NOSUID if "nosuid" in opts else 0)
                     | (MS_NODEV if "nodev" in opts else 0) | (MS_NOEXEC if "noexec" in opts else 0))
            if flags:
                mount(None, target, None, MS_BIND | MS_REMOUNT | flags)
        for entry in e.get("env") or []:
            name, _, value = entry.partition("=")
            env[name] = value
    return env


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--spec", required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--rootfs", required=True)
    p.add_argument("cmd", nargs="+")
    args = p.parse_args(argv)
    with open(args.spec) as f:
        edits = edits_of(json.load(f), args.device)
    if _libc.unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWPID) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    pid = os.fork()
    if pid == 0:  # PID 1 of the new namespace: its own /proc
        try:
            env = apply(os.path.abspath(args.rootfs), edits)
            os.chroot(args.rootfs)
            os.chdir("/")
            sys.stdout.flush()
            os.execve(args.cmd[0], args.cmd, env)
        except BaseException as err:  # noqa: BLE001 - reported, then the child's own exit
            print(f"cdirun: {err}", file=sys.stderr, flush=True)
            os._exit(127)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
