"""The committed gRPC stubs match the .proto files (``make protos`` regenerates them)."""

from __future__ import annotations

import os
import re
import shutil

import pytest

from agent.protos import generate

# Lines that only record the generator's version: differ between grpcio-tools releases.
_VERSION_LINES = re.compile(
    r"^(# Protobuf Python Version: .*|GRPC_GENERATED_VERSION = .*|\s+\d+,\s*)$", re.M)


def _normalized(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return _VERSION_LINES.sub("", f.read())


def test_stubs_are_up_to_date(tmp_path):
    pytest.importorskip("grpc_tools")
    for name in generate.proto_files():
        shutil.copy(os.path.join(generate.PROTO_DIR, name), tmp_path)
    fresh = generate.generate(str(tmp_path))
    assert fresh, "no .proto files found"
    stale = []
    for path in fresh:
        committed = os.path.join(generate.PROTO_DIR, os.path.basename(path))
        if not os.path.exists(committed) or _normalized(committed) != _normalized(path):
            stale.append(os.path.basename(path))
    assert not stale, f"stale gRPC stubs {stale}: run `make protos`"


def test_wire_names_and_field_numbers():
    from agent.protos import dra_v1_pb2, dra_v1beta1_pb2, pluginregistration_pb2

    assert dra_v1_pb2.DESCRIPTOR.services_by_name["DRAPlugin"].full_name == "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
    assert dra_v1beta1_pb2.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1beta1"
    assert pluginregistration_pb2.DESCRIPTOR.services_by_name["Registration"].full_name == "pluginregistration.Registration"
    dev = dra_v1_pb2.Device.DESCRIPTOR.fields_by_name
    assert {n: f.number for n, f in dev.items()} == {
        "request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4, "share_id": 5}
    assert dev["share_id"].has_presence  # proto3 optional
    assert "share_id" not in dra_v1beta1_pb2.Device.DESCRIPTOR.fields_by_name
    claim = dra_v1_pb2.Claim.DESCRIPTOR.fields_by_name
    assert (claim["namespace"].number, claim["uid"].number, claim["name"].number) == (1, 2, 3)
    info = pluginregistration_pb2.PluginInfo.DESCRIPTOR.fields_by_name
    assert [info[n].number for n in ("type", "name", "endpoint", "supported_versions")] == [1, 2, 3, 4]


def test_health_wire_names_and_field_numbers():
    from agent.protos import dra_health_v1_pb2, dra_health_v1alpha1_pb2

    for pb, pkg in ((dra_health_v1_pb2, "v1"), (dra_health_v1alpha1_pb2, "v1alpha1")):
        svc = pb.DESCRIPTOR.services_by_name["DRAResourceHealth"]
        assert svc.full_name == f"{pkg}.DRAResourceHealth"
        method = svc.methods_by_name["NodeWatchResources"]
        assert method.server_streaming and not method.client_streaming
        dh = pb.DeviceHealth.DESCRIPTOR.fields_by_name
        assert {n: f.number for n, f in dh.items()} == {
            "device": 1, "health": 2, "last_updated_time": 3, "health_check_timeout_seconds": 4, "message": 5}
        ident = pb.DeviceIdentifier.DESCRIPTOR.fields_by_name
        assert (ident["pool_name"].number, ident["device_name"].number) == (1, 2)
        assert [pb.HealthStatus.Value(n) for n in ("UNKNOWN", "HEALTHY", "UNHEALTHY")] == [0, 1, 2]
        assert pb.NodeWatchResourcesResponse.DESCRIPTOR.fields_by_name["devices"].number == 1
