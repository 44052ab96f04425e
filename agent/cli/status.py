"""``sysdra status``: ask the running agent over its status socket and print the answer."""

from __future__ import annotations

import json
import sys
import time


def add_parser(sub) -> None:
    p = sub.add_parser("status", help="show what the running agent is doing")
    p.add_argument("--socket", help="status socket (default: status_socket setting, else <kubelet-dir>/plugins/<driver>/status.sock)")
    p.add_argument("--kubelet-dir", help="kubelet root directory (default /var/lib/kubelet)")
    p.add_argument("--driver-name", help="driver name (default sysdra.io)")
    p.add_argument("--config", metavar="FILE", help="config file to take the socket from (default /etc/sysdra/config.yaml)")
    p.add_argument("-o", "--output", choices=("text", "json"), default="text")
    # the agent's event loop answers: no answer within this is a wedged loop (the DaemonSet's liveness probe)
    p.add_argument("--timeout", type=_seconds, default=3.0, metavar="SECONDS", help="how long to wait for the answer (default 3)")
    # the DaemonSet's readiness: a surge update removes the old pod only once the new one is registered
    # with the kubelet and called by the runtime's NRI
    p.add_argument("--registered", action="store_true",
                   help="exit 1 unless the kubelet has registered the agent and the runtime has synchronized its NRI "
                        "plugin, or said it has no NRI (its readiness), saying why on stderr")
    p.set_defaults(func=run)


def _seconds(text: str) -> float:
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value <= 3600):
        raise argparse.ArgumentTypeError(f"not a number of seconds between 0 and 3600: {text!r}")
    return value


def _ago(now: float, then: float | None) -> str:
    if then is None:
        return "never"
    secs = max(0, int(now - then))
    return f"{secs}s ago" if secs < 120 else f"{secs // 60}m ago" if secs < 7200 else f"{secs // 3600}h ago"


