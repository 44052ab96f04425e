"""Claim entries and journal records for the tests of the checkpoint's files
(tests/test_checkpoint_journal.py, test_checkpoint_readers.py, test_checkpoint_salvage.py,
test_checkpoint_compat.py): entries as the driver writes them, UIDs, the journal's lines, a
checkpoint path in the test's tmp dir (the ``path`` fixture)."""

from __future__ import annotations

import pytest

from agent.prepare.checkpoint import COMPLETED, Checkpoint


def entry(n: int, state: str = COMPLETED) -> dict:
    return {"state": state, "namespace": "ns", "name": f"c{n}", "bootID": "b", "allocation": f"a{n}",
            "devices": [{"requests": ["r"], "pool": "node", "device": f"gpu-{n}", "cdiDeviceIDs": [f"k=d{n}"], "shareID": None}],
            "cdiSpec": None, "metadata": None}


def uid(n: int) -> str:
    return f"{n:08d}-0000-4000-8000-000000000000"


def journal_lines(cp: Checkpoint) -> list[bytes]:
    with open(cp.journal_path, "rb") as f:
        return f.read().split(b"\n")[:-1]


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "plugin" / "checkpoint.json")


def _append_records(cp: Checkpoint, record: bytes) -> None:
    import zlib

    with open(cp.journal_path, "r+b") as f:
        f.seek(cp._journal_size)
        for _ in range(2):  # not the last line: corruption, not a torn tail
            f.write(b"%08x %s\n" % (zlib.crc32(record), record))

