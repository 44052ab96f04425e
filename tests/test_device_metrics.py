"""Per-device metrics and status (agent/service/devicemetrics.py; docs/operations.md, "Metrics"):
the unhealthy devices with their reasons, the prepared devices with their claims and the hardware
under them, scraped over real HTTP from the status board's private registry, on the h100-mig
fixture (a GPU in MIG mode and a whole one, with the UUIDs the driver's procfs gives)."""

from __future__ import annotations

import pytest

from agent.cli.status import render_text
from agent.service.devicemetrics import prepared_rows
from agent.service.metrics import Metrics, start_server
from agent.service.status import StatusBoard
from discovery.inventory import scan
from tests.conftest import profile_root
from tests.test_metrics import _scrape

MIG_GPU, WHOLE = "gpu-0000-18-00-0", "gpu-0000-3a-00-0"
MIG_DEV = f"{MIG_GPU}-mig-gi1-ci0"
UUIDS = {MIG_GPU: "GPU-8a1f0c22-4b3d-4e5f-9a61-7b8c9d0e1f20", WHOLE: "GPU-9b2e1d33-5c4e-4f60-8b72-8c9d0e1f2031"}


def _claim(name: str, *devices: str, state: str = "PrepareCompleted") -> dict:
    return {"namespace": "ml", "name": name, "state": state, "devices": [{"device": d} for d in devices]}


@pytest.fixture
def served():
    metrics = Metrics(process=False, bridge_global=False)
    server = start_server("127.0.0.1:0", metrics)
    board = StatusBoard("node-a", "sysdra.io", metrics=metrics)
    try:
        yield board, server
    finally:
        server.close()


def _series(got: dict, name: str) -> list[dict]:
    return sorted((dict(labels) for (n, labels), v in got.items() if n == name and v == 1), key=lambda x: x["device"])


def test_unhealthy_devices_are_named_with_their_reasons_and_go_when_well(served):
    board, server = served
    inv = scan(profile_root("h100-mig"))
    faults = {WHOLE: ("xid-79", "NVML: critical XID 79"),
              MIG_DEV: ("xid-94", "NVML: critical XID 94 in MIG GPU instance 1, compute instance 0")}
    board.set_inventory(inv, {WHOLE: "unhealthy", MIG_GPU: "healthy"}, faults)
    assert _series(_scrape(server.port), "sysdra_device_unhealthy") == [
        {"device": MIG_DEV, "reason": "xid-94"}, {"device": WHOLE, "reason": "xid-79"}]
    assert board.snapshot()["devices"]["unhealthy"] == [
        {"device": MIG_DEV, "reason": "xid-94", "message": faults[MIG_DEV][1]},
        {"device": WHOLE, "reason": "xid-79", "message": "NVML: critical XID 79"}]
    assert f"\n  {WHOLE}: xid-79: NVML: critical XID 79\nclaims:" in render_text(board.snapshot())  # sysdra status
    board.set_inventory(inv, {WHOLE: "healthy", MIG_GPU: "healthy"}, {})  # cleared (sysdra health clear)
    assert _series(_scrape(server.port), "sysdra_device_unhealthy") == []
    assert board.snapshot()["devices"]["unhealthy"] == []


def test_prepared_devices_carry_their_claim_and_the_hardware_under_them(served):
    board, server = served
    inv = scan(profile_root("h100-mig"))
    board.set_prepared_claims({"u1": _claim("train", MIG_DEV), "u2": _claim("infer", WHOLE),
                               "u3": _claim("half-way", WHOLE, state="PrepareStarted")})
    before = _series(_scrape(server.port), "sysdra_device_prepared")  # before the first scan: the claims only
    assert [(s["device"], s["claim"], s["pci_bus_id"], s["uuid"]) for s in before] == [(MIG_DEV, "train", "", ""),
                                                                                     (WHOLE, "infer", "", "")]
    board.set_inventory(inv, {}, {})
    assert _series(_scrape(server.port), "sysdra_device_prepared") == [
        {"device": MIG_DEV, "namespace": "ml", "claim": "train", "pci_bus_id": "0000:18:00.0", "uuid": UUIDS[MIG_GPU]},
        {"device": WHOLE, "namespace": "ml", "claim": "infer", "pci_bus_id": "0000:3a:00.0", "uuid": UUIDS[WHOLE]}]
    board.set_prepared_claims({"u2": _claim("infer", WHOLE)})  # train unprepared
    assert [s["claim"] for s in _series(_scrape(server.port), "sysdra_device_prepared")] == ["infer"]


def test_a_prepared_device_gone_from_the_node_keeps_its_claim_without_hardware():
    inv = scan(profile_root("h100-mig"))
    rows = prepared_rows({"u": _claim("c", "gpu-0000-99-00-0", "nic-0000-18-00-0"), "v": {"state": "PrepareCompleted",
                          "devices": [{"device": None}, "not a device entry"]}}, inv)
    assert rows == (("gpu-0000-99-00-0", "ml", "c", "", ""), ("nic-0000-18-00-0", "ml", "c", "", ""))  # not the GPU's
