"""Small records the agent writes and reads back, damaged (agent/service/nodeops.py's
skip-node-operations.json, agent/prepare/mps_records.py's daemons.json): read back, a damaged
record is said and costs only itself, never an exception, never a value the agent would not
have written."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from agent.prepare.checkpoint import Checkpoint
from agent.service import nodeops
from agent.settings import Settings
from tests import damage
from tests.checkpoint_files import entry, uid

HYPOTHESIS = settings(max_examples=150, derandomize=True, deadline=None,
                      suppress_health_check=[HealthCheck.function_scoped_fixture])
NASTY = [b"\x00", b"\xff", b"1", b"null", b"[]", b"{}", b'"x"', b"[1,", b"9" * 30, b"1e999", b"[" * 300,
         b'"NodePrepareResources"', b'"Bogus"', b"true", b"-1", b"\\ud800"]


def damaged(valid: bytes):
    return damage.damaged(valid, NASTY, ("flip", "cut", "insert", "replace"))


# --- skip-node-operations.json ----------------------------------------------------------------
@pytest.fixture
def plugin_dir(tmp_path):
    """A plugin dir with a prepared claim of a GPU: a change of the GPUs' rule is refused."""
    cp = Checkpoint(str(tmp_path / "checkpoint.json"))
    cp.claims[uid(1)] = entry(1)  # holds gpu-1
    cp.save()
    return str(tmp_path)


def _record(plugin_dir: str, data: bytes) -> None:
    with open(os.path.join(plugin_dir, nodeops.APPLIED_FILE), "wb") as f:
        f.write(data)


@pytest.mark.parametrize("data", [b'{"gpu": [1, "*"]}', b'{"gpu": [null, null]}', b'{"gpu": [{}, {}]}',
                                  b'{"gpu": ["Bogus"]}', b'{"gpu": ["NodePrepareResources"]}', b'{"gpu": []}',
                                  b'{"tpu": ["*"]}', b'{"gpu": "*"}', b"[]"])
def test_a_damaged_applied_rule_is_said_and_the_configured_one_taken(plugin_dir, data, caplog):
    """A record the settings would refuse is none the agent wrote: it raised (sorting mixed
    values) or was published as the rule the prepared claims keep."""
    _record(plugin_dir, data)
    assert nodeops.settle({"nic": ["*"]}, plugin_dir) == {"nic": ["*"]}
    assert "skip-node-operations.json damaged" in caplog.text
    assert nodeops.load_applied(plugin_dir) == {"nic": ["*"]}  # recorded again, whole


def test_the_applied_rule_is_kept_while_claims_hold_its_kind(plugin_dir):
    nodeops.save_applied(plugin_dir, {"gpu": ["*"]})
    assert nodeops.settle({}, plugin_dir) == {"gpu": ["*"]}


@HYPOTHESIS
@given(data=damaged(b'{"gpu":["NodePrepareResources","NodeUnprepareResources"],"nic":["*"]}'))
def test_any_damage_to_the_applied_rule_settles_on_a_rule_the_settings_allow(plugin_dir, data):
    _record(plugin_dir, data)
    ops = nodeops.settle({"fpga": ["*"]}, plugin_dir)
    Settings(node_name="node-a", skip_node_operations=ops)  # a rule the API server takes (checked as at start)


# --- mps/daemons.json ---------------------------------------------------------------------------
A, B = "GPU-7e3a1c52-0d4b-4f6e-9a81-2b3c4d5e6f70", "GPU-00000000-1111-2222-3333-444444444444"


def _daemons_file(tmp_path) -> tuple[str, bytes]:
    """The records as the agent saves them: A's first, then B's."""
    from agent.prepare import mps_records
    from agent.prepare.mps_records import MpsRecord, MpsState

    path = str(tmp_path / "mps" / "daemons.json")
    state = MpsState(daemons={u: MpsRecord(uuid=u, pid=100 + i, started=1.7e9, ticks=3382916 + i, boot_id="b",
                                           cmdline=["/usr/bin/nvidia-cuda-mps-control", "-f"], mode_before=i)
                              for i, u in enumerate((A, B))})
    mps_records.save(path, state)
    with open(path, "rb") as f:
        return path, f.read()


@HYPOTHESIS
@given(st.data())
def test_damage_to_one_daemon_record_keeps_the_other(tmp_path, data):
    from agent.prepare import mps_records
    from agent.prepare.mps_records import MpsRecord

    path, valid = _daemons_file(tmp_path)
    start, end = valid.index(b'"%s":{' % A.encode()), valid.index(b'"%s":{' % B.encode())  # A's record alone
    text = valid[:start] + data.draw(damaged(valid[start:end])) + valid[end:]
    with open(path, "wb") as f:
        f.write(text)
    state = mps_records.load(path)  # never raises
    assert all(k == r.uuid for k, r in state.daemons.items())
    try:
        parsed = json.loads(text)
        b_intact = set(parsed) == {"daemons"} and parsed["daemons"][B] == json.loads(valid)["daemons"][B]
    except (ValueError, TypeError, KeyError, RecursionError):  # no object of records any more: nothing to tell
        return
    if b_intact:
        assert state.daemons[B] == MpsRecord.model_validate(json.loads(valid)["daemons"][B])
