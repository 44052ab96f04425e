"""Shared test helpers.

``require_tool`` / ``require_root``: under CI=true a missing tool or privilege is a
failure, never a silent skip; on a developer machine the test is skipped with a reason.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "fixtures", "sysfs")
EXPECTED = os.path.join(REPO, "fixtures", "expected")
IN_CI = os.environ.get("CI") == "true"

if REPO not in sys.path:
    sys.path.insert(0, REPO)

# The agents the tests run are never systemd services, even when the test run is one (a CI job
# under a unit): with $INVOCATION_ID they would take PID 1's namespaces for the runtime's.
os.environ.pop("INVOCATION_ID", None)

from tests import checkpoint_guard  # noqa: E402

checkpoint_guard.install()  # every save(changed=...) also checks that the caller named every entry it changed


def pytest_configure(config):
    # Unix socket paths (at most 108 bytes) are built below the tests' temp dirs, and pytest's own
    # base, /tmp/pytest-of-<user>/pytest-<run counter>, grows with the counter (a machine's 1000th
    # run made sockets of some tests 109 bytes long): a base of fixed length instead.
    if config.option.basetemp is None:
        _drop_old_basetemps("/tmp")
        config.option.basetemp = tempfile.mkdtemp(prefix="sysdra-tests-", dir="/tmp")
        config.stash[_OWN_BASETEMP] = config.option.basetemp


KEPT_FAILED_RUNS = 3  # as pytest keeps its own base dirs: a failed run's files stay for a look, not for ever
IN_USE = 3600.0  # seconds: a base dir changed since is another session's, still running


def _drop_old_basetemps(parent: str) -> None:
    """Failed runs' base dirs beyond the newest KEPT_FAILED_RUNS: each holds its nodes, images
    and logs (hundreds of MB), and a machine that ran many failed sessions ran out of disk."""
    import time

    dirs = []
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if name.startswith("sysdra-tests-") and os.path.isdir(path) and not os.path.islink(path):
            dirs.append((os.stat(path).st_mtime, path))
    dirs.sort(reverse=True)
    for mtime, path in dirs[KEPT_FAILED_RUNS:]:
        if time.time() - mtime > IN_USE:
            shutil.rmtree(path, ignore_errors=True)


def pytest_sessionfinish(session, exitstatus):
    own = session.config.stash.get(_OWN_BASETEMP, None)
    if own is not None and exitstatus == 0:  # a failed run's files stay for a look, as pytest's would
        shutil.rmtree(own, ignore_errors=True)


_OWN_BASETEMP = pytest.StashKey[str]()


def _missing(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"required in CI: {reason}")
    pytest.skip(reason)


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        _missing(f"{name} is not installed")
    return path


def require_root() -> None:
    if os.geteuid() != 0:
        _missing("needs root")


def require_podman() -> str:
    """Root, podman, runc, unshare and tar for a container run; returns busybox's path (the image)."""
    require_root()
    for tool in ("podman", "runc", "unshare", "tar"):
        require_tool(tool)
    return require_tool("busybox")


def profiles() -> list[str]:
    if not os.path.isdir(FIXTURES):
        return []
    return sorted(p for p in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, p, "sys")))


def profile_root(name: str) -> str:
    return os.path.join(FIXTURES, name)


def copy_profile(tmp_path, name: str) -> str:
    """A private copy of fixture profile ``name`` that a test may change."""
    root = str(tmp_path / name)
    shutil.copytree(profile_root(name), root, symlinks=True)
    return root


def write_file(root: str, rel: str, text: str) -> None:
    with open(os.path.join(root, rel), "w") as f:
        f.write(text)


@pytest.fixture(scope="session")
def apiserver(tmp_path_factory):
    """A real kube-apiserver v1.37.2 + etcd on 127.0.0.1 for the session (tests/controlplane.py).
    Fails (never skips) when the peers are not built: run tests/peers/build.sh."""
    from tests.controlplane import ControlPlane

    plane = ControlPlane(dir=str(tmp_path_factory.mktemp("controlplane"))).start()
    yield plane
    plane.stop()


@pytest.fixture(scope="session")
def older_apiserver(tmp_path_factory):
    """A kube-apiserver v1.37.2 like ``apiserver`` but with DRAListTypeAttributes at its 1.37
    default (off) and DRAConsumableCapacity off (its default before 1.36, and so
    DRAFractionalCapacityRange, which needs it): a cluster whose
    operator did not turn these on. Shared by the tests that need it (one more server is ~10 s)."""
    from tests.controlplane import FEATURE_GATES, ControlPlane

    off = {"DRAConsumableCapacity": False, "DRAFractionalCapacityRange": False}  # the latter needs the former
    gates = {**{k: v for k, v in FEATURE_GATES.items() if k != "DRAListTypeAttributes"}, **off}
    plane = ControlPlane(dir=str(tmp_path_factory.mktemp("older")), gates=gates).start()
    yield plane
    plane.stop()


@pytest.fixture(autouse=True)
def no_simulated_mps_daemon_left(tmp_path_factory):
    """The fixture nodes' simulated MPS control daemon (tests/fake_mps_control.py) runs for shared
    NVIDIA GPUs; a test that ends with claims prepared leaves one waiting on its socket: stopped
    here. Only this session's (its pipe dir below this session's temp dir): other test sessions
    on the machine have their own. So is a daemon's shm tmpfs (agent/prepare/mps.py mounts one
    below the test's plugin dir, in the host's mount namespace unless the test made its own)."""
    yield
    import psutil

    base = str(tmp_path_factory.getbasetemp()) + os.sep
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info.get("cmdline") or []
        if not (cmd and cmd[-1] == "-f" and any(a.endswith("nvidia-cuda-mps-control") for a in cmd)):
            continue
        try:
            if p.environ().get("CUDA_MPS_PIPE_DIRECTORY", "").startswith(base):
                p.kill()
        except psutil.Error:
            pass
    _unmount_mps_shm(base.rstrip(os.sep))


def _unmount_mps_shm(path: str) -> None:
    """The shm tmpfs of MPS daemons below ``path`` (``.../mps/<uuid>/shm``): no other mount."""
    import ctypes

    from agent.prepare.mps_records import MNT_DETACH, mounts_below

    libc = ctypes.CDLL(None, use_errno=True)
    for point in mounts_below(path):
        parts = point.split(os.sep)
        if parts[-1] == "shm" and parts[-3] == "mps":
            libc.umount2(point.encode(), MNT_DETACH)
