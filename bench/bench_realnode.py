"""The real node (tests/realnode.py, docs/real-node.md): sysdra against the floor, a minimal
plugin on the upstream Go helper (tests/realnode_floor.py), both registered on the same kubelet
and measured in one run (issues 37 and 43). Needs root and the peers (``make peers``).

Pods one at a time, interleaved ``plain`` (no claim) / ``sysdra`` / ``floor``, ``PODS`` of each
(``SYSDRA_BENCH_REALNODE_PODS``, default 30) after a warm-up pod of each kind, a fresh claim per
pod, each pod and claim deleted before the next (bench/realnode_cycle.py). Then an idle minute,
then the agent again with ``--claim-status false`` and ``PODS_OFF`` more pods of sysdra and the
floor (``SYSDRA_BENCH_REALNODE_PODS_OFF``, default 10).

Where each figure comes from: pod times from a watch (create -> phase Running, binding ->
Running); NodePrepareResources / NodeUnprepareResources from the kubelet's own log at ``--v=4``
(its "Calling ..." and "Done calling ..." lines); the driver's CPU from its threads' schedstat
between the pod's create and SETTLE after Running (or its claim's status write, if later); API requests from the API server's audit log
(the agent's and the floor's ServiceAccounts, watches left out); where the claim's status write
lands, from the audit log's receive time against the kubelet's prepare-done and sandbox-created
lines. Every figure's floor is the same figure of the floor plugin in the same run (the no-claim
pod for issue 37's start-time goal). The per-kind details go to bench/results/realnode.json.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

from bench.realnode_cycle import NAMESPACE, Runner
from bench.realnode_figures import details, figures
from bench.realnode_trace import Audit, KubeletLog, PodWatch, cpu_ns
from bench.report import REPO, progress, run_info

PODS = int(os.environ.get("SYSDRA_BENCH_REALNODE_PODS", "30"))
PODS_OFF = int(os.environ.get("SYSDRA_BENCH_REALNODE_PODS_OFF", "10"))
IDLE = float(os.environ.get("SYSDRA_BENCH_REALNODE_IDLE", "60"))  # s; issue 37 asks for a minute
AGENT = "system:serviceaccount:sysdra:sysdra"
FLOOR = "system:serviceaccount:sysdra:floor"
POLICY = f"""apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
- level: Metadata
  users: ["{AGENT}", "{FLOOR}"]
- level: None
"""
DETAILS = os.path.join(REPO, "bench", "results", "realnode.json")
WRITES = {"create", "update", "patch", "delete", "deletecollection"}


def _rounds(runner: Runner, kinds: list[str], n: int, out: dict[str, list], label: str) -> None:
    """``n`` rounds of one pod per kind, the order rotated each round (no kind always first
    after the previous pod's teardown)."""
    for i in range(n):
        order = kinds[i % len(kinds):] + kinds[: i % len(kinds)]
        for kind in order:
            out.setdefault(kind, []).append(runner.cycle(kind))
        out.setdefault("load", []).append(os.getloadavg()[0])  # the VM is shared: the figures move with it
        last = {k: f"{out[k][-1].create_to_running:.0f}" for k in kinds}
        progress(f"real node ({label}): round {i + 1}/{n}: create -> Running ms {last}")


def _start_floor(node, runner: Runner) -> None:
    """The floor gets the edits sysdra wrote for the warm-up pod's GPU (read while it runs)."""
    from tests import realnode_floor

    specs = []

    def copy_spec(claim: str) -> None:
        uid = node.plane.get("ResourceClaim", claim, NAMESPACE)["metadata"]["uid"]
        with open(os.path.join(node.cdi_dir, f"k8s.sysdra.io-claim_{uid}.json")) as f:
            specs.append(json.load(f))

    runner.cycle("sysdra", while_running=copy_spec)
    proc = realnode_floor.start(node, realnode_floor.device_file(specs[0]))
    runner.drivers["floor"] = (realnode_floor.DRIVER, proc.pid, FLOOR)


def _idle(node, audit: Audit) -> dict:
    audit.mark()
    pid = node.procs["agent"].pid
    cpu0 = cpu_ns(pid)
    progress(f"real node: idle for {IDLE:.0f} s")
    time.sleep(IDLE)
    requests = [r for r in audit.requests() if r.user == AGENT]
    return {"writes": sum(1 for r in requests if r.verb in WRITES), "requests": len(requests),
            "kinds": sorted(r.kind for r in requests), "cpu_ms": (cpu_ns(pid) - cpu0) / 1e6}  # fmt: skip


def _measure(node, audit_log: str) -> dict:
    plane = node.plane
    plane.create_namespace(NAMESPACE)
    plane.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": NAMESPACE}})
    watch = PodWatch(plane, NAMESPACE).start()
    audit = Audit(audit_log)
    runner = Runner(node, watch, audit, KubeletLog(os.path.join(node.dir, "kubelet.log")),
                    {"sysdra": ("sysdra.io", node.procs["agent"].pid, AGENT)})  # fmt: skip
    try:
        _start_floor(node, runner)
        for kind in ("plain", "floor"):
            runner.cycle(kind)
        on: dict[str, list] = {}
        _rounds(runner, ["plain", "sysdra", "floor"], PODS, on, "claim status on")
        idle = _idle(node, audit)
        node.stop_process("agent")
        node.start_agent("--claim-status", "false")
        runner.status_writers.discard("sysdra")
        runner.drivers["sysdra"] = ("sysdra.io", node.procs["agent"].pid, AGENT)
        runner.cycle("sysdra")
        off: dict[str, list] = {}
        _rounds(runner, ["sysdra", "floor"], PODS_OFF, off, "claim status off")
    finally:
        watch.stop()
    return {"on": on, "off": off, "idle": idle}


def run() -> list:
    if os.geteuid() != 0:
        progress("bench_realnode: needs root (the real node): not measured")
        return []
    from tests.realnode import RealNode

    tmp = tempfile.mkdtemp(prefix="sysdra-bench-realnode-")
    policy = os.path.join(tmp, "audit-policy.yaml")
    with open(policy, "w") as f:
        f.write(POLICY)
    log = os.path.join(tmp, "audit.log")
    node = RealNode(os.path.join(tmp, "node"), kubelet_verbosity=4,
                    apiserver_args=[f"--audit-policy-file={policy}", f"--audit-log-path={log}"])  # fmt: skip
    try:
        node.start()
        m = _measure(node, log)
    finally:
        node.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    info = {**run_info(), "pods": PODS, "pods_off": PODS_OFF}
    os.makedirs(os.path.dirname(DETAILS), exist_ok=True)
    with open(DETAILS, "w") as f:
        json.dump({"run": info, **details(m)}, f, indent=2)
        f.write("\n")
    return figures(m)
