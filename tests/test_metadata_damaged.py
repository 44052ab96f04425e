"""KEP-5304 metadata files read back damaged (agent/prepare/metadata/stream.py): the agent reads
its own files back for their generation (every prepare, recovery's orphan sweep), so a damaged
one is that file's problem alone, rewritten, never an exception that stops recovery."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from agent.prepare.driver import Driver
from agent.prepare.metadata import layout, read_file
from agent.prepare.metadata.stream import MetadataError
from tests.kubelet_standin import claim
from tests.test_metadata import NIC0, env, host, prepared
from tests.test_records_damaged import damaged

HEAD = b'{"kind":"DeviceMetadata","apiVersion":"metadata.resource.k8s.io/v1beta1","metadata":'


@pytest.fixture
def node(tmp_path):
    """A prepared claim with metadata, the path of its file and an orphan's file."""
    s, state = env(tmp_path)
    c = claim("c", [("net", NIC0)])
    prepared(s, state, c)
    orphan = os.path.join(layout.claim_dir(s.plugin_dir, "default", "ghost"), "r", layout.FILE_NAME)
    return s, state, c["metadata"]["uid"], host(s, c, "net"), orphan


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("damage", [
    b"[" * 100000,  # nested too deep to parse
    HEAD + b'{"generation":' + b"9" * 5000 + b"}}",  # a number too long to convert
    HEAD + b'{"generation":99999999999999999999999,"uid":"UID"},"requests":[]}',  # no int64: no Go reader takes it
    HEAD + b'{"generation":-5,"uid":"UID"},"requests":[]}',
])
def test_a_damaged_file_is_rewritten_and_an_orphans_removed(node, damage):
    s, state, uid, path, orphan = node
    _write(path, damage.replace(b"UID", uid.encode()))
    _write(orphan, damage)
    with pytest.raises(MetadataError):
        read_file(path)
    report = Driver(s, lambda: state["inv"]).recover()  # raised RecursionError / ValueError: no agent start
    assert os.path.dirname(os.path.dirname(orphan)) in report.metadata_orphans_removed
    assert read_file(path)["metadata"]["generation"] == 2 and read_file(path)["metadata"]["uid"] == uid


@settings(max_examples=60, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_damage_to_a_metadata_file_leaves_a_readable_one_after_recovery(node, data):
    s, state, uid, path, _ = node
    with open(path, "rb") as f:
        valid = f.read()
    _write(path, data.draw(damaged(valid)))
    try:
        read_file(path)
    except MetadataError:  # the one error a reader sees
        pass
    Driver(s, lambda: state["inv"]).recover()
    obj = read_file(path)
    assert 0 < obj["metadata"]["generation"] < 2**63  # an int64
    _write(path, valid)
