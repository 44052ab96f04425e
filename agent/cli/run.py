"""``sysdra run``: the node agent daemon (see agent/service/daemon.py)."""

from __future__ import annotations

from agent.cli import publishing

# flag -> setting; values stay strings so a bad one is reported by Settings, naming the setting (exit 78).
# The publishing flags (what goes into the slices) are agent/cli/publishing.py's, shared with `sysdra scan`.
VALUE_FLAGS = ("root", "kubelet-dir", "cdi-dir", "cluster", "resync-interval", "debounce",
               "log-level", "log-format", "metrics-address", "rolling-update-uid", "device-metadata",
               "claim-status", "health-interval", "status-socket", "nvidia-cdi-spec", "cdi-host-root", "nri-socket",
               "cdi-additional-gids")
SWITCH_FLAGS: tuple[str, ...] = ("allow-host-in-use-nics",)
# One line each; docs/operations.md has the whole story of every setting.
HELP = {
    "root": "host root to discover hardware under (default /; a fixture tree for tests and demos)",
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
    "claim-status": "write status.devices of prepared claims: true or false (default true)",
    "health-interval": "seconds between device health re-checks, at most 10 (default 10)",
    "nvidia-cdi-spec": "give NVIDIA GPUs the devices of the node's own NVIDIA CDI spec (nvidia-ctk) instead of the driver in ours: true or false",
    "cdi-host-root": "the host's / as the container runtime sees it, for host paths in CDI specs (default /; a fixture tree in tests)",
    "nri-socket": "the container runtime's NRI socket, where the agent registers as a plugin (default /var/run/nri/nri.sock; empty disables)",
    "allow-host-in-use-nics": "a claim whose NicConfig/VfioConfig says allowHostInUse may take a NIC the host uses (an address, a bond or bridge port)",
    "cdi-additional-gids": "on: claim specs add the host groups of group-owned device nodes (additionalGids, CDI 0.7: "
                           "containerd >= 1.7.16, CRI-O >= 1.30, podman >= 5.1); off (default): not written",
    "status-socket": "unix socket of `sysdra status` (default <plugin dir>/status.sock)",
}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("run", help="run the node agent: publish ResourceSlices and serve the kubelet")
    p.add_argument("--config", metavar="FILE", help="YAML config file (default $SYSDRA_CONFIG or /etc/sysdra/config.yaml)")
    for flag in VALUE_FLAGS:
        publishing.add_value_flag(p, flag, HELP[flag])
    for flag in SWITCH_FLAGS:
        publishing.add_switch_flag(p, flag, HELP[flag])
    publishing.add_publishing_flags(p)
    p.set_defaults(func=run)


def settings_from_args(args):
    """-> Settings from the flags, the environment and the config file."""
    from agent.settings import build_settings

    flags = {publishing.dest(name): getattr(args, publishing.dest(name), None) for name in VALUE_FLAGS + SWITCH_FLAGS}
    flags.update(publishing.publishing_values(args))
    return publishing.checked(build_settings(flags, config_file=args.config))


def run(args) -> int:
    import asyncio
    import sys

    from agent.service.logs import setup_logging

    settings = settings_from_args(args)
    setup_logging(settings)
    from agent.service.daemon import serve
    from agent.service.heap import freeze_startup
    from agent.service.startup import StartupError

    if args.own_process:
        freeze_startup()
    try:
        return asyncio.run(serve(settings, reload_settings=lambda: settings_from_args(args)))
    except StartupError as err:  # one line and a documented exit code (docs/operations.md)
        print(f"sysdra: {err}", file=sys.stderr)
        return err.code