def _counts(counts: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"


def _one_line(text) -> str:
    """A reason from a server or a file: never more than one line of our output."""
    return " ".join(str(text).split())


def _claim(c: dict) -> str:
    """A prepared claim as listed: ``namespace/name (uid)``; an adopted one, its name not known yet, by its UID."""
    if not c.get("name"):
        return f"{c.get('uid')} (adopted from its CDI spec, not prepared again by the kubelet yet)"
    return f"{c.get('namespace')}/{c.get('name')} ({c.get('uid')})"


_FAILURE_NAMES = {"invalid": "invalid entries", "failed": "retries exhausted"}  # "refused" says itself


def _claim_status_lines(now: float, cs: dict) -> list[str]:
    if cs.get("enabled") is False:
        return ["claim status: off (claim_status: false)"]
    writes = cs.get("writes") or {}
    failed = cs.get("failed", 0)
    how = ", ".join(f"{_FAILURE_NAMES.get(r, r)} {n}" for r, n in sorted(writes.items()) if r not in ("written", "unchanged"))
    lines = [f"claim status: {writes.get('written', 0)} written, {writes.get('unchanged', 0)} unchanged, "
             f"{failed} failed" + (f" ({how})" if failed and how else "")]
    for f in cs.get("recentFailures") or []:
        lines.append(f"  {f.get('namespace')}/{f.get('name')} {f.get('result')} {_ago(now, f.get('time'))}: "
                     f"{_one_line(f.get('reason'))}")
    return lines


def _nri_lines(now: float, nri: dict) -> list[str]:
    state = nri.get("state")
    if state == "registered":
        line = f"nri:          registered with {nri.get('runtime') or 'the runtime'} on {nri.get('socket')} since {_ago(now, nri.get('since'))}"
    else:
        line = f"nri:          {state}" + (f" since {_ago(now, nri['since'])}" if nri.get("since") else "")
        line += f": {_one_line(nri['reason'])}" if nri.get("reason") else ""
    lines = [line]
    for c in nri.get("claimsWaiting") or []:
        lines.append(f"  {_claim(c)}: netdev(s) {', '.join(map(str, c.get('netdevs') or []))} "
                     "stay on the host (NRI not registered)")
    return lines


def render_text(s: dict) -> str:
    now = s.get("now") or time.time()
    reg = s.get("registration") or {}
    dev = s.get("devices") or {}
    claims = s.get("preparedClaims") or {}
    pub = s.get("lastPublish") or {}
    err = s.get("lastError")
    lines = [
        f"agent:        sysdra {s.get('version')} (pid {s.get('pid')}), up {_ago(now, s.get('startedAt')).removesuffix(' ago')}",
        f"node/driver:  {s.get('nodeName')} / {s.get('driverName')}",
        f"registration: {reg.get('state')} since {_ago(now, reg.get('since'))}" + (f" ({reg['error']})" if reg.get("error") else ""),
        f"devices:      {dev.get('total', 0)} ({_counts(dev.get('byKind') or {})})",
        f"health:       {_counts(dev.get('byHealth') or {})}",
    ]
    lines += [f"  {u.get('device')}: {u.get('reason')}: {u.get('message')}" for u in dev.get("unhealthy") or ()]
    lines.append(f"claims:       {claims.get('count', 0)} prepared")
    for c in claims.get("claims") or []:
        lines.append(f"  {_claim(c)} {c.get('state')}: {', '.join(map(str, c.get('devices') or [])) or '-'}")
    if pub.get("time") is None:
        lines.append("last publish: never")
    else:
        detail = f" ({pub['devices']} devices in {pub['slices']} slices)" if pub.get("devices") is not None else ""
        lines.append(f"last publish: {pub.get('result')} {_ago(now, pub['time'])}{detail}" + (f": {pub['error']}" if pub.get("error") else ""))
    if s.get("claimStatus") is not None:  # (an older agent's document has none)
        lines += _claim_status_lines(now, s["claimStatus"])
    if daemons := s.get("mpsDaemons"):
        lines.append(f"mps daemons:  {len(daemons)}")
        lines += [f"  {d.get('gpu')}: {d.get('daemon')}, {d.get('state')} ({d.get('restarts')} restarts in the window)"
                  + (f", Exclusive_Process (was {d['modeBefore']})" if d.get("modeBefore") else "") for d in daemons]
    if s.get("nri") is not None:  # (an older agent's document has none)
        lines += _nri_lines(now, s["nri"])
    lines.append(f"last error:   {err['where']}: {err['message']} ({_ago(now, err['time'])})" if err else "last error:   none")
    if proc := s.get("process"):  # (an older agent's document has none)
        lines.append(f"process:      {proc['rssBytes'] / 2**20:.1f} MB resident, {proc['cpuSeconds']:.1f} s CPU, "
                     f"{proc['threads']} threads, {proc['openFds']} of {proc['maxFds']} file descriptors")
    return "\n".join(lines) + "\n"


def run(args) -> int:
    from agent.service.status import AgentNotRunning, query_status, resolve_status_socket

    path = resolve_status_socket(args.socket, args.kubelet_dir, args.driver_name, args.config)
    try:
        status = query_status(path, timeout=args.timeout)
    except AgentNotRunning as err:
        print(f"sysdra status: {err}", file=sys.stderr)
        return 1
    if args.registered:
        return _registered(status)
    if args.output == "json":
        json.dump(status, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_text(status))
    return 0


def _registered(status: dict) -> int:
    reg = status.get("registration") or {}
    if reg.get("state") != "registered":
        why = f" ({_one_line(reg['error'])})" if reg.get("error") else ""
        print(f"sysdra status: not registered with the kubelet: {reg.get('state')}{why}", file=sys.stderr)
        return 1
    # containerd calls a plugin only once it synchronized it, which it holds back while pods start or
    # stop: until then a surge update's old instance is the one that moves claimed NICs (docs/networking.md)
    nri = status.get("nri") or {}
    if nri.get("state") in ("connecting", "registered") and not nri.get("synchronized"):
        print(f"sysdra status: NRI plugin not synchronized by the runtime yet: {nri['state']} on {nri.get('socket')} "
              "(pods it starts meanwhile would not get their netdevs from this instance)", file=sys.stderr)
        return 1
    # failed: ready where the socket is missing (no NRI in the runtime, as for the instance before); one that is
    # there and refuses or may not be opened is NRI this instance does not reach ("noSocket" absent: an older agent's)
    if nri.get("state") == "failed" and nri.get("noSocket") is False:
        print(f"sysdra status: NRI plugin cannot reach the runtime's NRI: {_one_line(nri.get('reason'))} (pods it "
              "starts meanwhile would not get their netdevs from this instance)", file=sys.stderr)
        return 1
    return 0
