"""The host's interface addresses read from another network namespace, run by
test_claim_status_offline.py as ``unshare -n python -m tests.netaddrs_scenario TMP``: the reader in
a fresh network namespace of its own, as the DaemonSet's agent is in its pod's, and the "host" in
another one (a ``sleep`` in a second fresh namespace), reached as the DaemonSet reaches the
host's: through the init of the root's procfs (``proc/1``, here a link to that process). The
host's veth interface has a name and an index this process's namespace has not, so a name looked
up here instead of there is no name. Prints one JSON line of results; exits non-zero on a failure.

Three roots, each with that ``proc/1``: ``kernel`` has the kernel's sysfs as its ``sys`` (the
DaemonSet's ``/host``: rtnetlink in the init's namespace, IPv4 and IPv6), ``files`` a directory
(a fixture tree: the init's ``net/if_inet6``, IPv6 only), and ``kernel`` again read by a process
without CAP_SYS_ADMIN, which may not enter the init's namespace (if_inet6 again)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

from agent.prepare import netaddrs

LINK = "hostnic7"
V4, V6 = "192.0.2.7/24", "2001:db8::7/64"
READ = "import json, sys; from agent.prepare import netaddrs; print(json.dumps(netaddrs.addresses(sys.argv[1])))"


def tree(tmp: str, name: str, pid: int, sysfs: bool) -> str:
    root = os.path.join(tmp, name)
    os.makedirs(os.path.join(root, "proc"))
    os.symlink(f"/proc/{pid}", os.path.join(root, "proc", "1"))  # the host's init, in its procfs
    if sysfs:
        os.symlink("/sys", os.path.join(root, "sys"))
    else:
        os.makedirs(os.path.join(root, "sys", "class", "net"))
    return root


def scenario(tmp: str, pid: int) -> dict:
    def ip(*args: str) -> None:
        subprocess.run(["nsenter", "-t", str(pid), "-n", "ip", *args], check=True, capture_output=True)

    ip("link", "add", LINK, "type", "veth", "peer", "name", LINK + "p")
    ip("link", "set", LINK, "up")
    ip("addr", "add", V4, "dev", LINK)
    ip("addr", "add", V6, "dev", LINK, "nodad")
    kernel, files = tree(tmp, "kernel", pid, True), tree(tmp, "files", pid, False)
    unprivileged = subprocess.run(["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin", sys.executable, "-c",
                                   READ, kernel], capture_output=True, text=True, timeout=60)  # fmt: skip
    if unprivileged.returncode:
        raise AssertionError(f"the reader without CAP_SYS_ADMIN: {unprivileged.stderr}")
    return {"own_links": sorted(name for _, name in socket.if_nameindex()),
            "kernel": netaddrs.addresses(kernel), "files": netaddrs.addresses(files),
            "no_sys_admin": json.loads(unprivileged.stdout)}


def main(tmp: str) -> int:
    host = subprocess.Popen(["unshare", "-n", "sleep", "infinity"])
    try:
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{host.pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            if time.monotonic() > deadline:
                raise AssertionError("the host's namespace never came")
            time.sleep(0.01)
        out = scenario(tmp, host.pid)
    except Exception as err:  # noqa: BLE001 - reported in the JSON line
        print(json.dumps({"failure": f"{type(err).__name__}: {err}"}))
        return 1
    finally:
        host.kill()
        host.wait()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
