"""What a ``sysdra doctor`` check returns: a finding says what is wrong *and* how to fix it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Finding:
    check: str
    level: str  # ok | warn | fail | skip
    message: str
    fix: str = ""


def ok(check: str, message: str) -> Finding:
    return Finding(check, "ok", message)
