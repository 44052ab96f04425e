"""``sysdra doctor``: find what keeps the agent from working on this node, and say how to fix it."""

from __future__ import annotations

import json
import sys


_MARK = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "skip": "skip"}


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="check kubelet sockets, registration, NRI, containerd's config, CDI specs, metadata, "
                                      "kept GPU faults, API access and clock")
    p.add_argument("--config", metavar="FILE", help="config file (default $SYSDRA_CONFIG or /etc/sysdra/config.yaml)")
    p.add_argument("--kubelet-dir", help="kubelet root directory (default /var/lib/kubelet)")
    p.add_argument("--driver-name", help="driver name (default sysdra.io)")
    p.add_argument("--node-name", help="node name (default $NODE_NAME or the host name)")
    p.add_argument("--cdi-dir", action="append", help="CDI spec directory to check (repeatable; default the agent's plus /etc/cdi)")
    p.add_argument("--cluster", help="'kube' (check the API server) or 'dir:PATH' (offline: API checks skipped)")
    p.add_argument("--rolling-update-uid", help="pod UID the agent runs with (changes the socket names)")
    p.add_argument("--status-socket", help="the agent's status socket")
    p.add_argument("--no-api", action="store_true", help="skip the API server checks")
    p.add_argument("--root", help="host root (default /): its boot ID, and its etc/containerd/config.toml")
    p.add_argument("--containerd-config", metavar="FILE", help="containerd's config (default <root>/etc/containerd/config.toml)")
    p.add_argument("-o", "--output", choices=("text", "json"), default="text")
    p.set_defaults(func=run)


def _settings(args):
    """-> (Settings, the config Finding)."""
    from agent.settings import ConfigError, Settings, build_settings
    from agent.tools.findings import Finding

    flags = {"kubelet_dir": args.kubelet_dir, "driver_name": args.driver_name, "node_name": args.node_name,
             "cluster": args.cluster, "rolling_update_uid": args.rolling_update_uid, "root": args.root}
    from agent.cli.publishing import checked

    try:  # as `sysdra run` judges them (share policies too)
        return checked(build_settings(flags, config_file=args.config)), Finding("config", "ok", "settings are valid")
    except ConfigError as err:
        finding = Finding("config", "fail", str(err), "fix the setting named above (sysdra run would exit with 78)")
    # go on with what we can: the defaults plus the flags that are valid on their own
    base = {"node_name": "localhost"}
    for key, value in flags.items():
        if value is not None:
            try:
                Settings.of({**base, key: value})
                base[key] = value
            except ConfigError:
                pass
    return Settings.of(base), finding


def run(args) -> int:
    from agent.service.status import resolve_status_socket
    from agent.tools.doctor import run_all

    settings, config_finding = _settings(args)
    status_socket = resolve_status_socket(args.status_socket, settings.kubelet_dir, settings.driver_name, args.config)
    cdi_dirs = args.cdi_dir or [settings.cdi_dir, "/etc/cdi"]
    findings = [config_finding] + run_all(settings, status_socket, cdi_dirs, api=not args.no_api,
                                          containerd_config=args.containerd_config)
    if args.output == "json":
        json.dump([f.__dict__ for f in findings], sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        for f in findings:
            print(f"[{_MARK.get(f.level, f.level)}] {f.check}: {f.message}")
            if f.fix and f.level in ("warn", "fail"):
                print(f"       fix: {f.fix}")
        fails = sum(f.level == "fail" for f in findings)
        warns = sum(f.level == "warn" for f in findings)
        print(f"{fails} problem(s), {warns} warning(s)")
    return 1 if any(f.level == "fail" for f in findings) else 0
