"""What the running agent is doing, for ``sysdra status`` / ``sysdra doctor`` and STATUS=.

The daemon updates one :class:`StatusBoard`; :class:`StatusServer` serves its snapshot
as one JSON document per connection on a unix socket (mode 0600: claim names are not
for every local user). Protocol: connect, read until EOF, ``json.loads``. No request.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import socket
import stat
import time
from collections import Counter, deque

from agent.prepare.checkpoint_format import COMPLETED
from agent.service import devicemetrics, procstats
from agent.settings import DEFAULT_CONFIG_FILE, ConfigError, load_config_file

log = logging.getLogger("sysdra.daemon")

SOCKET_NAME = "status.sock"
RECENT_CLAIM_STATUS_FAILURES = 5  # kept for `sysdra status`; the count and the log have all of them
MAX_REASON = 300


def agent_version() -> str:
    try:
        from importlib.metadata import version

        return version("sysdra")
    except Exception:  # noqa: BLE001 - not installed (running from a checkout)
        return "unknown"


class StatusBoard:
    """Mutable state snapshot. All setters are cheap and loop-thread only.

    With ``metrics`` (an ``agent.service.metrics.Metrics``) the setters also update the
    matching gauges, so the daemon reports each fact once."""

    def __init__(self, node_name: str = "", driver_name: str = "", metrics=None, clock=time.time):
        self._clock = clock
        self.metrics = metrics
        self.started_at = clock()
        self.node_name = node_name
        self.driver_name = driver_name
        self.registration = {"state": "not_started", "error": None, "since": self.started_at}
        self.devices_by_kind: dict[str, int] = {}
        self.devices_by_health: dict[str, int] = {}
        self.unhealthy: list[dict] = []  # device, reason, message of each unhealthy device
        self._inventory = None  # the last one set: the hardware under prepared devices
        self._claims: dict[str, dict] = {}
        self._prepared: list[dict] | None = []
        self.publish = {"time": None, "result": None, "error": None, "devices": None, "slices": None}
        self.last_error: dict | None = None
        self.claim_status_enabled: bool | None = None  # None until the kubelet side starts
        self.claim_status_writes: dict[str, int] = {}  # result -> count (agent.kubeletplugin.statuswriter.RESULTS)
        self.claim_status_failed = 0
        self._claim_status_failures: deque[dict] = deque(maxlen=RECENT_CLAIM_STATUS_FAILURES)
        self.mps_daemons: list[dict] = []  # the MPS daemons supervised: gpu, daemon (pid or pod), state, restarts
        self.nri: dict = {"state": "disabled", "reason": "nri_socket is empty"}  # agent.nri.plugin.State.report()
        self._nri_waiting: list[dict] | None = []  # None: to be computed
        self._nri_told: set[str] = set()  # claims already logged as waiting for NRI
        if metrics is not None:
            metrics.set_registration("not_started")
            metrics.set_nri("disabled")

    # --- setters the daemon calls -------------------------------------------------------
    def set_registration(self, state: str, error: str | None = None) -> None:
        """``state``: not_started, waiting (socket up, kubelet has not called), registered, failed."""
        if state != self.registration["state"] or error != self.registration["error"]:
            self.registration = {"state": state, "error": error, "since": self._clock()}
        if error:
            self.record_error("registration", error)
        if self.metrics is not None:
            self.metrics.set_registration(state)

    def set_inventory(self, inventory, health: dict[str, str] | None = None,
                      faults: dict[str, tuple[str, str]] | None = None) -> None:
        """Device counts from a discovery Inventory; ``health``: device name -> state
        (devices missing from it count as unknown: never claim health we did not check);
        ``faults``: device -> (reason, message) of the unhealthy ones, MIG devices' own included."""
        new_inventory, self._inventory = inventory is not self._inventory, inventory
        self.devices_by_kind = dict(Counter(d.kind for d in inventory.devices))
        health = health or {}
        self.devices_by_health = dict(Counter(health.get(d.name, "unknown") for d in inventory.devices))
        self.unhealthy = [{"device": n, "reason": r, "message": m} for n, (r, m) in sorted((faults or {}).items())]
        if self.metrics is not None:
            self.metrics.set_published_devices(self.devices_by_kind)
            self.metrics.set_health(self.devices_by_health)
            self.metrics.set_unhealthy_devices(devicemetrics.unhealthy_rows(faults or {}))
            if new_inventory:  # (each health round sets the same one again)
                self.metrics.set_prepared_devices(self._claims, inventory)

    def set_prepared_claims(self, claims: dict[str, dict]) -> None:
        """Checkpoint-shaped ``{uid: {"namespace", "name", "state", "devices": [{"device": ...}]}}``.
        Called after every prepare: keeps a shallow copy, the list is built when asked for."""
        self._claims = dict(claims)
        self._prepared = None
        self._nri_told &= self._claims.keys()  # a claim prepared again (the next pod of a shared claim) is named again
        self._nri_changed()
        if self.metrics is not None:
            self.metrics.set_prepared_devices(self._claims, self._inventory)

    def set_nri(self, report: dict) -> None:
        """The NRI plugin's state (``agent.nri.plugin.State.report``), at every change."""
        self.nri = dict(report)
        if self.metrics is not None:
            self.metrics.set_nri(report.get("state", "failed"))
        if report.get("state") == "failed":
            self.record_error("nri", report.get("reason") or "failed")
        self._nri_changed()

    def _nri_changed(self) -> None:
        """Prepared NIC claims whose netdevs would move into their pods while NRI is not registered:
        the netdevs stay on the host. Each such claim is logged once (a WARNING, INFO with NRI off)."""
        self._nri_waiting = None
        state = self.nri.get("state")
        if self.metrics is not None:  # NRI off on purpose (nri_socket ""): nothing waits for it
            self.metrics.set_nri_claims_waiting(0 if state == "disabled" else len(self.nri_waiting))
        for c in self.nri_waiting:
            if c["uid"] not in self._nri_told:
                self._nri_told.add(c["uid"])
                log.log(logging.INFO if state == "disabled" else logging.WARNING,
                        "claim %s/%s prepared with netdev(s) %s to move into its pod, but NRI is %s (%s): a pod that "
                        "starts before the agent registers with the runtime runs without them, and they stay on the "
                        "host (sysdra doctor)", c["namespace"],
                        c["name"], ", ".join(c["netdevs"]), state, self.nri.get("reason") or "no reason given")

    @property
    def nri_waiting(self) -> list[dict]:
        if self._nri_waiting is None:
            self._nri_waiting = [] if self.nri.get("state") == "registered" else _unmoved(self._claims)
        return self._nri_waiting

    @property
    def prepared(self) -> list[dict]:
        if self._prepared is None:
            self._prepared = sorted(
                (
                    {
                        "uid": uid,
                        "namespace": c.get("namespace"),
                        "name": c.get("name"),
                        "state": c.get("state"),
                        "devices": [d.get("device") for d in c.get("devices") or []],
                    }
                    for uid, c in self._claims.items()
                ),
                key=lambda c: (c["namespace"] or "", c["name"] or "", c["uid"]),
            )
        return self._prepared

    def record_publish(self, ok: bool, error: str | None = None, devices: int | None = None, slices: int | None = None) -> None:
        self.publish = {"time": self._clock(), "result": "ok" if ok else "error", "error": None if ok else error,
                        "devices": devices, "slices": slices}
        if not ok:
            self.record_error("publish", error or "unknown error")

    def record_claim_status(self, namespace: str, name: str, uid: str, result: str, reason: str | None = None) -> None:
        """One finished status.devices write; a ``reason`` marks a failure (kept among the last few)."""
        self.claim_status_writes[result] = self.claim_status_writes.get(result, 0) + 1
        if reason is None:
            return
        self.claim_status_failed += 1
        reason = str(reason)[:MAX_REASON]
        self._claim_status_failures.append({"time": self._clock(), "namespace": namespace, "name": name, "uid": uid,
                                            "result": result, "reason": reason})
        self.record_error("claim status", f"{namespace}/{name}: {reason}")

    def set_mps_daemons(self, rows: list[dict]) -> None:
        self.mps_daemons = rows

    def record_error(self, where: str, message: str) -> None:
        self.last_error = {"time": self._clock(), "where": where, "message": str(message)[:500]}

    # --- reading ------------------------------------------------------------------------
    def snapshot(self) -> dict:
        return {
            "version": agent_version(),
            "pid": os.getpid(),
            "startedAt": self.started_at,
            "now": self._clock(),
            "nodeName": self.node_name,
            "driverName": self.driver_name,
            "registration": dict(self.registration),
            "devices": {"byKind": dict(self.devices_by_kind), "byHealth": dict(self.devices_by_health),
                        "total": sum(self.devices_by_kind.values()), "unhealthy": list(self.unhealthy)},
            "preparedClaims": {"count": len(self.prepared), "claims": list(self.prepared)},
            "lastPublish": dict(self.publish),
            "claimStatus": {"enabled": self.claim_status_enabled, "writes": dict(self.claim_status_writes),
                            "failed": self.claim_status_failed,
                            "recentFailures": [dict(f) for f in reversed(list(self._claim_status_failures))]},  # newest first
            "mpsDaemons": [dict(r) for r in self.mps_daemons],
            "nri": {**self.nri, "claimsWaiting": [dict(c) for c in self.nri_waiting]},
            "lastError": dict(self.last_error) if self.last_error else None,
            "process": procstats.usage(),
        }

    def summary(self) -> str:
        """One line for sd_notify ``STATUS=`` (shown by ``systemctl status``)."""
        total = sum(self.devices_by_kind.values())
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.devices_by_kind.items()))
        parts = [self.registration["state"].replace("_", " "), f"{total} devices" + (f" ({kinds})" if kinds else ""),
                 f"{len(self.prepared)} claims prepared"]
        if self.publish["time"] is not None:
            ago = max(0, int(self._clock() - self.publish["time"]))
            parts.append(f"last publish {self.publish['result']} {ago}s ago")
        if self.claim_status_failed:
            parts.append(f"{self.claim_status_failed} claim status writes failed")
        if self.nri.get("state") == "failed":
            parts.append("NRI failed (sysdra status)")
        return "; ".join(parts)


