"""The real-node bench's figures (docs/performance.md's table) and details (bench/results/realnode.json)
from the cycles bench/bench_realnode.py measured. Goals: issue 37's (a claim adds <= 100 ms to
pod start at p50; one claim GET and at most one status write per prepare; no writes at idle)
and issue 43's, as ratios to the floor plugin in the same run."""

from __future__ import annotations

import statistics
from collections import Counter

from bench.realnode_cycle import Cycle
from bench.report import Figure

TIMES = ("create_to_running", "scheduled_to_running", "prepare", "unprepare", "prepare_to_sandbox", "status_write", "cpu_ms")


def _values(cycles: list[Cycle], attr: str) -> list[float]:
    return [v for c in cycles if (v := getattr(c, attr)) is not None]


def _p(values: list[float], q: int) -> float | None:
    if not values:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def _mean(values: list[float]) -> float | None:
    return statistics.mean(values) if values else None


def _claim_requests(c: Cycle, verb: str, subresource: str = "") -> int:
    return sum(1 for r in c.prepare_requests if r.resource == "resourceclaims" and r.verb == verb and r.subresource == subresource)


def _kind_details(cycles: list[Cycle]) -> dict:
    out: dict = {"n": len(cycles)}
    for attr in TIMES:
        v = _values(cycles, attr)
        if v:
            out[attr] = {"p50": _p(v, 50), "p95": _p(v, 95), "mean": _mean(v), "min": min(v), "max": max(v)}
    if any(c.kind != "plain" for c in cycles):
        n = len(cycles) or 1
        out["requests_per_cycle"] = {"mean": _mean([c.requests for c in cycles]), "max": max(c.requests for c in cycles)}
        for window in ("prepare_requests", "unprepare_requests"):
            seen = Counter(r.kind for c in cycles for r in getattr(c, window))
            out[window] = {k: v / n for k, v in sorted(seen.items())}
        # requests about anything but the cycle's own claim (another pod's late request would land here)
        out["requests_about_other_objects"] = sum(1 for c in cycles for r in c.prepare_requests + c.unprepare_requests
                                                  if r.name != c.claim) / n  # fmt: skip
        out["user_agents"] = sorted({r.user_agent for c in cycles for r in c.prepare_requests + c.unprepare_requests})
        landed = [c.status_in_sandbox for c in cycles if c.status_in_sandbox is not None]
        if landed:
            out["status_write_in_sandbox_creation"] = sum(landed) / len(landed)
    return out


def _phase(cycles: dict[str, list]) -> dict:
    out = {k: _kind_details(v) for k, v in cycles.items() if k != "load"}
    load = cycles.get("load") or [0.0]
    out["load_1min"] = {"min": min(load), "mean": _mean(load), "max": max(load)}  # sampled after each round
    return out


def details(m: dict) -> dict:
    return {"claim_status_on": _phase(m["on"]), "claim_status_off": _phase(m["off"]), "idle_minute": m["idle"]}


def _ratio_goal(name: str, value: float | None, floor: float | None, unit: str, limit: float | None) -> Figure:
    """``limit``: the goal value / floor <= limit; None: reported."""
    value = float("nan") if value is None else value
    if limit is None:
        return Figure(name, value, unit, floor, "reported", True)
    return Figure(name, value, unit, floor, f"ratio <= {limit:g}", bool(floor) and value / floor <= limit)


