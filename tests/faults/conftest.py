"""Fault-injection suite: a ``faults`` fixture to record what was tried, written as JSON
for ``python -m tests.faults.report`` when ``SYSDRA_FAULT_RESULTS`` names a file."""

from __future__ import annotations

import json
import os

import pytest

_RECORDS: list[dict] = []
_OUTCOMES: dict[str, dict] = {}


class Recorder:
    def __init__(self, nodeid: str):
        self.nodeid = nodeid

    def add(self, category: str, fault: str, count: int, outcome: str) -> None:
        """One row of docs/reliability.md: ``count`` injections of ``fault``, what the agent did."""
        _RECORDS.append({"test": self.nodeid, "category": category, "fault": fault, "count": count, "outcome": outcome})


@pytest.fixture
def node(tmp_path):
    """The real agent running on a copied fixture node (tests/faults/harness.py)."""
    from tests.faults.harness import Node

    n = Node(tmp_path)
    n.start()
    yield n
    n.stop()


@pytest.fixture
def faults(request) -> Recorder:
    return Recorder(request.node.nodeid)


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        prev = _OUTCOMES.get(report.nodeid)
        if prev is None or prev["outcome"] == "passed":
            outcome = "xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome
            _OUTCOMES[report.nodeid] = {"outcome": outcome, "duration": round(report.duration, 2),
                                       "reason": getattr(report, "wasxfail", "") or (str(report.longrepr)[-300:] if report.failed else "")}


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("SYSDRA_FAULT_RESULTS")
    if not path:
        return
    with open(path, "w") as f:
        json.dump({"seed": int(os.environ.get("SYSDRA_FAULT_SEED", "20240607")), "records": _RECORDS,
                   "tests": _OUTCOMES}, f, indent=2)
