"""``sysdra scan``: what discovery sees on this node (or a fixture root)."""

from __future__ import annotations

import json
import sys

from discovery.inventory import scan
from discovery.models import Inventory
from discovery.render import render_table, render_tree


def add_parser(sub) -> None:
    p = sub.add_parser("scan", help="discover devices and print them")
    p.add_argument("--root", default="/", help="host root to scan (default /)")
    p.add_argument("--list-attributes", action="store_true", help="publish list-typed attributes (cluster has DRAListTypeAttributes)")
    p.add_argument("-o", "--output", choices=("table", "tree", "json", "slices"), default="table")
    p.add_argument("--node-name", default=None, help="node name for -o slices (default $NODE_NAME or hostname)")
    p.add_argument("--driver-name", default=None, help="driver name for -o slices (default sysdra.io)")
    p.set_defaults(func=run)


def _slices(inv: Inventory, args) -> dict:
    from agent.settings import build_settings
    from agent.publish.slices import slices_list

    flags = {"root": args.root, "list_attributes": args.list_attributes, "node_name": args.node_name, "driver_name": args.driver_name}
    return slices_list(inv, build_settings(flags))


def run(args) -> int:
    try:
        inv = scan(args.root, list_attributes=args.list_attributes)
    except FileNotFoundError as err:
        print(f"sysdra scan: {err}", file=sys.stderr)
        return 2
    out = sys.stdout
    if args.output == "json":
        json.dump(inv.to_json(), out, indent=2)
        out.write("\n")
    elif args.output == "slices":
        json.dump(_slices(inv, args), out, indent=2)
        out.write("\n")
    elif args.output == "tree":
        out.write(render_tree(inv))
    else:
        out.write(render_table(inv))
    return 0
