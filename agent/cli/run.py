"""``sysdra run``: the node agent daemon (see agent/service/daemon.py)."""

from __future__ import annotations

# flag -> setting; values stay strings so a bad one is reported by Settings, naming the setting (exit 78)
VALUE_FLAGS = ("root", "node-name", "driver-name", "kubelet-dir", "cdi-dir", "cluster", "resync-interval", "debounce",
               "log-level", "log-format", "metrics-address", "rolling-update-uid", "device-metadata",
               "health-interval", "status-socket")
SWITCH_FLAGS = ("list-attributes", "pf-vf-exclusive", "taint-unhealthy")
# One line each; docs/operations.md has the whole story of every setting.
HELP = {
    "root": "host root to discover hardware under (default /; a fixture tree for tests and demos)",
    "node-name": "Kubernetes node name: the pool name and the slices' owner (default $NODE_NAME or the hostname)",
    "driver-name": "DRA driver name in slices, claims and CDI kinds (default sysdra.io)",
    "kubelet-dir": "kubelet root directory; resolved once at start (default /var/lib/kubelet)",
    "cdi-dir": "directory the container runtime reads CDI specs from; resolved once at start (default /var/run/cdi)",
    "cluster": "'kube' (the API server, in-cluster or kubeconfig) or 'dir:PATH' (offline: slices and claims as files)",
    "resync-interval": "seconds between full rescans and slice resyncs (default 300; 0 disables)",
    "debounce": "seconds to let a burst of hardware events settle before rescanning (default 0.25)",
    "log-level": "debug, info, warning or error (default info)",
    "log-format": "text or json (default text)",
    "metrics-address": "HOST:PORT of the Prometheus /metrics endpoint (default 127.0.0.1:9478; empty disables)",
    "rolling-update-uid": "this pod's UID, so two agents of a rolling update serve their own sockets",
    "device-metadata": "write KEP-5304 device metadata files for prepared claims: true or false (default true)",
    "health-interval": "seconds between device health re-checks, at most 10 (default 10)",
    "status-socket": "unix socket of `sysdra status` (default <plugin dir>/status.sock)",
    "list-attributes": "publish list-typed attributes (needs the DRAListTypeAttributes gate on the cluster)",
    "pf-vf-exclusive": "publish per-PF counters so a PF and its VFs are never allocated together (partitionable devices)",
    "taint-unhealthy": "publish unhealthy devices with a NoSchedule device taint sysdra.io/unhealthy",
}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("run", help="run the node agent: publish ResourceSlices and serve the kubelet")
    p.add_argument("--config", metavar="FILE", help="YAML config file (default $SYSDRA_CONFIG or /etc/sysdra/config.yaml)")
    for flag in VALUE_FLAGS:
        p.add_argument(f"--{flag}", dest=flag.replace("-", "_"), metavar=flag.split("-")[-1].upper(), help=HELP[flag])
    for flag in SWITCH_FLAGS:
        p.add_argument(f"--{flag}", dest=flag.replace("-", "_"), action="store_const", const=True, default=None,
                       help=HELP[flag])
    p.set_defaults(func=run)


def settings_from_args(args):
    """-> Settings from the flags, the environment and the config file."""
    from agent.settings import build_settings

    flags = {name.replace("-", "_"): getattr(args, name.replace("-", "_"), None) for name in VALUE_FLAGS + SWITCH_FLAGS}
    return build_settings(flags, config_file=args.config)


def run(args) -> int:
    import asyncio
    import sys

    from agent.service.logs import setup_logging

    settings = settings_from_args(args)
    setup_logging(settings)
    from agent.service.daemon import serve

    from agent.service.startup import StartupError

    try:
        return asyncio.run(serve(settings, reload_settings=lambda: settings_from_args(args)))
    except StartupError as err:  # one line and a documented exit code (docs/operations.md)
        print(f"sysdra: {err}", file=sys.stderr)
        return err.code
