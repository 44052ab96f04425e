"""``make allocate``: what the scheduler's allocator (tests/peers/allocator) would allocate
for a claim on a node, from the ResourceSlices the agent publishes.

    python -m tests.allocate --claim deploy/example-claim.yaml --profile server-2s-gpu-nic
    python -m tests.allocate --claim my-claim.yaml --slices .state/run/cluster   # `make run`'s offline cluster

The claim file may hold a ResourceClaim or a ResourceClaimTemplate (other documents are
ignored); DeviceClasses come from deploy/deviceclasses.yaml unless --classes names others.
Prints the AllocationResult as JSON; exit 2 when the claim does not fit.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from tests.controlplane import REPO, PeerMissing, Unschedulable, allocate, claim_from, load_yaml


def published_slices(profile: str, node: str, list_attributes: bool, pf_vf_exclusive: bool) -> list[dict]:
    from agent.publish.slices import build_pool, render
    from discovery.inventory import scan

    root = profile if os.path.isdir(os.path.join(profile, "sys")) else os.path.join(REPO, "fixtures", "sysfs", profile)
    inv = scan(root, list_attributes=list_attributes)
    pool = build_pool(inv, node_name=node, driver_name="sysdra.io", list_attributes=list_attributes, pf_vf_exclusive=pf_vf_exclusive)
    return render(pool, driver_name="sysdra.io", node_name=node, generation=1, full_name=True)


def dir_slices(path: str) -> list[dict]:
    """Slices of an offline cluster directory (``--cluster dir:PATH``) or a folder of JSON files."""
    d = os.path.join(path, "resourceslices") if os.path.isdir(os.path.join(path, "resourceslices")) else path
    out = []
    for p in sorted(glob.glob(os.path.join(d, "*.json"))):
        with open(p) as f:
            out.append(json.load(f))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make allocate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--claim", default=os.path.join(REPO, "deploy", "example-claim.yaml"))
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--profile", default="server-2s-gpu-nic", help="fixture profile (or a host root) the agent scans")
    src.add_argument("--slices", help="an offline cluster dir (dir:PATH of `sysdra run`) or a folder of slice JSON files")
    ap.add_argument("--node", default=None, help="node name (default: the slices' nodeName, or demo-node)")
    ap.add_argument("--classes", default=os.path.join(REPO, "deploy", "deviceclasses.yaml"))
    ap.add_argument("--list-attributes", action="store_true", help="publish list-typed attributes (--profile)")
    ap.add_argument("--pf-vf-exclusive", action="store_true", help="publish PF/VF counters (--profile)")
    args = ap.parse_args(argv)

    if args.slices:
        slices = dir_slices(args.slices)
        if not slices:
            print(f"make allocate: no ResourceSlices under {args.slices}", file=sys.stderr)
            return 1
        node = args.node or slices[0]["spec"].get("nodeName") or "demo-node"
    else:
        node = args.node or "demo-node"
        slices = published_slices(args.profile, node, args.list_attributes, args.pf_vf_exclusive)
    docs = [d for d in load_yaml(args.claim) if d.get("kind") in ("ResourceClaim", "ResourceClaimTemplate")]
    if not docs:
        print(f"make allocate: {args.claim} holds no ResourceClaim or ResourceClaimTemplate", file=sys.stderr)
        return 1
    claims = [claim_from(d) for d in docs]
    try:
        results = allocate(slices, load_yaml(args.classes), claims, node=node)
    except Unschedulable as err:
        print(f"unschedulable on {node}: {err}", file=sys.stderr)
        return 2
    except PeerMissing as err:
        print(f"make allocate: {err}", file=sys.stderr)
        return 1
    for claim, result in zip(claims, results):
        meta = claim["metadata"]
        print(f"# {meta.get('namespace', 'default')}/{meta['name']} on {node}", file=sys.stderr)
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