def _unmoved(claims: dict[str, dict]) -> list[dict]:
    """Prepared claims (checkpoint-shaped) with netdevs still on the host (``planned``)."""
    out = []
    for uid, c in claims.items():
        netdevs = [m.get("host") for m in c.get("netdevs") or () if isinstance(m, dict) and m.get("state", "planned") == "planned"]
        if netdevs and c.get("state") == COMPLETED:
            out.append({"uid": uid, "namespace": c.get("namespace"), "name": c.get("name"), "netdevs": netdevs})
    return sorted(out, key=lambda c: (c["namespace"] or "", c["name"] or "", c["uid"]))


def status_socket_path(settings) -> str:
    """The socket for a :class:`agent.settings.Settings`."""
    return settings.status_socket or os.path.join(settings.plugin_dir, SOCKET_NAME)


def resolve_status_socket(socket_path: str | None = None, kubelet_dir: str | None = None, driver_name: str | None = None,
                          config_file: str | None = None, environ: dict | None = None) -> str:
    """Where a client finds the agent: flag > SYSDRA_* env > config file > default.

    Works without building full Settings, so a host name that is no valid node name
    (or any other unrelated bad setting) does not stop ``sysdra status``."""
    env = os.environ if environ is None else environ
    try:
        config = load_config_file(config_file or env.get("SYSDRA_CONFIG") or DEFAULT_CONFIG_FILE)
    except ConfigError:
        config = {}

    def pick(flag, name, default):
        return flag or env.get("SYSDRA_" + name.upper()) or config.get(name) or default

    explicit = pick(socket_path, "status_socket", None)
    if explicit:
        return str(explicit)
    kdir = pick(kubelet_dir, "kubelet_dir", "/var/lib/kubelet")
    driver = pick(driver_name, "driver_name", "sysdra.io")
    return os.path.join(str(kdir), "plugins", str(driver), SOCKET_NAME)


