"""The real-node bench's readings (bench/realnode_trace.py, bench/realnode_figures.py) and the
floor's device (tests/realnode_floor.py), on lines the v1.37.2 kubelet and kube-apiserver wrote
in a run of the bench; the run itself is `make bench` (tests/test_realnode_floor.py runs the floor)."""

from __future__ import annotations

import json

import pytest

from bench.realnode_cycle import Cycle
from bench.realnode_figures import figures
from bench.realnode_trace import Audit, KubeletLog, Request
from tests.realnode_floor import device_file

KUBELET = r"""I1205 05:29:43.020953   17132 kuberuntime_manager.go:1684] "Creating PodSandbox for pod" pod="bench/s1"
I1205 05:29:43.037001   17132 dra_plugin.go:97] "Calling NodePrepareResources rpc" logger="dra-plugin" driverName="sysdra.io" endpoint="/n/kubelet/plugins/sysdra.io/dra.sock" request="claims:{namespace:\"bench\"  uid:\"9195b0c7\"  name:\"s1\"}"
I1205 05:29:43.100000   17132 kubelet.go:1] "Calling NodePrepareResources rpc" logger="dra-plugin" driverName="floor.sysdra.test" endpoint="/f" request="claims:{namespace:\"bench\"  uid:\"3313f7ab\"  name:\"f1\"}"
I1205 05:29:43.137795   17132 dra_plugin.go:116] "Done calling NodePrepareResources rpc" logger="dra-plugin" driverName="sysdra.io" endpoint="/n/kubelet/plugins/sysdra.io/dra.sock" response="claims:{key:\"9195b0c7\"  value:{}}" err=null
I1205 05:29:43.104000   17132 kubelet.go:1] "Done calling NodePrepareResources rpc" logger="dra-plugin" driverName="floor.sysdra.test" endpoint="/f" response="" err=null
W1205 05:29:43.200000   17132 other.go:5] "Eviction manager: failed to get HasDedicatedImageFs" err="no such device"
I1205 05:29:43.503708   17132 kuberuntime_manager.go:1755] "Created PodSandbox for pod" podSandboxID="7f18" pod="bench/s1"
I1205 05:29:48.348274   17132 dra_plugin.go:129] "Calling NodeUnprepareResource rpc" logger="dra-plugin" driverName="sysdra.io" endpoint="/n" request="claims:{namespace:\"bench\"  uid:\"9195b0c7\"  name:\"s1\"}"
I1205 05:29:48.357643   17132 dra_plugin.go:148] "Done calling NodeUnprepareResources rpc" logger="dra-plugin" driverName="sysdra.io" endpoint="/n" response="claims:{key:\"9195b0c7\"  value:{}}" err=null
"""


def test_the_kubelets_calls_pair_up_by_driver_and_pod(tmp_path):
    path = tmp_path / "kubelet.log"
    path.write_text("I1205 05:00:00.000000   1 x.go:1] \"Calling NodePrepareResources rpc\" driverName=\"sysdra.io\" request=\"\"\n")
    log = KubeletLog(str(path))
    log.mark()  # a call from before the mark is not this pod's
    with open(path, "a") as f:
        f.write(KUBELET)
    calls = {(c.what, c.driver or c.pod): c for c in log.calls()}
    assert set(calls) == {("sandbox", "bench/s1"), ("prepare", "sysdra.io"), ("prepare", "floor.sysdra.test"),
                          ("unprepare", "sysdra.io")}  # fmt: skip
    assert calls["prepare", "sysdra.io"].claim == "s1" and calls["prepare", "floor.sysdra.test"].claim == "f1"
    assert calls["prepare", "sysdra.io"].ms == pytest.approx(100.794, abs=0.01)
    assert calls["prepare", "floor.sysdra.test"].ms == pytest.approx(4.0, abs=0.01)
    assert calls["unprepare", "sysdra.io"].ms == pytest.approx(9.369, abs=0.01)
    assert calls["sandbox", "bench/s1"].ms == pytest.approx(482.755, abs=0.01)


def _event(audit_id: str, verb: str, resource: str, name: str, at: str, user: str = "system:serviceaccount:sysdra:sysdra",
           subresource: str | None = None) -> str:  # fmt: skip
    ref = {"resource": resource, "namespace": "bench", "name": name, "apiGroup": "resource.k8s.io", "apiVersion": "v1"}
    if subresource:
        ref["subresource"] = subresource
    return json.dumps({"kind": "Event", "apiVersion": "audit.k8s.io/v1", "level": "Metadata", "auditID": audit_id,
                       "stage": "ResponseComplete", "verb": verb, "user": {"username": user}, "userAgent": "python-httpx2/2.17.0",
                       "objectRef": ref, "requestReceivedTimestamp": at, "stageTimestamp": at}) + "\n"  # fmt: skip


