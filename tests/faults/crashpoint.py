"""``python -m tests.faults.crashpoint run ...``: the real agent (``agent.cli``) with a SIGKILL
armed at one chosen point. Test-only; production code is not changed.

- ``SYSDRA_FAULT_KILL_POINT``: ``driver:<Driver.fault point>`` (e.g. ``driver:prepare:started``),
  ``rename-before:<what>`` (the temp file is written, the rename not done) or
  ``rename-after:<what>`` (renamed, directory not fsynced), ``<what>`` one of
  ``checkpoint``, ``cdi-claim``, ``cdi-metadata``, ``metadata``, ``slice``;
- ``SYSDRA_FAULT_KILL_NTH``: kill at the n-th hit (default 1).

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
    if base.startswith("k8s.") and "-claim_" in base:
        return "cdi-claim"
    if "_metadata_" in base:
        return "cdi-metadata"
    if base == "metadata.json":
        return "metadata"
    if os.path.basename(os.path.dirname(dst)) == "resourceslices":
        return "slice"
    return "other"


def install() -> None:
    signal.signal(signal.SIGUSR1, _arm)
    if not POINT:
        return
    if POINT.startswith("driver:"):
        from agent import driver

        init = driver.Driver.__init__

        def patched(self, *a, **kw):
            init(self, *a, **kw)
            self.fault = lambda point: _hit("driver:" + point)

        driver.Driver.__init__ = patched
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


def main() -> int:
    install()
    from agent.cli import main as cli_main

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
