"""``sysdra`` command line. Each subcommand lives in its own ``agent/cli/<name>.py`` module
with ``add_parser(subparsers)`` and ``run(args) -> int``; this file only dispatches."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from agent.settings import EX_CONFIG, ConfigError

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
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as err:
        print(f"sysdra: {err}", file=sys.stderr)
        return EX_CONFIG
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
