"""Full scan of a generated large node vs (a) the same file operations replayed in a tight
loop and (b) ``lspci -vmm`` on the same tree; peak RSS of a scan in a fresh process.

The budget: a scan costs at most 2.5 times its replayed file operations (what Python adds
above the system calls: parsing, checks, records and attributes)."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time

from bench.report import Figure, progress

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_large_node(dest: str) -> int:
    sys.path.insert(0, os.path.join(REPO, "fixtures"))
    from generate import build_tree, large_node_spec  # noqa: E402

    build_tree(large_node_spec(), dest)
    return len(os.listdir(os.path.join(dest, "sys/bus/pci/devices")))


def record_operations(root: str) -> list[tuple[str, str]]:
    """Run one scan with the file operations it makes recorded: (op, path) (the tracer
    ``sysdra record`` uses too)."""
    from agent.tools.fstrace import traced_scan

    return traced_scan(root)[1]


def minimal_reader(plan: list[tuple[str, str]]) -> None:
    """The floor: the same operations (``fstrace.replay_plan``) in a tight loop, no parsing,
    no models."""
    from agent.tools.fstrace import replay

    replay(plan)


def _cpu(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def _interleaved(fns, repeat: int) -> list[float]:
    """Median CPU time (user + system) of each of ``fns`` in this process, run in turn
    (a b c a b c ...): on a shared machine wall time also counts waiting for a CPU, which
    neither the scan nor its floor controls, and the machine's speed drifts."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, spent in zip(fns, times):
            spent.append(_cpu(fn))
    return [statistics.median(spent) for spent in times]


def _child_cpu(cmd: list[str], repeat: int) -> float:
    """Median CPU time (user + system, from wait4) of a command."""
    times = []
    for _ in range(repeat):
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _, _, usage = os.wait4(proc.pid, 0)
        proc.returncode = 0
        times.append(usage.ru_utime + usage.ru_stime)
    return statistics.median(times)


_HWM = (
    "import sys\n"
    "def hwm():\n"
    "    for line in open('/proc/self/status'):\n"
    "        if line.startswith('VmHWM:'):\n"
    "            return int(line.split()[1]) / 1024\n"
)


def _child_hwm_mb(body: str, *args: str) -> float:
    """Peak RSS of a fresh interpreter running ``body`` (VmHWM resets at exec; ru_maxrss does not)."""
    code = _HWM + body + "\nprint(hwm())"
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def peak_rss_mb(root: str) -> float:
    return _child_hwm_mb("from discovery.inventory import scan\nscan(sys.argv[1])", root)


def floor_rss_mb() -> float:
    """An interpreter that imports discovery but scans nothing."""
    return _child_hwm_mb("import discovery.inventory")


def run(repeat: int = 7) -> list[Figure]:
    from discovery.inventory import scan

    from agent.tools.fstrace import replay_plan

    from bench.agentproc import large_node

    progress("generating the large node (shared by all benchmarks of this run)")
    tmp = large_node()
    if True:  # the node is removed at exit (bench.agentproc)
        n = len(os.listdir(os.path.join(tmp, "sys/bus/pci/devices")))
        progress(f"{n} PCI functions; recording the scan's file operations")
        ops = record_operations(tmp)
        progress(f"{len(ops)} operations; timing scan, replayed operations, lspci ({repeat} runs each)")
        scan(tmp)  # warm the dentry cache for everybody
        plan = replay_plan(ops)
        t_scan, t_min = _interleaved((lambda: scan(tmp), lambda: minimal_reader(plan)), repeat)
        figures = [Figure("scan", t_scan * 1000, "ms", t_min * 1000, "ratio <= 2.5", t_scan <= 2.5 * t_min)]
        lspci = shutil.which("lspci")
        if lspci:
            cmd = [lspci, "-vmm", "-D", "-nn", "-A", "linux-sysfs", "-O", f"sysfs.path={tmp}/sys/bus/pci"]
            t_lspci = _child_cpu(cmd, repeat)
            figures.append(Figure("scan_vs_lspci", t_scan * 1000, "ms", t_lspci * 1000, "informative", True))
        progress("peak RSS of a scan in a fresh process")
        rss = peak_rss_mb(tmp)
        figures.append(Figure("scan_rss", rss, "MB", floor_rss_mb(), "value <= 100 MB", rss <= 100))
        figures.append(Figure("scan_functions", n, "count", None, ">= 2000", n >= 2000))
        return figures
