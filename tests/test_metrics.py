"""agent.service.metrics: a private registry served over real HTTP on an ephemeral loopback port."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.kubeletplugin.types import PrepareResult
from agent.service.metrics import Metrics, parse_address, start_server
from agent.service.observers import call_observer


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture
def served():
    m = Metrics()
    server = start_server("127.0.0.1:0", m)
    try:
        yield m, server
    finally:
        server.close()


def test_scrape_over_http(served):
    m, server = served
    on_call = call_observer(m)
    # every claim of a call counts, also one refused before the driver (not read, a bad reference)
    on_call("prepare", {"a": PrepareResult(devices=[]), "b": PrepareResult(error="ResourceClaim x/y: not found")}, 0.02)
    on_call("unprepare", {"a": None}, 0.003)
    m.set_published_devices({"gpu": 2, "nic": 4})
    m.observe_publish(True, 0.05)
    m.observe_publish(False, 0.5, reason="conflict")
    m.observe_change_to_slice(0.7)
    m.count_watcher_event("udev")
    m.set_health({"healthy": 5, "unhealthy": 1})
    m.set_registration("registered")
    got = _scrape(server.port)
    assert got[("sysdra_prepare_total", (("result", "ok"),))] == 1
    assert got[("sysdra_prepare_total", (("result", "error"),))] == 1
    assert got[("sysdra_prepare_seconds_count", (("result", "error"),))] == 1
    assert got[("sysdra_unprepare_seconds_count", (("result", "ok"),))] == 1
    assert got[("sysdra_published_devices", (("kind", "gpu"),))] == 2
    assert got[("sysdra_published_devices", (("kind", "fpga"),))] == 0
    assert got[("sysdra_slice_publish_attempts_total", ())] == 2
    assert got[("sysdra_slice_publish_failures_total", (("reason", "conflict"),))] == 1
    assert got[("sysdra_slice_publish_seconds_count", ())] == 2
    assert got[("sysdra_hardware_change_to_slice_seconds_count", ())] == 1
    assert got[("sysdra_watcher_events_total", (("source", "udev"),))] == 1
    assert got[("sysdra_device_health", (("state", "unhealthy"),))] == 1
    assert got[("sysdra_registration", (("sysdra_registration", "registered"),))] == 1
    assert got[("sysdra_registration", (("sysdra_registration", "failed"),))] == 0
    assert ("process_resident_memory_bytes", ()) in got


def test_registries_are_independent():
    a, b = Metrics(process=False), Metrics(process=False)
    a.count_watcher_event("udev")
    assert b.registry.get_sample_value("sysdra_watcher_events_total", {"source": "udev"}) is None


def test_publisher_metrics_bridged_once(served):
    from agent.publish import metrics as publish_metrics

    publish_metrics.SLICE_WRITES.labels("create").inc()
    m, server = served
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read().decode()
    assert "sysdra_resourceslice_writes_total" in text
    names = [f.name for f in text_string_to_metric_families(text)]
    assert len(names) == len(set(names))


def test_binds_only_the_given_address(served):
    import psutil

    _, server = served
    listening = [c.laddr for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == server.port]
    assert [a.ip for a in listening] == ["127.0.0.1"]  # not 0.0.0.0 / ::


def test_disabled_and_bad_addresses():
    assert start_server("", Metrics(process=False)) is None
    assert parse_address("[::1]:9478") == ("::1", 9478)
    for bad in ("9478", ":9478", "host:port", "127.0.0.1:70000"):
        with pytest.raises(ValueError):
            parse_address(bad)


def test_null_metrics_take_every_call_metrics_take():
    """Without an endpoint the daemon records into NullMetrics: it must accept all of it."""
    from agent.service.observers import NullMetrics

    public = {n for n in dir(Metrics) if not n.startswith("_") and callable(getattr(Metrics, n))}
    null = NullMetrics()
    assert public <= set(dir(null)), public - set(dir(null))
    null.observe_publish(True, 0.1)
    null.count_watcher_event("file")


def test_publish_counts_are_exported_with_their_labels():
    from agent.publish import metrics as publish_metrics

    m = Metrics(process=False)
    before = m.registry.get_sample_value("sysdra_resourceslice_writes_total", {"op": "update"}) or 0
    publish_metrics.SLICE_WRITES.labels("update").inc()
    publish_metrics.POOL_GENERATION.set(7)
    assert m.registry.get_sample_value("sysdra_resourceslice_writes_total", {"op": "update"}) == before + 1
    assert m.registry.get_sample_value("sysdra_pool_generation") == 7
    with pytest.raises(ValueError):
        publish_metrics.SLICE_WRITES.labels("a", "b")


def test_every_publish_failure_reason_is_exported_from_the_start():
    """The reasons the publisher counts (its ``_count_error`` calls) are the ones exported at 0."""
    import ast
    import inspect

    from agent.publish import metrics as publish_metrics
    from agent.publish import publisher

    counted = {node.args[0].value for node in ast.walk(ast.parse(inspect.getsource(publisher)))
               if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "_count_error"}
    assert counted == set(publish_metrics.FAILURE_REASONS)
    m = Metrics(process=False)
    for reason in counted:
        assert m.registry.get_sample_value("sysdra_slice_publish_failures_total", {"reason": reason}) == 0
