"""The driver's tools as the DaemonSet's agent runs them (agent/prepare/driverlinks.py): under
``/host`` the agent's image's loader runs them, and the driver's library directory on the host
holds the host's libc too. The loader path is links to the driver's libraries alone, so the
image's libc is the one loaded. Run for real: a fixture driver whose library directory holds a
"libc.so.6" that is no ELF file, and its MPS control binary (a script: /usr/bin/env and python3,
both linked against libc) run with the environment the agent gives it."""

from __future__ import annotations

import os
import shutil
import subprocess

from agent.prepare.nvidia import NvidiaDriver
from tests.conftest import profile_root

LIB_DIR = "usr/lib/x86_64-linux-gnu"


def host(tmp_path) -> str:
    root = str(tmp_path / "host")
    shutil.copytree(profile_root("server-2s-gpu-nic"), root, symlinks=True)
    with open(os.path.join(root, LIB_DIR, "libc.so.6"), "w") as f:
        f.write("the host's libc: another glibc than the image's\n")
    return root


def run_client(binary: str, env: dict[str, str], pipe: str) -> subprocess.CompletedProcess:
    return subprocess.run([binary], input="get_server_list\n", capture_output=True, text=True, timeout=30,
                          env={**os.environ, **env, "CUDA_MPS_PIPE_DIRECTORY": pipe})  # fmt: skip


def test_the_driver_tools_run_with_the_driver_libraries_alone(tmp_path):
    root = host(tmp_path)
    links = str(tmp_path / "plugin" / "nvidia-lib")
    nvidia = NvidiaDriver(root, lib_dir=links)
    binary, env = nvidia.tool("nvidia-cuda-mps-control")
    assert binary == os.path.join(root, "usr/bin/nvidia-cuda-mps-control")
    assert env["LD_LIBRARY_PATH"] == links and env["PATH"].startswith(os.path.join(root, "usr/bin") + ":")
    names = sorted(os.listdir(links))
    assert "libc.so.6" not in names and {"libcuda.so.1", "libnvidia-ml.so.1"} <= set(names)
    assert os.readlink(os.path.join(links, "libcuda.so.1")) == os.path.join(root, LIB_DIR, "libcuda.so.580.159.04")
    ran = run_client(binary, env, str(tmp_path))
    assert "Cannot find MPS control daemon" in ran.stderr, ran  # the tool ran: no daemon to answer here
    # the host's library directory itself on the loader path: the image's programs load its libc
    naive = run_client(binary, {**env, "LD_LIBRARY_PATH": os.path.join(root, LIB_DIR)}, str(tmp_path))
    assert naive.returncode != 0 and "libc.so.6" in naive.stderr, naive


def test_links_follow_the_driver_and_keep_to_file_names(tmp_path):
    from agent.prepare.driverlinks import link_libraries
    from discovery.nvidia_driver import Library

    links = str(tmp_path / "links")
    old = (Library("libcuda.so.570.1", "/usr/lib/libcuda.so.570.1", ("libcuda.so.1",)),)
    link_libraries(links, old, lambda p: "/host" + p)
    new = (Library("libcuda.so.580.2", "/usr/lib/libcuda.so.580.2", ("libcuda.so.1", "../escape", "")),)
    link_libraries(links, new, lambda p: "/host" + p)
    assert sorted(os.listdir(links)) == ["libcuda.so.1", "libcuda.so.580.2"]  # the old version's gone
    assert os.readlink(os.path.join(links, "libcuda.so.1")) == "/host/usr/lib/libcuda.so.580.2"
    assert not os.path.lexists(tmp_path / "escape")
    link_libraries(links, new, lambda p: None)  # the library not there: no link to it
    assert os.listdir(links) == []


def test_two_agents_linking_one_directory_at_once_never_fail(tmp_path):
    """Both agents of a rolling update keep the plugin dir's links: each of two processes
    relinking it again and again (a driver upgrade seen by one first) never fails on the
    other's half-made link."""
    import subprocess
    import sys

    from tests.conftest import REPO

    script = f"""
import sys
from agent.prepare.driverlinks import link_libraries
from discovery.nvidia_driver import Library
a = (Library("libcuda.so.580.1", "/usr/lib/libcuda.so.580.1", ("libcuda.so.1", "libcuda.so")),)
b = (Library("libcuda.so.580.2", "/usr/lib/libcuda.so.580.2", ("libcuda.so.1", "libcuda.so")),)
for i in range(300):
    link_libraries({str(tmp_path / "links")!r}, a if (i + int(sys.argv[1])) % 2 else b, lambda p: "/host" + p)
"""
    procs = [subprocess.Popen([sys.executable, "-c", script, str(n)], cwd=REPO, stderr=subprocess.PIPE, text=True)
             for n in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
