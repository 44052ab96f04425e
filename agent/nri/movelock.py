"""The NRI netdev mover's locks (agent/nri/netdev.py): one worker thread at a time (a request the
runtime cancelled leaves its thread running), then the plugin's ``flock`` on ``serialize.lock``,
which prepare and unprepare hold (agent/kubeletplugin/service.py), so a move and an unprepare
never interleave.

Both waits share one budget: the runtime's answer is due by its request timeout, which it says
in ``ConfigureRequest.request_timeout`` (containerd: ``plugin_request_timeout``, 2 s by default).
A wait past it is worse than a refusal: containerd drops the plugin (until it connects again,
pods start unannounced), and before NRI 0.12.5 runs the sandbox anyway, without its netdevs.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from agent.prepare.metadata.update import Flock, UpdateError

LOCK_TIMEOUT = 1.5  # seconds, while the runtime has not said its request timeout (containerd's default: 2 s)
LOCK_SHARE = 0.75  # of the runtime's request timeout: the rest is the move's and the answer's


class MoveLock:
    """``held()``: both locks, waited for ``timeout`` seconds in all (UpdateError after)."""

    def __init__(self, path: str, timeout: float = LOCK_TIMEOUT):
        self.path, self.timeout = path, timeout
        self.thread = threading.Lock()

    def follow(self, request_timeout: float | None) -> None:
        """The runtime's request timeout (seconds; None: not said, the budget stays)."""
        if request_timeout:
            self.timeout = LOCK_SHARE * request_timeout

    @contextmanager
    def held(self):
        budget = self.timeout
        deadline = time.monotonic() + budget
        if not self.thread.acquire(timeout=budget):
            raise UpdateError(f"timed out after {budget:g} s waiting for another netdev move")
        try:
            try:
                flock = Flock(self.path, max(0.0, deadline - time.monotonic())).__enter__()
            except UpdateError:
                raise UpdateError(f"timed out after {budget:g} s waiting for {self.path} "
                                  "(a prepare or unprepare holds it)") from None
            try:
                yield
            finally:
                flock.__exit__(None, None, None)
        finally:
            self.thread.release()
