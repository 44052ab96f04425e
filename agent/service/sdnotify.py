"""sd_notify(3) without a dependency: readiness, status, watchdog and stop messages.

Every function is a no-op when ``$NOTIFY_SOCKET`` is unset (not started by systemd),
and never raises: losing a notification must not take the agent down. The watchdog
ping comes from a task on the agent's own event loop, so a blocked loop stops the
pings and systemd restarts the service (``WatchdogSec=`` in systemd/sysdra.service).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

log = logging.getLogger("sysdra.sdnotify")


def _address(environ=None) -> str | None:
    path = (os.environ if environ is None else environ).get("NOTIFY_SOCKET")
    if not path:
        return None
    if path.startswith("@"):  # abstract namespace
        return "\0" + path[1:]
    return path


def enabled(environ=None) -> bool:
    """Whether systemd listens (``$NOTIFY_SOCKET`` is set)."""
    return _address(environ) is not None


def notify(*lines: str, environ=None) -> bool:
    """Send ``KEY=VALUE`` lines in one datagram; True if it was sent."""
    address = _address(environ)
    if address is None:
        return False
    payload = "\n".join(lines).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(payload)
        return True
    except OSError as err:
        log.debug("sd_notify %r failed: %s", lines, err)
        return False


def ready(status: str | None = None) -> bool:
    return notify("READY=1", *([f"STATUS={_one_line(status)}"] if status else []))


def status(text: str) -> bool:
    return notify(f"STATUS={_one_line(text)}")


def watchdog() -> bool:
    return notify("WATCHDOG=1")


def stopping(status: str | None = None) -> bool:
    return notify("STOPPING=1", *([f"STATUS={_one_line(status)}"] if status else []))


def _one_line(text: str) -> str:
    # a newline would start a new KEY=VALUE assignment in the datagram
    return " ".join(str(text).split())


def watchdog_interval(environ=None) -> float | None:
    """Seconds of ``WatchdogSec=`` if the watchdog is meant for this process, else None."""
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid and pid.isascii() and pid.isdigit() and int(pid) != os.getpid():
        return None  # set for another process (e.g. inherited by a child)
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 1e6 if value > 0 else None


async def watchdog_loop(interval: float | None = None) -> None:
    """Ping ``WATCHDOG=1`` at half the interval until cancelled; returns at once if
    there is no watchdog. Run it with ``asyncio.create_task`` on the main loop."""
    interval = watchdog_interval() if interval is None else interval
    if not interval or _address() is None:
        return
    period = interval / 2
    while True:
        watchdog()
        await asyncio.sleep(period)


def start_watchdog(loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Task | None:
    """Start :func:`watchdog_loop` as a task if the watchdog is enabled; None otherwise."""
    if watchdog_interval() is None or _address() is None:
        return None
    loop = loop or asyncio.get_running_loop()
    return loop.create_task(watchdog_loop(), name="sd-watchdog")
