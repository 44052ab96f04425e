"""Shared by the benchmarks: the generated large node (built once per run) and a real
``sysdra run`` process on it in offline mode, as the kubelet and an operator see it."""

from __future__ import annotations

import atexit
import glob
import os
import shutil
import site
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODE = "bench-node"
DRIVER = "sysdra.io"
_LARGE: str | None = None
_PYCACHE: str | None = None
_INSTALL: "Install | None" = None
PACKAGES = ("agent", "discovery", "cdi")  # pyproject.toml's [tool.setuptools.packages.find]


def large_node() -> str:
    """Path of a generated large node (2,000+ PCI functions), built once, removed at exit.
    Callers must not modify it (bench_publish copies it)."""
    global _LARGE
    if _LARGE is None:
        from bench.bench_scan import build_large_node

        tmp = tempfile.mkdtemp(prefix="sysdra-bench-node-")
        atexit.register(shutil.rmtree, tmp, True)
        build_large_node(tmp)
        _LARGE = tmp
    return _LARGE


def installed_env() -> dict:
    """The environment of an installed ``sysdra``: bytecode cached (in a temp
    ``PYTHONPYCACHEPREFIX`` shared by the run, so the tree gets no ``__pycache__``; pip
    compiles an installed package the same way), stdout buffered, no ``SYSDRA_*`` settings."""
    global _PYCACHE
    if _PYCACHE is None:
        _PYCACHE = tempfile.mkdtemp(prefix="sysdra-bench-pyc-")
        atexit.register(shutil.rmtree, _PYCACHE, True)
    drop = ("PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "NOTIFY_SOCKET", "WATCHDOG_USEC")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYSDRA_") and k not in drop}
    env["PYTHONPYCACHEPREFIX"] = _PYCACHE
    env["SYSDRA_CONFIG"] = os.devnull
    return env


class Install:
    """``sysdra`` installed as pip installs its wheel, for the processes the benchmarks time:
    ``python`` of a venv whose site-packages holds the packages, and ``cwd``, a directory
    without them (``python -m`` and ``-c`` put the working directory first on sys.path).

    The development tree's editable install is not what an operator runs: its import hook
    loads pathlib and answers every import, ~13 ms of each start (``python -c pass`` 22 ms
    against 10 ms here, measured). The dependencies are this interpreter's, named in a .pth
    file (a path line only; the .pth files in that directory, the hook's, are not run)."""

    def __init__(self, base: str) -> None:
        venv = os.path.join(base, "venv")
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
        self.python = os.path.join(venv, "bin", "python")
        purelib = subprocess.run([self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip()
        with open(os.path.join(purelib, "sysdra-deps.pth"), "w") as f:
            f.write("".join(p + "\n" for p in site.getsitepackages()))
        for pkg in PACKAGES:
            shutil.copytree(os.path.join(REPO, pkg), os.path.join(purelib, pkg),
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        self.cwd = base


def installed() -> Install:
    """The run's :class:`Install`, made on first use (a second), removed at exit."""
    global _INSTALL
    if _INSTALL is None:
        base = tempfile.mkdtemp(prefix="sysdra-bench-install-")
        atexit.register(shutil.rmtree, base, True)
        _INSTALL = Install(base)
    return _INSTALL


def tmpfs_dir(prefix: str) -> str:
    """A directory on tmpfs when the machine has one (/dev/shm), like /run/cdi in production."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix=prefix, dir=base)


class AgentProcess:
    """``sysdra run --root <large node> --cluster dir:...`` with its own kubelet, CDI and cluster dirs."""

    def __init__(self, root: str, work: str, cdi_dir: str, *extra: str):
        self.root, self.work, self.cdi_dir = root, work, cdi_dir
        self.cluster = os.path.join(work, "cluster")
        self.kubelet_dir = os.path.join(work, "kubelet")
        self.log_path = os.path.join(work, "agent.log")
        self.cmd = [installed().python, "-m", "agent", "run", "--root", root, "--node-name", NODE,
                    "--cluster", f"dir:{self.cluster}", "--kubelet-dir", self.kubelet_dir, "--cdi-dir", cdi_dir,
                    "--metrics-address", "", "--log-level", "warning", *extra]
        self.proc: subprocess.Popen | None = None

    @property
    def registry_dir(self) -> str:
        return os.path.join(self.kubelet_dir, "plugins_registry")

    def launch(self) -> "AgentProcess":
        """Start the process and return at once."""
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, cwd=installed().cwd, env=installed_env(), stdout=self._log, stderr=self._log)
        return self

    def start(self, timeout: float = 60.0) -> "AgentProcess":
        """Start and wait until the agent has published and registered."""
        self.launch()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited ({self.proc.returncode}): {open(self.log_path).read()[-2000:]}")
            if glob.glob(os.path.join(self.cluster, "resourceslices", "*.json")) and glob.glob(
                    os.path.join(self.registry_dir, "*.sock")):
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("agent did not publish and register in time")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if getattr(self, "_log", None):
            self._log.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
