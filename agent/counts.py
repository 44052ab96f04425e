"""Process-wide counts as plain numbers, for wings that must not load prometheus_client (its
import pulls in http.server, urllib and email: ~15 ms and ~2.5 MB; an agent without a metrics
endpoint never loads it). ``agent.service.metrics`` exports them on the agent's registry.

Every series an alert may watch exists from the start, at 0: a counter without labels, and a
labelled one for each of its ``known`` label values. Prometheus's ``increase()`` cannot see the
first count of a series that appears with it (deploy/helm/sysdra/files/alerts.yaml)."""

from __future__ import annotations


class Count:
    """A counter (``inc``) or gauge (``set``), optionally per label values (``labels(...)``)."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...] = (), kind: str = "counter",
                 known: tuple[str, ...] = ()):
        """``known``: the values of a single label exported at 0 before they are counted."""
        self.name, self.documentation, self.labelnames, self.kind = name, documentation, labelnames, kind
        if known and len(labelnames) != 1:
            raise ValueError(f"{name}: known values need exactly one label")
        keys = [(v,) for v in known] if labelnames else [()]
        self.values: dict[tuple[str, ...], float] = dict.fromkeys(keys, 0.0)  # label values -> value

    def labels(self, *values: str) -> "_Labelled":
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
        return _Labelled(self, tuple(str(v) for v in values))

    def inc(self, amount: float = 1.0) -> None:
        self._add((), amount)

    def set(self, value: float) -> None:
        self.values[()] = float(value)

    def _add(self, key: tuple[str, ...], amount: float) -> None:
        if amount < 0 and self.kind == "counter":
            raise ValueError("counters only go up")
        self.values[key] = self.values.get(key, 0.0) + amount


class _Labelled:
    __slots__ = ("count", "key")

    def __init__(self, count: Count, key: tuple[str, ...]):
        self.count, self.key = count, key

    def inc(self, amount: float = 1.0) -> None:
        self.count._add(self.key, amount)