class StatusServer:
    """Serves ``board.snapshot()`` on ``path``; ``await start()``, ``await close()``."""

    def __init__(self, board: StatusBoard, path: str):
        self.board = board
        self.path = path
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        sock = _bind_private(self.path)
        self._server = await asyncio.start_unix_server(self._handle, sock=sock)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(json.dumps(self.board.snapshot()).encode() + b"\n")
            await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        try:
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)
        except FileNotFoundError:
            pass


def _bind_private(path: str) -> socket.socket:
    """A listening socket at ``path`` with mode 0600 from the start (fchmod before bind
    gives the socket file that mode on Linux; chmod after bind covers other kernels).
    A stale socket (nobody listening) is replaced; any other file is left alone."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise OSError(errno.EEXIST, f"{path} exists and is not a socket; remove it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
            raise OSError(errno.EADDRINUSE, f"{path}: another agent is already serving status")
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.fchmod(sock.fileno(), 0o600)
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(16)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class AgentNotRunning(Exception):
    """Nobody answers on the status socket; the message says what was tried."""


def query_status(path: str, timeout: float = 3.0) -> dict:
    """Ask the running agent (blocking; for the CLI)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(path)
        except FileNotFoundError:
            raise AgentNotRunning(f"no status socket at {path}: is the agent running? (systemctl status sysdra)") from None
        except ConnectionRefusedError:
            raise AgentNotRunning(f"nobody listens on {path}: the agent is not running (stale socket)") from None
        except PermissionError:
            raise AgentNotRunning(f"permission denied on {path}: run as root") from None
        except OSError as err:
            raise AgentNotRunning(f"cannot connect to {path}: {err.strerror or err}") from None
        chunks = []
        while True:
            try:
                data = sock.recv(65536)
            except socket.timeout:
                raise AgentNotRunning(f"the agent at {path} did not answer within {timeout:g}s (event loop stuck?)") from None
            if not data:
                break
            chunks.append(data)
    finally:
        sock.close()
    try:
        return json.loads(b"".join(chunks))
    except ValueError:
        raise AgentNotRunning(f"{path} answered something that is not a status document") from None
