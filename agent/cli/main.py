"""``sysdra`` command line. Each subcommand lives in its own ``agent/cli/<name>.py`` module
with ``add_parser(subparsers)`` and ``run(args) -> int``; this file only dispatches.

Building the parser imports every subcommand module, so those import what their command
needs inside ``run``: ``sysdra scan`` never pays for settings, gRPC or the API client."""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import sys

# Subcommands in help order; each is the module agent/cli/<name>.py.
COMMANDS = ("scan", "run", "status", "doctor", "record", "metadata")


def _commands() -> dict[str, str]:
    found = {}
    for name in COMMANDS:
        mod = f"agent.cli.{name}"
        if importlib.util.find_spec(mod) is not None:
            found[name] = mod
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sysdra", description="Kubernetes DRA node agent for GPUs, NICs, FPGAs and accelerators")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _commands().values():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    was = gc.isenabled()
    gc.disable()  # the subcommand modules' imports make no cycles; collecting them cost ~4 %
    try:
        parser = build_parser()
    finally:
        if was:
            gc.enable()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except Exception as err:
        settings = sys.modules.get("agent.settings")  # only a command that loaded settings can raise ConfigError
        if settings is not None and isinstance(err, settings.ConfigError):
            print(f"sysdra: {err}", file=sys.stderr)
            return settings.EX_CONFIG
        raise


if __name__ == "__main__":
    sys.exit(main())
