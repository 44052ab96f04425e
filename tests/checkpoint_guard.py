"""A test-only check on every ``Checkpoint.save(changed=...)``: the caller named every entry it
changed (one changed in place but not named would be lost at the next restart). Installed by
tests/conftest.py for the in-process tests and by tests/faults/crashpoint.py in the agent."""

from __future__ import annotations

from agent.prepare.checkpoint import Checkpoint

_save = Checkpoint.save


def checked_save(self: Checkpoint, durable: bool = True, changed=None) -> None:
    if changed is not None:
        changed = list(changed)
        # a rejected entry's removal is no caller's change: a full save journals it (checkpoint.py)
        missed = set(self._updates(None)) - set(self._updates(changed)) - set(self.rejected)
        assert not missed, f"checkpoint entries changed but not passed to save(): {sorted(missed)}"
    _save(self, durable=durable, changed=changed)


def install() -> None:
    Checkpoint.save = checked_save
