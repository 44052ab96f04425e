"""What the real node's own logs say about one pod (bench/bench_realnode.py): the kubelet's
NodePrepareResources / NodeUnprepareResources calls and its sandbox creation (``--v=4``), the
API server's audit events, and the pod's phases as a watch sees them. All times are the host's
wall clock (``time.time()``), so the three line up.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field

import httpx2

# klog's header: I1205 05:30:00.123456   4711 file.go:97] "message" key=value ...
_KLOG = re.compile(r'^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6})\s+\d+ \S+\] "([^"]*)"(.*)$')
_VALUE = r'{}="((?:[^"\\]|\\.)*)"'
_MESSAGES = {
    "Calling NodePrepareResources rpc": ("prepare", "start"),
    "Done calling NodePrepareResources rpc": ("prepare", "done"),
    "Calling NodeUnprepareResource rpc": ("unprepare", "start"),  # sic: the kubelet's own spelling
    "Done calling NodeUnprepareResources rpc": ("unprepare", "done"),
    "Creating PodSandbox for pod": ("sandbox", "start"),
    "Created PodSandbox for pod": ("sandbox", "done"),
}


def klog_time(month: int, day: int, hms: tuple[int, int, int], micros: int) -> float:
    """A klog header's local time as epoch seconds (the year is not in the header: this one's,
    or last year's for a December line read in January)."""
    now = datetime.datetime.now()
    year = now.year - 1 if month > now.month else now.year
    return datetime.datetime(year, month, day, *hms, micros).timestamp()


def _value(rest: str, key: str) -> str:
    m = re.search(_VALUE.format(key), rest)
    return m.group(1) if m else ""


@dataclass
class Call:
    """One call the kubelet logged: ``what`` prepare / unprepare (``driver``, ``claim``) or
    sandbox (``pod``); ``start`` and ``done`` in epoch seconds."""

    what: str
    start: float
    done: float | None = None
    driver: str = ""
    claim: str = ""
    pod: str = ""

    @property
    def ms(self) -> float | None:
        return None if self.done is None else (self.done - self.start) * 1000


class KubeletLog:
    """The kubelet's log from a mark on: its DRA calls (a call's start and done pair up by
    driver, the kubelet sends one at a time per driver) and its sandbox creations (by pod)."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0

    def mark(self) -> None:
        self.offset = os.path.getsize(self.path)

    def calls(self) -> list[Call]:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            lines = f.read().decode(errors="replace").splitlines()
        calls: list[Call] = []
        open_: dict[tuple[str, str], Call] = {}
        for line in lines:
            m = _KLOG.match(line)
            if not m or m.group(7) not in _MESSAGES:
                continue
            what, edge = _MESSAGES[m.group(7)]
            t = klog_time(int(m.group(1)), int(m.group(2)), (int(m.group(3)), int(m.group(4)), int(m.group(5))), int(m.group(6)))
            rest = m.group(8)
            key = (what, _value(rest, "driverName") if what != "sandbox" else _value(rest, "pod"))
            if edge == "start":
                claim = re.search(r'name:\\"([^\\]+)\\"', _value(rest, "request"))
                open_[key] = call = Call(what, t, driver=_value(rest, "driverName"), claim=claim.group(1) if claim else "",
                                         pod=_value(rest, "pod"))  # fmt: skip
                calls.append(call)
            elif key in open_:
                open_.pop(key).done = t
        return calls


def _stamp(text: str) -> float:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@dataclass
class Request:
    """One API request from the audit log (one per auditID, its final stage)."""

    user: str
    user_agent: str
    verb: str
    resource: str
    subresource: str
    name: str
    received: float
    done: float

    @property
    def kind(self) -> str:
        """``verb resource[/subresource]``, the breakdown the bench reports."""
        return f"{self.verb} {self.resource}" + (f"/{self.subresource}" if self.subresource else "")


class Audit:
    """The audit log's events (policy: the agent's and the floor's ServiceAccounts, Metadata
    level) from a mark on."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0

    def mark(self) -> int:
        self.offset = os.path.getsize(self.path) if os.path.exists(self.path) else 0
        return self.offset

    def requests(self, since: int | None = None, until: int | None = None) -> list[Request]:
        """Requests logged between two offsets (default: the mark and now), watches left out
        (they are long-running: an informer's, not a pod's)."""
        seen: dict[str, Request] = {}
        with open(self.path, "rb") as f:
            f.seek(self.offset if since is None else since)
            data = f.read() if until is None else f.read(max(0, until - f.tell()))
        for line in data.splitlines():
            e = json.loads(line)
            ref = e.get("objectRef") or {}
            if e["verb"] == "watch":
                continue
            seen[e["auditID"]] = Request(e["user"]["username"], e.get("userAgent", ""), e["verb"], ref.get("resource", ""),
                                         ref.get("subresource", ""), ref.get("name", ""),
                                         _stamp(e["requestReceivedTimestamp"]), _stamp(e["stageTimestamp"]))  # fmt: skip
        return sorted(seen.values(), key=lambda r: r.received)


