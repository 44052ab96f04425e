"""``sysdra metadata``: KEP-5304 device metadata tools.

``update`` is for runtime hooks (an NRI plugin, an OCI hook after the sandbox network
exists): it sets a device's network data and rewrites the request's metadata with
``generation + 1`` (docs/device-metadata.md). ``show`` decodes a metadata file like a
consumer does (first understood version).
"""

from __future__ import annotations

import json
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("metadata", help="KEP-5304 device metadata: deferred updates, decoding")
    msub = p.add_subparsers(dest="metadata_command", required=True, metavar="ACTION")
    u = msub.add_parser("update", help="set network data of a prepared request (generation + 1)")
    u.add_argument("--namespace", required=True)
    u.add_argument("--claim", required=True, help="ResourceClaim name")
    u.add_argument("--uid", required=True, help="ResourceClaim UID")
    u.add_argument("--request", required=True, help="request name (base or req/sub)")
    u.add_argument("--device", default=None, help="device name (default: the request's first device)")
    u.add_argument("--interface-name", default=None)
    u.add_argument("--ip", action="append", default=[], help="CIDR, e.g. 192.0.2.5/24 (repeatable)")
    u.add_argument("--hardware-address", default=None)
    u.add_argument("--kubelet-dir", default=None)
    u.add_argument("--driver-name", default=None)
    u.add_argument("--cluster", default=None, help="'kube' or 'dir:PATH', where status.devices is written (default: the config's)")
    u.add_argument("--config", default=None, help="config file (default /etc/sysdra/config.yaml)")
    u.set_defaults(func=run_update)
    s = msub.add_parser("show", help="decode a metadata file (first understood version)")
    s.add_argument("path")
    s.set_defaults(func=run_show)


def run_update(args) -> int:
    from agent.kubeletplugin.types import ClaimRef
    from agent.prepare.metadata.update import NetworkData, UpdateError, update_request, write_status
    from agent.settings import build_settings

    settings = build_settings({"kubelet_dir": args.kubelet_dir, "driver_name": args.driver_name, "cluster": args.cluster},
                              args.config)
    net = NetworkData(args.interface_name, list(args.ip), args.hardware_address)
    try:
        generation, path = update_request(settings, ClaimRef(args.namespace, args.claim, args.uid), args.request,
                                          net, device=args.device)
    except UpdateError as err:
        print(f"sysdra metadata update: {err}", file=sys.stderr)
        return 1
    print(f"{path}: generation {generation}")
    if settings.claim_status:  # the claim's status.devices carries the same network data
        try:
            written = write_status(settings, ClaimRef(args.namespace, args.claim, args.uid))
        except UpdateError as err:  # the metadata is what the hook is for: a warning, not a failure
            print(f"sysdra metadata update: warning: metadata updated, but {err}", file=sys.stderr)
            return 0
        if written is not None:
            print(f"ResourceClaim {args.namespace}/{args.claim}: status.devices updated ({written} entries)")
    return 0


def run_show(args) -> int:
    from agent.prepare.metadata.stream import MetadataError, read_file

    try:
        obj = read_file(args.path)
    except MetadataError as err:
        print(f"sysdra metadata show: {err}", file=sys.stderr)
        return 1
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0
