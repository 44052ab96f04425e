"""Adapters that report what the driver and the publisher do to metrics and the status
board, so each fact is reported in one place; ``NullMetrics`` when there is no endpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from agent.service.status import StatusBoard

if TYPE_CHECKING:
    from agent.service.metrics import Metrics


class NullMetrics:
    """``agent.service.metrics.Metrics``' interface, keeping nothing: with the endpoint
    disabled nobody can read metrics, so the agent does not load prometheus_client."""

    def _ignore(self, *args, **kwargs) -> None:
        return None

    observe_prepare = observe_unprepare = set_registration = set_published_devices = set_nri = _ignore
    observe_publish = observe_change_to_slice = count_watcher_event = set_health = observe_claim_status = _ignore
    set_nri_claims_waiting = set_unhealthy_devices = set_prepared_devices = _ignore


class ObservedDriver:
    """The driver, refreshing the status board's claim list after each call. Its methods run in
    the plugin's worker thread; the board is the loop's, so its update is handed to ``loop``
    (None: called on the board's thread already)."""

    def __init__(self, driver, board: StatusBoard, loop=None, on_claims: Callable[[dict], None] = lambda claims: None):
        self.driver, self.board, self.loop = driver, board, loop
        self.on_claims = on_claims  # the claims after each call, on the board's thread too (the daemon's slices)

    def __getattr__(self, name):  # recover(), checkpoint, ... pass through
        return getattr(self.driver, name)

    def _refresh(self) -> None:
        cp = getattr(self.driver, "checkpoint", None)
        if cp is not None:
            claims = dict(cp.claims)
            for call in (self.board.set_prepared_claims, self.on_claims):
                if self.loop is None:
                    call(claims)
                else:
                    self.loop.call_soon_threadsafe(call, claims)

    def prepare_claims(self, claims):
        results = self.driver.prepare_claims(claims)
        self._refresh()
        return results

    def unprepare_claims(self, claims):
        results = self.driver.unprepare_claims(claims)
        self._refresh()
        return results


def call_observer(metrics: Metrics) -> Callable[[str, dict, float], None]:
    """The kubelet's calls as it sees them, for metrics: every claim of a NodePrepareResources or
    NodeUnprepareResources call counts ok or error, those that failed before the driver too (not
    read, refused, the kubelet gone), each with its share of the call's time."""
    observe = {"prepare": metrics.observe_prepare, "unprepare": metrics.observe_unprepare}

    def on_call(what: str, results: dict, seconds: float) -> None:
        per_claim = seconds / max(1, len(results))
        for result in results.values():
            failed = getattr(result, "error", result)  # PrepareResult or unprepare's error string
            observe[what](not failed, per_claim)

    return on_call


class ClaimStatusObserver:
    """The claim-status writer's results -> metrics and status board (``sysdra status``)."""

    def __init__(self, metrics: Metrics, board: StatusBoard):
        self.metrics, self.board = metrics, board

    def claim_status_written(self, ref, result: str, reason: str | None) -> None:
        self.metrics.observe_claim_status(result)
        self.board.record_claim_status(ref.namespace, ref.name, ref.uid, result, reason)


class PublishObserver:
    """Publisher -> metrics and status board (one place reports each fact)."""

    def __init__(self, agent):  # service.daemon.Agent
        self.agent = agent

    def observe_publish(self, ok: bool, seconds: float, reason: str = "error") -> None:
        a = self.agent
        a.metrics.observe_publish(ok, seconds, reason)
        pool = a.pool
        devices = sum(len(sl.get("devices", ())) for sl in pool.slices) if pool is not None else None
        a.board.record_publish(ok, error=a.publisher.last_error if not ok else None, devices=devices,
                               slices=len(pool.slices) if pool is not None else None)

    def observe_change_to_slice(self, seconds: float) -> None:
        self.agent.metrics.observe_change_to_slice(seconds)
