"""The test peers' processes: kube-apiserver, etcd, kube-scheduler, the kubelet and the rest,
built from upstream Go modules by tests/peers/build.sh into .peers/bin (docs/control-plane.md).

``peer(name)`` finds one: a missing peer binary is a failure, never a skip (run
``tests/peers/build.sh``, ``make peers``). ``wait_until`` waits for a peer to be ready with its
log's tail on failure; ``unique`` gives names that keep tests apart on a shared server.
"""

from __future__ import annotations

import ctypes
import glob
import itertools
import os
import signal
import socket
import subprocess
import time

import httpx2

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS_BIN = os.environ.get("SYSDRA_PEERS_BIN") or os.path.join(REPO, ".peers", "bin")
BUILD_HINT = "run tests/peers/build.sh (or `make peers`; needs Go >= 1.26 and the Go module proxy)"


class PeerMissing(RuntimeError):
    pass


def peer(name: str) -> str:
    path = os.path.join(PEERS_BIN, name)
    if not os.access(path, os.X_OK):
        raise PeerMissing(f"test peer {name!r} is not built ({path} missing): {BUILD_HINT}")
    return path


def peer_crds() -> list[str]:
    """The CRD files ``tests/peers/build.sh crds`` put beside the peers' binaries."""
    crds = os.path.join(os.path.dirname(PEERS_BIN), "crds")
    paths = sorted(glob.glob(os.path.join(crds, "*.yaml")))
    if not paths:
        raise PeerMissing(f"no CRDs in {crds}: {BUILD_HINT}")
    return paths


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_counter = itertools.count(1)


def log_tail(dir_: str, name: str, lines: int = 40) -> str:
    """The last ``lines`` of ``dir_/<name>.log`` ("" when there is none)."""
    try:
        with open(os.path.join(dir_, f"{name}.log"), errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def wait_until(probe, timeout: float, *, what: str, proc: subprocess.Popen | None = None, tail=lambda: "", interval: float = 0.2):
    """The first true value of ``probe()`` (connection errors count as not yet); RuntimeError
    with ``tail()`` (a log's end) when ``proc`` exits first or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{tail()}")
        try:
            value = probe()
            if value:
                return value
        except (httpx2.HTTPError, OSError):
            pass
        time.sleep(interval)
    raise RuntimeError(f"{what} not ready after {timeout:.0f}s:\n{tail()}")


def unique(prefix: str) -> str:
    """A DNS-label name unique within the test session (tests share one server)."""
    return f"{prefix}-{os.getpid() % 10000}-{next(_counter)}"


def _die_with_parent() -> None:
    # the peers must not outlive a killed pytest
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass

