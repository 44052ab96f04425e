"""A fake systemd notify socket for tests: collects sd_notify datagrams.

    with NotifySocket() as ns:
        proc = subprocess.Popen(cmd, env={**os.environ, **ns.env(watchdog_sec=1)})
        ns.wait_for("READY=1")
        ...
        assert ns.keys() == [...]

``env(watchdog_sec=..., pid=...)`` gives NOTIFY_SOCKET (and WATCHDOG_USEC / WATCHDOG_PID
when asked). Messages are the raw datagrams decoded; ``assignments()`` splits them
into ``KEY=VALUE`` lines in arrival order.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time


class NotifySocket:
    def __init__(self, abstract: bool = False):
        self.abstract = abstract
        self.messages: list[str] = []
        self.arrivals: list[float] = []  # time.monotonic() of each message
        self._cond = threading.Condition()
        self._stop = False

    def __enter__(self) -> "NotifySocket":
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if self.abstract:
            name = f"sysdra-test-notify-{os.getpid()}-{id(self)}"
            self._sock.bind("\0" + name)
            self.address = "@" + name
            self._dir = None
        else:
            self._dir = tempfile.mkdtemp(prefix="sysdra-notify-")
            self.address = os.path.join(self._dir, "notify.sock")
            self._sock.bind(self.address)
        self._sock.settimeout(0.1)
        self._thread = threading.Thread(target=self._collect, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop = True
        self._thread.join(2)
        self._sock.close()
        if self._dir:
            try:
                os.unlink(self.address)
            except FileNotFoundError:
                pass
            os.rmdir(self._dir)

    def _collect(self) -> None:
        while not self._stop:
            try:
                data = self._sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            with self._cond:
                self.messages.append(data.decode(errors="replace"))
                self.arrivals.append(time.monotonic())
                self._cond.notify_all()

    def env(self, watchdog_sec: float | None = None, pid: int | None = None) -> dict[str, str]:
        env = {"NOTIFY_SOCKET": self.address}
        if watchdog_sec is not None:
            env["WATCHDOG_USEC"] = str(int(watchdog_sec * 1e6))
            if pid is not None:
                env["WATCHDOG_PID"] = str(pid)
        return env

    def assignments(self) -> list[str]:
        with self._cond:
            return [line for msg in self.messages for line in msg.split("\n") if line]

    def keys(self) -> list[str]:
        """Keys in arrival order with consecutive repeats collapsed (WATCHDOG, WATCHDOG -> WATCHDOG)."""
        out: list[str] = []
        for line in self.assignments():
            key = line.split("=", 1)[0]
            if not out or out[-1] != key:
                out.append(key)
        return out

    def wait_for(self, assignment: str, timeout: float = 10.0) -> None:
        """Block until a line equal to ``assignment`` (or starting with it, for ``STATUS=``) arrived."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not any(line == assignment or (assignment.endswith("=") and line.startswith(assignment))
                          for msg in self.messages for line in msg.split("\n")):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{assignment!r} not received; got {self.messages!r}")
                self._cond.wait(left)
