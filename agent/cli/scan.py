"""``sysdra scan``: what discovery sees on this node (or a fixture root)."""

from __future__ import annotations

import json
import sys

import orjson

from discovery.inventory import scan
from discovery.models import Inventory


def add_parser(sub) -> None:
    p = sub.add_parser("scan", help="discover devices and print them")
    p.add_argument("--root", default="/", help="host root to scan (default /)")
    p.add_argument("--list-attributes", action="store_true", help="publish list-typed attributes (cluster has DRAListTypeAttributes)")
    p.add_argument("-o", "--output", choices=("table", "tree", "json", "slices"), default="table")
    p.add_argument("--node-name", default=None, help="node name for -o slices (default $NODE_NAME or hostname)")
    p.add_argument("--driver-name", default=None, help="driver name for -o slices (default sysdra.io)")
    p.set_defaults(func=run)


def _slices(inv: Inventory, args) -> dict:
    from agent.publish.slices import slices_list
    from agent.settings import build_settings

    flags = {"root": args.root, "list_attributes": args.list_attributes, "node_name": args.node_name, "driver_name": args.driver_name}
    return slices_list(inv, build_settings(flags))


def json_text(obj: object) -> bytes:
    """Indented JSON and a newline, by orjson (~10x json's encoder); what orjson does not
    take (integers past 64 bits from a garbled attribute) goes through json."""
    try:
        return orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE)
    except TypeError:
        return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()


def _write(data: bytes) -> None:
    """The whole output in one write: stdout may be unbuffered (PYTHONUNBUFFERED, python -u),
    and json.dump's thousands of small writes were then as many system calls."""
    out = sys.stdout
    buf = getattr(out, "buffer", None)
    if buf is None:
        out.write(data.decode())
        return
    out.flush()
    buf.write(data)
    buf.flush()


def run(args) -> int:
    try:
        inv = scan(args.root, list_attributes=args.list_attributes)
    except FileNotFoundError as err:
        print(f"sysdra scan: {err}", file=sys.stderr)
        return 2
    if args.output == "json":
        _write(json_text(inv.to_json()))
    elif args.output == "slices":
        _write(json_text(_slices(inv, args)))
    else:
        from discovery.render import render_table, render_tree

        _write((render_tree(inv) if args.output == "tree" else render_table(inv)).encode())
    return 0
