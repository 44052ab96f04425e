"""``python -m tests.faults.crashpoint run ...``: the real agent (``agent.cli.main``) with a SIGKILL
armed at one chosen point. Test-only; production code is not changed.

- ``SYSDRA_FAULT_KILL_POINT``: ``driver:<Driver.fault point>`` (e.g. ``driver:prepare:started``),
  ``mps:<MpsDaemons.fault point>`` (e.g. ``mps:exclusive``),
  ``rename-before:<what>`` (the temp file is written, the rename not done) or
  ``rename-after:<what>`` (renamed, directory not fsynced), ``<what>`` one of
  ``checkpoint``, ``journal``, ``cdi-claim``, ``cdi-metadata``, ``metadata``, ``slice``;
  ``journal-torn`` (half of a checkpoint journal append written) or ``journal-written``
  (appended, not yet fdatasynced);
- ``SYSDRA_FAULT_KILL_NTH``: kill at the n-th hit (default 1).

The checkpoint compacts every 3 journal records here (every 1 MiB in production), so
crashes also land in compactions; tests/checkpoint_guard.py checks every save, as in the other tests.

Hits are only counted once the test sends SIGUSR1 (after start-up and the checks), so
start-up writes do not use up the point. The process kills itself with SIGKILL: no
handler, finaliser or buffered write runs after the point.
"""

from __future__ import annotations

import os
import signal
import sys

POINT = os.environ.get("SYSDRA_FAULT_KILL_POINT", "")
NTH = int(os.environ.get("SYSDRA_FAULT_KILL_NTH", "1") or 1)
_state = {"armed": False, "hits": 0}


def _arm(signum, frame) -> None:
    _state["armed"] = True
    print("crashpoint: armed", POINT, NTH, file=sys.stderr, flush=True)


def _hit(point: str) -> None:
    if not _state["armed"] or point != POINT:
        return
    _state["hits"] += 1
    if _state["hits"] >= NTH:
        os.kill(os.getpid(), signal.SIGKILL)


def _what(dst: str) -> str:
    base = os.path.basename(dst)
    if base == "checkpoint.json":
        return "checkpoint"
    if base == "checkpoint.json.journal":
        return "journal"
    if base.startswith("k8s.") and "-claim_" in base:
        return "cdi-claim"
    if "_metadata_" in base:
        return "cdi-metadata"
    if base == "metadata.json":
        return "metadata"
    if os.path.basename(os.path.dirname(dst)) == "resourceslices":
        return "slice"
    return "other"


def _is_journal(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").endswith("/checkpoint.json.journal")
    except OSError:
        return False


def _hook(cls, prefix: str) -> None:
    """Every new ``cls`` object's ``fault`` hook hits ``<prefix><point>``."""
    init = cls.__init__

    def patched(self, *a, **kw):
        init(self, *a, **kw)
        self.fault = lambda point: _hit(prefix + point)

    cls.__init__ = patched


def install() -> None:
    signal.signal(signal.SIGUSR1, _arm)
    from agent.prepare.checkpoint import Checkpoint

    Checkpoint.compact_bytes = 4096
    Checkpoint._due_for_compaction = lambda self, updates: self.journal_records + len(updates) > 3
    from tests import checkpoint_guard

    checkpoint_guard.install()
    from tests import simnvml_mig

    simnvml_mig.install_from_env()  # SYSDRA_SIMNVML: the simulated NVML with MIG as the node's NVML
    if not POINT:
        return
    if POINT.startswith("driver:"):
        from agent.prepare import driver

        _hook(driver.Driver, "driver:")
    elif POINT.startswith("mps:"):
        from agent.prepare import mps

        _hook(mps.MpsDaemons, "mps:")
    elif POINT.startswith("rename-"):
        real = os.rename

        def rename(src, dst, *a, **kw):
            what = _what(os.fspath(dst))
            if POINT == f"rename-before:{what}":
                _hit(POINT)
            real(src, dst, *a, **kw)
            if POINT == f"rename-after:{what}":
                _hit(POINT)

        os.rename = rename
    elif POINT.startswith("journal-"):
        real_pwrite = os.pwrite

        def pwrite(fd, data, offset):
            if not _is_journal(fd):
                return real_pwrite(fd, data, offset)
            if POINT == "journal-torn" and len(data) > 1:
                real_pwrite(fd, bytes(data[: len(data) // 2]), offset)
                _hit(POINT)
            n = real_pwrite(fd, data, offset)
            if POINT == "journal-written":
                _hit(POINT)
            return n

        os.pwrite = pwrite


def main() -> int:
    install()
    from agent.cli.main import main as cli_main

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
