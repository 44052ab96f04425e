"""Whole processes, as an operator waits for them, on the generated large node.

``sysdra scan -o json`` and ``sysdra scan`` (the table) are run as fresh processes, in turn
with ``lspci -A linux-sysfs -vmm`` on the same tree and with a minimal Python reader of the
same sysfs files (``bench/minreader.py``), each once per round after one warm-up round, so
every ratio compares runs made side by side. The budget: ``sysdra scan -o json`` takes at
most 0.5 s of CPU. Each figure is the median CPU time (user +
system, from ``wait4``) of the process: all of these commands are single-threaded, so on an
idle machine it equals the wall time, and on a shared one it leaves out the time spent
waiting for a CPU (the wall times are in the progress output).

The Python processes run as an installed ``sysdra`` does: from a wheel-like install without
the development tree's editable-install hook (``agentproc.Install``), bytecode cached (the
warm-up round fills the cache) and stdout buffered (``agentproc.installed_env``).

``first_publish``: a real ``sysdra run`` in offline mode on the same node, from ``exec`` to
the first ResourceSlice file on disk, wall time (median of 3 starts). Floor: the CPU time of
``sysdra scan -o json`` (the agent has to scan before it can publish)."""

from __future__ import annotations

import glob
import os
import shutil
import statistics
import subprocess
import tempfile
import time

from bench.agentproc import REPO, AgentProcess, installed, installed_env, large_node, tmpfs_dir
from bench.report import Figure, progress

ROUNDS = 7


def _timed(cmd: list[str], env: dict) -> tuple[float, float]:
    """(wall s, user + system CPU s) of one run, output discarded."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=installed().cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} exited {proc.returncode}")
    return wall, usage.ru_utime + usage.ru_stime


def commands(root: str) -> dict[str, list[str]]:
    py = installed().python
    cmds = {
        "scan_json": [py, "-m", "agent", "scan", "--root", root, "-o", "json"],
        "scan_table": [py, "-m", "agent", "scan", "--root", root],
        "reader": [py, os.path.join(REPO, "bench", "minreader.py"), root],
        "python": [py, "-c", "pass"],
    }
    lspci = shutil.which("lspci")
    if lspci:
        cmds["lspci"] = [lspci, "-A", "linux-sysfs", "-vmm", "-O", f"sysfs.path={root}/sys/bus/pci"]
    return cmds


def measure(root: str, rounds: int = ROUNDS) -> dict[str, tuple[float, float]]:
    """name -> (median wall s, median CPU s), the commands interleaved round by round."""
    env = installed_env()
    cmds = commands(root)
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in cmds}
    for i in range(rounds + 1):
        for name, cmd in cmds.items():
            got = _timed(cmd, env)
            if i:  # round 0 warms the page cache and writes the bytecode cache
                times[name].append(got)
    return {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}


def first_publish(root: str, starts: int = 3) -> float:
    """Seconds from exec of ``sysdra run`` to its first slice file (median of ``starts``)."""
    out = []
    for _ in range(starts):
        work = tempfile.mkdtemp(prefix="sysdra-bench-start-")
        cdi = tmpfs_dir("sysdra-bench-cdi-")
        agent = AgentProcess(root, work, cdi)
        slices = os.path.join(agent.cluster, "resourceslices", "*.json")
        try:
            t0 = time.perf_counter()
            agent.launch()
            while not glob.glob(slices):
                if agent.proc.poll() is not None or time.perf_counter() - t0 > 60:
                    raise RuntimeError(f"agent did not publish: {open(agent.log_path).read()[-2000:]}")
                time.sleep(0.005)
            out.append(time.perf_counter() - t0)
        finally:
            agent.stop()
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(cdi, ignore_errors=True)
    return statistics.median(out)


def run(rounds: int = ROUNDS) -> list[Figure]:
    root = large_node()
    progress(f"whole processes: sysdra scan -o json, sysdra scan, lspci, minimal reader ({rounds} rounds, interleaved)")
    t = measure(root, rounds)
    for name, (wall, cpu) in t.items():
        progress(f"  {name:<10} wall {wall * 1000:7.1f} ms  cpu {cpu * 1000:7.1f} ms")
    ms = {k: c * 1000 for k, (_, c) in t.items()}
    figures = [Figure("cli_scan_json", ms["scan_json"], "ms", None, "value < 500 ms of CPU", ms["scan_json"] < 500)]
    if "lspci" in ms:
        figures += [
            Figure("cli_scan_json_vs_lspci", ms["scan_json"], "ms", ms["lspci"], "informative", True),
            Figure("cli_scan_table_vs_lspci", ms["scan_table"], "ms", ms["lspci"], "informative", True),
        ]
    figures += [
        Figure("cli_scan_json_vs_reader", ms["scan_json"], "ms", ms["reader"], "informative", True),
        Figure("cli_scan_table_vs_reader", ms["scan_table"], "ms", ms["reader"], "informative", True),
        Figure("cli_python_startup", ms["python"], "ms", None, "informative", True),
    ]
    progress("first publish after start: sysdra run, exec -> first slice file (3 starts)")
    fp = first_publish(root) * 1000
    figures.append(Figure("first_publish", fp, "ms", ms["scan_json"], "value < 500 ms", fp < 500))
    return figures
