"""``sysdra`` command line. Each subcommand lives in its own ``agent/cli/<name>.py`` module
with ``add_parser(subparsers)`` and ``run(args) -> int``; this file only dispatches.

A command line that names its command builds that command's parser only (the others'
modules are not imported, their flags not defined); ``sysdra --help`` and a mistyped
command build them all. Subcommand modules import what their command needs inside
``run``: ``sysdra scan`` never pays for settings, gRPC or the API client."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Subcommands in help order; each is the module agent/cli/<name>.py.
COMMANDS = ("scan", "run", "status", "doctor", "health", "record", "metadata")


class _Version(argparse.Action):
    """``--version``: the installed distribution's version, looked up only when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("sysdra")
        except PackageNotFoundError:  # run from a source tree that was never installed
            found = "unknown"
        sys.stdout.write(f"sysdra {found}\n")  # on stdout, as argparse's own version action
        parser.exit()


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of ``command`` alone (it parses that command's
    arguments as the whole parser does)."""
    parser = argparse.ArgumentParser(prog="sysdra", description="Kubernetes DRA node agent for GPUs, NICs, FPGAs and accelerators")
    parser.add_argument("--version", action=_Version, help="print the version and exit")
    # prog given: argparse would otherwise format the main parser's usage line to make one
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", prog="sysdra")
    for name in (command,) if command in COMMANDS else COMMANDS:
        importlib.import_module(f"agent.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None, *, own_process: bool = False) -> int:
    """Run one command and return its exit status. ``own_process`` (the ``sysdra`` command):
    a command that asks for it (``quick_exit``, e.g. ``scan``) ends the process when done, and
    commands may tune the process's heap (``agent.service.heap.freeze_startup``)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    args.own_process = own_process
    try:
        status = int(args.func(args) or 0)
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
    if own_process and getattr(args, "quick_exit", False):
        _quick_exit(status)
    return status


def _quick_exit(status: int) -> None:
    """End a command that has written all it had to, without the interpreter's teardown, which
    would free a large node's inventory and its JSON object by object for a process that is
    about to end anyway. Only for commands with no atexit work and no file left open; their
    output is flushed here."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # the reader left: as main's own handler, not an error
        pass
    os._exit(status)


def entry() -> None:
    """The ``sysdra`` command and ``python -m agent``."""
    sys.exit(main(own_process=True))


if __name__ == "__main__":
    entry()
