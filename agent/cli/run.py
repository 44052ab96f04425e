"""``sysdra run``: the node agent daemon (see agent/service/daemon.py)."""

from __future__ import annotations

import asyncio

from agent.service.logs import setup_logging
from agent.settings import Settings, build_settings

# flag -> setting; values stay strings so a bad one is reported by Settings, naming the setting (exit 78)
VALUE_FLAGS = ("root", "node-name", "driver-name", "kubelet-dir", "cdi-dir", "cluster", "resync-interval", "debounce",
               "log-level", "log-format", "metrics-address", "rolling-update-uid", "device-metadata",
               "health-interval", "status-socket")
SWITCH_FLAGS = ("list-attributes", "pf-vf-exclusive", "taint-unhealthy")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("run", help="run the node agent: publish ResourceSlices and serve the kubelet")
    p.add_argument("--config", metavar="FILE", help="YAML config file (default $SYSDRA_CONFIG or /etc/sysdra/config.yaml)")
    for flag in VALUE_FLAGS:
        p.add_argument(f"--{flag}", dest=flag.replace("-", "_"), metavar=flag.split("-")[-1].upper())
    for flag in SWITCH_FLAGS:
        p.add_argument(f"--{flag}", dest=flag.replace("-", "_"), action="store_const", const=True, default=None)
    p.set_defaults(func=run)


def settings_from_args(args) -> Settings:
    flags = {name.replace("-", "_"): getattr(args, name.replace("-", "_"), None) for name in VALUE_FLAGS + SWITCH_FLAGS}
    return build_settings(flags, config_file=args.config)


def run(args) -> int:
    settings = settings_from_args(args)
    setup_logging(settings)
    from agent.service.daemon import serve

    return asyncio.run(serve(settings, reload_settings=lambda: settings_from_args(args)))