def cpu_ns(pid: int) -> int:
    """CPU time of a process and its descendants, every thread, in ns (the scheduler's
    ``/proc/<pid>/task/<tid>/schedstat``: psutil's cpu_times count in 10 ms ticks, longer than
    a prepare)."""
    import psutil

    total = 0
    try:
        pids = [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return 0
    for p in pids:
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{p}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return total


@dataclass
class PodTimes:
    scheduled: float | None = None  # the first event with spec.nodeName
    running: float | None = None  # the first event with phase Running
    gone: float | None = None  # its DELETED event


@dataclass
class PodWatch:
    """A watch on the bench's namespace, in a thread: when each pod was bound and Running."""

    plane: object
    namespace: str
    pods: dict[str, PodTimes] = field(default_factory=dict)
    changed: threading.Condition = field(default_factory=threading.Condition)
    _stop: bool = False

    def start(self) -> "PodWatch":
        rv = self.plane.request("GET", f"/api/v1/namespaces/{self.namespace}/pods").json()["metadata"]["resourceVersion"]
        self._client = httpx2.Client(base_url=self.plane.url, verify=self.plane.tls(self.plane.admin_cert), timeout=None)
        self._thread = threading.Thread(target=self._run, args=(rv,), daemon=True, name="bench-pod-watch")
        self._thread.start()
        return self

    def _run(self, rv: str) -> None:
        params = {"watch": "1", "resourceVersion": rv, "allowWatchBookmarks": "false"}
        try:
            with self._client.stream("GET", f"/api/v1/namespaces/{self.namespace}/pods", params=params) as r:
                for line in r.iter_lines():
                    now = time.time()
                    if line.strip():
                        self._event(json.loads(line), now)
        except httpx2.HTTPError:
            if not self._stop:  # stop() closes the stream under the thread; anything else ends wait()s
                raise
        finally:
            with self.changed:
                self.changed.notify_all()

    def _event(self, event: dict, now: float) -> None:
        pod = event["object"]
        with self.changed:
            times = self.pods.setdefault(pod["metadata"]["name"], PodTimes())
            if event["type"] == "DELETED":
                times.gone = times.gone or now
            if pod["spec"].get("nodeName") and times.scheduled is None:
                times.scheduled = now
            if (pod.get("status") or {}).get("phase") == "Running" and times.running is None:
                times.running = now
            self.changed.notify_all()

    def wait(self, name: str, probe, timeout: float = 60.0) -> PodTimes:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not probe(self.pods.get(name, PodTimes())):
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    raise RuntimeError(f"bench_realnode: pod {name}: timed out (or the watch ended)")
                self.changed.wait(left)
            return self.pods[name]

    def stop(self) -> None:
        self._stop = True
        self._client.close()