def test_audit_requests_between_marks_without_watches(tmp_path):
    path = tmp_path / "audit.log"
    path.write_text(_event("a0", "get", "resourceclaims", "old", "2026-12-05T05:29:40.000000Z"))
    audit = Audit(str(path))
    start = audit.mark()
    with open(path, "a") as f:
        f.write(_event("a1", "get", "resourceclaims", "s1", "2026-12-05T05:29:43.040000Z"))
        f.write(_event("a2", "watch", "resourceslices", "", "2026-12-05T05:29:43.050000Z"))
        f.write(_event("a3", "patch", "resourceclaims", "s1", "2026-12-05T05:29:43.190000Z", subresource="status"))
    mid = audit.mark()
    with open(path, "a") as f:
        f.write(_event("a4", "get", "resourceclaims", "s1", "2026-12-05T05:29:48.400000Z"))
    assert [r.kind for r in audit.requests(since=start, until=mid)] == ["get resourceclaims", "patch resourceclaims/status"]
    assert [r.name for r in audit.requests(since=mid)] == ["s1"]
    assert audit.requests(since=start, until=mid)[1].received - audit.requests(since=start)[0].received == pytest.approx(0.15)


def test_the_floor_device_copies_sysdras_edits_but_not_its_claim():
    spec = {"cdiVersion": "0.3.0", "kind": "k8s.sysdra.io/claim",
            "containerEdits": {"env": ["SYSDRA_CLAIM_UID=u1", "SYSDRA_DEVICES=gpu-a", "LD_LIBRARY_PATH=/x"], "mounts": [{"hostPath": "/l"}]},
            "devices": [{"name": "u1-gpu-a", "containerEdits": {"env": ["SYSDRA_DEVICE_GPU_A=0000:18:00.0"],
                                                                "deviceNodes": [{"path": "/dev/nvidia2"}]}}]}  # fmt: skip
    device = device_file(spec)
    assert device["claimEdits"] == {"env": ["SYSDRA_DEVICES=gpu-a", "LD_LIBRARY_PATH=/x"], "mounts": [{"hostPath": "/l"}]}
    assert device["deviceEdits"] == spec["devices"][0]["containerEdits"]
    assert device["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": "0000:18:00.0"}
    with pytest.raises(ValueError):
        device_file({**spec, "devices": spec["devices"] * 2})


def _cycles(kind: str, n: int, start: float, prepare: float | None = None, cpu: float | None = None, requests: int = 0,
            unprepare_requests: int = 0) -> list[Cycle]:  # fmt: skip
    req = Request("u", "ua", "get", "resourceclaims", "", "c", 0.0, 0.0)
    return [Cycle(kind, start + i, start - 50 + i, prepare=prepare, unprepare=prepare, prepare_to_sandbox=prepare and 70.0,
                  cpu_ms=cpu, prepare_requests=[req] * requests, unprepare_requests=[req] * unprepare_requests)
            for i in range(n)]  # fmt: skip


def test_goals_are_ratios_to_the_floor_of_the_same_run():
    on = {"plain": _cycles("plain", 5, 150.0), "sysdra": _cycles("sysdra", 5, 185.0, 10.0, 13.5, 3, 1),
          "floor": _cycles("floor", 5, 174.0, 5.0, 3.0, 1)}  # fmt: skip
    off = {"sysdra": _cycles("sysdra", 3, 180.0, 7.0, 6.9, 1), "floor": _cycles("floor", 3, 174.0, 5.0, 3.0, 1)}
    got = {f.name: f for f in figures({"on": on, "off": off, "idle": {"writes": 0, "requests": 1, "cpu_ms": 3.0}})}
    assert got["realnode_node_prepare_p50"].ratio == pytest.approx(2.0) and not got["realnode_node_prepare_p50"].met
    assert got["realnode_agent_cpu_per_prepare"].ratio == pytest.approx(4.5) and not got["realnode_agent_cpu_per_prepare"].met
    assert got["realnode_claim_cost_p50"].value == pytest.approx(35.0) and got["realnode_claim_cost_p50"].floor == pytest.approx(24.0)
    assert not got["realnode_claim_cost_p50"].met  # 35 > 24 + 5
    assert got["realnode_api_requests_per_cycle"].value == 4 and not got["realnode_api_requests_per_cycle"].met
    assert got["realnode_api_requests_per_cycle_status_off"].met
    assert not got["realnode_unprepare_requests"].met
    assert got["realnode_pod_start_claim_p50"].met  # issue 37's: 35 ms <= 100 ms
    assert got["realnode_idle_writes"].met
