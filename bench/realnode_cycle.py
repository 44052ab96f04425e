"""One pod's cycle on the real node (bench/bench_realnode.py): a fresh claim (or none), the pod
created and Running, a pause for the status writer, the pod deleted and unprepared, the claim
deleted; what the kubelet, the API server and the driver's process did meanwhile.

Kinds: ``plain`` (no claim), ``sysdra`` (DeviceClass gpu.sysdra.io) and ``floor`` (the upstream
helper's plugin, tests/realnode_floor.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from bench.realnode_trace import Audit, Call, KubeletLog, PodWatch, Request, cpu_ns

NAMESPACE = "bench"
SETTLE = 0.5  # s after Running (and after the status write, where the driver writes one) and after the unprepare
CLASSES = {"sysdra": "gpu.sysdra.io", "floor": "gpu.floor.sysdra.test"}


@dataclass
class Cycle:
    """What one pod cycle measured; times in ms, ``None`` where the kind has no such thing."""

    kind: str
    create_to_running: float
    scheduled_to_running: float
    claim: str | None = None
    prepare: float | None = None  # NodePrepareResources as the kubelet logs it
    unprepare: float | None = None
    prepare_to_sandbox: float | None = None  # prepare done -> sandbox created (the kubelet's log)
    status_write: float | None = None  # the claim's status write received, ms after prepare done
    status_in_sandbox: bool | None = None  # ... and before the sandbox was created
    cpu_ms: float | None = None  # the driver's process, create -> Running + SETTLE (or its status write + 0.1 s)
    prepare_requests: list[Request] = field(default_factory=list)  # the driver's, in the same window
    unprepare_requests: list[Request] = field(default_factory=list)  # pod delete -> unprepared + SETTLE, claim delete

    @property
    def requests(self) -> int:
        return len(self.prepare_requests) + len(self.unprepare_requests)


def pod(node, name: str, claim: str | None) -> dict:
    container = {"name": "app", "image": node.image, "imagePullPolicy": "Never", "command": ["sleep", "3600"]}
    spec = {"automountServiceAccountToken": False, "hostNetwork": True, "terminationGracePeriodSeconds": 0, "containers": [container]}
    if claim:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
        container["resources"] = {"claims": [{"name": "gpu"}]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE}, "spec": spec}


def _until(probe, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench_realnode: timed out waiting for {what}")
        time.sleep(0.02)


def _gone(node, kind: str, name: str) -> bool:
    path = f"/api/v1/namespaces/{NAMESPACE}/pods/{name}" if kind == "Pod" else \
        f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims/{name}"  # fmt: skip
    return node.plane.request("GET", path, ok=False).status_code == 404


class Runner:
    """Runs cycles on a started node: ``drivers`` maps a kind to (driver name, its process's pid,
    its ServiceAccount's user name)."""

    def __init__(self, node, watch: PodWatch, audit: Audit, kubelet: KubeletLog, drivers: dict[str, tuple[str, int, str]]):
        self.node, self.watch, self.audit, self.kubelet, self.drivers = node, watch, audit, kubelet, drivers
        self.count = 0
        self.status_writers = {"sysdra"}  # kinds whose driver writes the claim's status (the agent, unless --claim-status false)

    def cycle(self, kind: str, while_running=None) -> Cycle:
        """One pod of ``kind``; ``while_running(claim)`` is called while it runs (after SETTLE)."""
        self.count += 1
        name = f"{kind}-{self.count}"
        plane = self.node.plane
        claim = name if kind in CLASSES else None
        if claim:
            request = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": CLASSES[kind]}}]}}
            plane.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                          "metadata": {"name": claim, "namespace": NAMESPACE}, "spec": request})  # fmt: skip
        driver, pid, user = self.drivers.get(kind, ("", 0, ""))
        self.kubelet.mark()
        start_audit = self.audit.mark()
        cpu0 = cpu_ns(pid) if pid else 0
        created = time.time()
        plane.create(pod(self.node, name, claim))
        times = self.watch.wait(name, lambda t: t.running is not None)
        time.sleep(SETTLE)
        if claim and kind in self.status_writers:  # however long the writer defers it, the write is the prepare's
            deadline = time.monotonic() + 10  # none by then: the figures count none
            while not self._status_written(claim, user, start_audit) and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.1)  # the writer's work after the response
        cpu = (cpu_ns(pid) - cpu0) / 1e6 if pid else None
        mid_audit = self.audit.mark()
        if while_running:
            while_running(claim)
        plane.delete("Pod", name, NAMESPACE)
        self.watch.wait(name, lambda t: t.gone is not None)
        if claim:
            _until(lambda: any(c.what == "unprepare" and c.claim == claim and c.done for c in self.kubelet.calls()),
                   f"the kubelet's unprepare of {claim}")  # fmt: skip
            time.sleep(SETTLE)
            plane.delete("ResourceClaim", claim, NAMESPACE)
            _until(lambda: _gone(self.node, "ResourceClaim", claim), f"claim {claim} deleted")
        out = Cycle(kind, (times.running - created) * 1000, (times.running - times.scheduled) * 1000, claim, cpu_ms=cpu)
        if claim:
            self._trace(out, name, claim, driver, user, (start_audit, mid_audit))
        return out

    def _status_written(self, claim: str, user: str, since: int) -> bool:
        return any(r.user == user and r.resource == "resourceclaims" and r.subresource == "status" and r.name == claim
                   for r in self.audit.requests(since=since))  # fmt: skip

    def _trace(self, out: Cycle, name: str, claim: str, driver: str, user: str, marks: tuple[int, int]) -> None:
        calls = self.kubelet.calls()
        prepare = _one(calls, "prepare", driver, claim)
        unprepare = _one(calls, "unprepare", driver, claim)
        sandbox = next((c for c in calls if c.what == "sandbox" and c.pod == f"{NAMESPACE}/{name}" and c.done), None)
        out.prepare, out.unprepare = prepare.ms, unprepare.ms
        if sandbox:
            out.prepare_to_sandbox = (sandbox.done - prepare.done) * 1000
        out.prepare_requests = [r for r in self.audit.requests(since=marks[0], until=marks[1]) if r.user == user]
        out.unprepare_requests = [r for r in self.audit.requests(since=marks[1]) if r.user == user]
        status = [r for r in out.prepare_requests if r.resource == "resourceclaims" and r.subresource == "status" and r.name == claim]
        if status:
            out.status_write = (status[0].received - prepare.done) * 1000
            out.status_in_sandbox = sandbox is not None and status[0].received < sandbox.done


def _one(calls: list[Call], what: str, driver: str, claim: str) -> Call:
    found = [c for c in calls if c.what == what and c.driver == driver and c.claim == claim and c.done]
    if len(found) != 1:
        raise RuntimeError(f"bench_realnode: {len(found)} {what} calls of {driver} for {claim} in the kubelet's log")
    return found[0]