def figures(m: dict) -> list[Figure]:
    on, off, idle = m["on"], m["off"], m["idle"]
    plain, sysdra, floor = on["plain"], on["sysdra"], on["floor"]
    start = {k: _values(on[k], "create_to_running") for k in ("plain", "sysdra", "floor")}
    p50 = {k: _p(v, 50) for k, v in start.items()}
    cost, floor_cost = p50["sysdra"] - p50["plain"], p50["floor"] - p50["plain"]
    sandbox, floor_sandbox = _p(_values(sysdra, "prepare_to_sandbox"), 50), _p(_values(floor, "prepare_to_sandbox"), 50)
    requests = [c.requests for c in sysdra]
    requests_off = [c.requests for c in off["sysdra"]]
    unprepare = [len(c.unprepare_requests) for c in sysdra + off["sysdra"]]
    landed = [c.status_in_sandbox for c in sysdra if c.status_in_sandbox is not None]
    gets = [_claim_requests(c, "get") for c in sysdra]
    writes = [_claim_requests(c, "patch", "status") + _claim_requests(c, "update", "status") for c in sysdra]
    return [
        # issue 37: against the pod without a claim
        Figure("realnode_pod_start_claim_p50", p50["sysdra"], "ms", p50["plain"], "claim adds <= 100 ms", cost <= 100),
        Figure("realnode_pod_start_claim_p95", _p(start["sysdra"], 95), "ms", _p(start["plain"], 95), "reported", True),
        Figure("realnode_pod_start_floor_p50", p50["floor"], "ms", p50["plain"], "reported", True),
        Figure("realnode_prepare_claim_gets", _mean(gets), "per prepare", _mean([_claim_requests(c, "get") for c in floor]), "1",
               max(gets) <= 1),
        Figure("realnode_prepare_status_writes", _mean(writes), "per prepare", None, "<= 1", max(writes) <= 1),
        Figure("realnode_idle_writes", idle["writes"], "per minute", None, "0", idle["writes"] == 0),
        Figure("realnode_idle_requests", idle["requests"], "per minute", None, "reported", True),
        Figure("realnode_agent_idle_cpu", idle["cpu_ms"], "ms per minute", None, "reported", True),
        # issue 43: against the floor plugin
        Figure("realnode_claim_cost_p50", cost, "ms", floor_cost, "<= floor + 5 ms", cost <= floor_cost + 5),
        _ratio_goal("realnode_scheduled_to_running_p50", _p(_values(sysdra, "scheduled_to_running"), 50),
                    _p(_values(floor, "scheduled_to_running"), 50), "ms", None),
        _ratio_goal("realnode_scheduled_to_running_p95", _p(_values(sysdra, "scheduled_to_running"), 95),
                    _p(_values(floor, "scheduled_to_running"), 95), "ms", None),
        _ratio_goal("realnode_node_prepare_p50", _p(_values(sysdra, "prepare"), 50), _p(_values(floor, "prepare"), 50), "ms", 1.5),
        _ratio_goal("realnode_node_prepare_p95", _p(_values(sysdra, "prepare"), 95), _p(_values(floor, "prepare"), 95), "ms", None),
        _ratio_goal("realnode_node_prepare_status_off_p50", _p(_values(off["sysdra"], "prepare"), 50),
                    _p(_values(off["floor"], "prepare"), 50), "ms", None),
        _ratio_goal("realnode_node_unprepare_p50", _p(_values(sysdra, "unprepare"), 50), _p(_values(floor, "unprepare"), 50), "ms", None),
        _ratio_goal("realnode_agent_cpu_per_prepare", _mean(_values(sysdra, "cpu_ms")), _mean(_values(floor, "cpu_ms")), "ms", 3),
        _ratio_goal("realnode_agent_cpu_per_prepare_status_off", _mean(_values(off["sysdra"], "cpu_ms")),
                    _mean(_values(off["floor"], "cpu_ms")), "ms", None),
        Figure("realnode_api_requests_per_cycle", _mean(requests), "per pod", _mean([c.requests for c in floor]),
               "<= 2 (claim status on)", max(requests) <= 2),
        Figure("realnode_api_requests_per_cycle_status_off", _mean(requests_off), "per pod", _mean([c.requests for c in off["floor"]]),
               "<= 1 (claim status off)", max(requests_off) <= 1),
        Figure("realnode_unprepare_requests", _mean(unprepare), "per unprepare", _mean([len(c.unprepare_requests) for c in floor]),
               "0 (an unprepare that changes nothing)", max(unprepare) == 0),
        Figure("realnode_prepare_to_sandbox_p50", sandbox, "ms", floor_sandbox, "<= floor + 5 ms (status write off the critical path)",
               sandbox is not None and floor_sandbox is not None and sandbox <= floor_sandbox + 5),
        _ratio_goal("realnode_prepare_to_sandbox_status_off_p50", _p(_values(off["sysdra"], "prepare_to_sandbox"), 50),
                    _p(_values(off["floor"], "prepare_to_sandbox"), 50), "ms", None),
        _ratio_goal("realnode_status_write_after_prepare_p50", _p(_values(sysdra, "status_write"), 50), None, "ms", None),
        Figure("realnode_status_writes_in_sandbox_creation", sum(landed) / len(landed) if landed else 0.0, "share of pods", None,
               "reported", True),
    ]
