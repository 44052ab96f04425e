"""``sysdra record OUT``: capture what discovery reads on this node into a replayable tree."""

from __future__ import annotations

import sys


def add_parser(sub) -> None:
    p = sub.add_parser("record", help="record this node's /sys, /proc and /dev as seen by discovery (for bug reports)")
    p.add_argument("out", metavar="OUT", help="directory to create (must be empty or missing)")
    p.add_argument("--root", default="/", help="host root to record (default /)")
    p.add_argument("--redact", action="store_true", help="replace MAC addresses, GUIDs, UUIDs and serial numbers with consistent fakes")
    p.set_defaults(func=run)


def run(args) -> int:
    from agent.tools.record import record

    try:
        rec = record(args.out, args.root, redact=args.redact)
    except (FileExistsError, ValueError, FileNotFoundError) as err:
        print(f"sysdra record: {err}", file=sys.stderr)
        return 2
    print(f"recorded {rec.files} text files, {rec.links} symlinks, {rec.dirs} directories, "
          f"{rec.placeholders} placeholders, {len(rec.devnodes)} device nodes into {rec.out}")
    if rec.skipped:
        print(f"left out {len(rec.skipped)} unreadable or non-text files (see {rec.out}/.sysdra-record/skipped)")
    print(f"check it: sysdra scan --root {rec.out}" + ("" if args.redact else "   (add --redact before sharing it)"))
    return 0
