"""``sysdra health``: the GPU faults the agent keeps across restarts (agent/health/faults.py).

``list`` shows them; ``clear DEVICE`` (a device name, PCI address or GPU UUID: the GPU's faults and
its MIG devices'; a MIG device's name: its own; ``--all``) removes them once the GPU is trusted
again (after ``nvidia-smi -r``: a reboot clears them by itself).
The running agent reads the file again at its next health round.
"""

from __future__ import annotations

import json
import sys
import time


def add_parser(sub) -> None:
    p = sub.add_parser("health", help="GPU faults kept across agent restarts: list, clear")
    hsub = p.add_subparsers(dest="health_command", required=True, metavar="ACTION")
    ls = hsub.add_parser("list", help="the kept GPU faults (this boot's; others are ignored)")
    ls.add_argument("-o", "--output", choices=("text", "json"), default="text")
    cl = hsub.add_parser("clear", help="forget a GPU's fault: the agent finds it healthy again at its next round")
    which = cl.add_mutually_exclusive_group(required=True)
    which.add_argument("device", nargs="?", help="device name (gpu-0000-1b-00-0), PCI address or GPU UUID (with its MIG devices' faults), "
                                                  "or a MIG device's name")
    which.add_argument("--all", action="store_true", help="every kept fault")
    for q in (ls, cl):
        q.add_argument("--config", metavar="FILE", help="config file (default $SYSDRA_CONFIG or /etc/sysdra/config.yaml)")
        q.add_argument("--kubelet-dir", help="kubelet root directory (default /var/lib/kubelet)")
        q.add_argument("--driver-name", help="driver name (default sysdra.io)")
        q.add_argument("--root", help="host root whose boot ID counts (default /)")
    ls.set_defaults(func=run_list)
    cl.set_defaults(func=run_clear)


def _store(args):
    from agent.health.faults import FaultStore
    from agent.settings import build_settings

    s = build_settings({"kubelet_dir": args.kubelet_dir, "driver_name": args.driver_name, "root": args.root,
                        "node_name": "localhost"}, args.config)  # the node's name plays no part here
    return FaultStore(s.plugin_dir, s.root)


def _line(f) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(f.since))
    return f"{f.device}  {f.uuid}  {f.reason}  since {when}: {f.message}"


def run_list(args) -> int:
    faults = sorted(_store(args).load().values(), key=lambda f: f.device)
    if args.output == "json":
        json.dump([f.model_dump() for f in faults], sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif not faults:
        print("no GPU faults kept")
    else:
        print("\n".join(_line(f) for f in faults))
    return 0


def run_clear(args) -> int:
    store = _store(args)
    try:
        removed = store.clear(None if args.all else args.device)
    except OSError as err:
        print(f"sysdra health clear: {store.path}: {err}", file=sys.stderr)
        return 1
    if not removed:
        print(f"sysdra health clear: no kept fault of {'any GPU' if args.all else args.device} in {store.path}",
              file=sys.stderr)
        return 0 if args.all else 1
    for f in removed:
        print(f"cleared {_line(f)}")
    print("the running agent finds the GPU healthy again at its next health round (health_interval); "
          "its taint goes after taint_hold")
    return 0
