"""``sysdra scan``: what discovery sees on this node (or a fixture root)."""

from __future__ import annotations

import json
import os
import sys

import orjson

from agent.cli import publishing
from discovery.inventory import scan
from discovery.models import Inventory


def add_parser(sub) -> None:
    p = sub.add_parser("scan", help="discover devices and print them",
                       description="With -o slices, the publishing flags and settings (config file, SYSDRA_*) "
                                   "are those of `sysdra run`: the output is what run would publish.")
    p.add_argument("--root", default="/", help="host root to scan (default /)")
    p.add_argument("-o", "--output", choices=("table", "tree", "json", "slices"), default="table")
    p.add_argument("--config", metavar="FILE", help="for -o slices: config file, as sysdra run's (default $SYSDRA_CONFIG or /etc/sysdra/config.yaml)")
    publishing.add_publishing_flags(p)
    p.set_defaults(func=run, quick_exit=True)  # it only prints: no teardown of the inventory


def _settings(args):
    from agent.settings import build_settings

    return publishing.checked(build_settings({"root": args.root, **publishing.publishing_values(args)}, config_file=args.config))


def _taints(inv: Inventory, settings) -> dict[str, list[dict]]:
    """--taint-unhealthy: one round of the agent's health checks, as its first round sees the node."""
    from agent.health.monitor import HealthMonitor

    monitor = HealthMonitor(settings, lambda: inv)
    monitor.states = monitor._check_all()
    return monitor.taints()


def _slices(inv: Inventory, settings) -> dict:
    from agent.publish.slices import slices_list

    taints = _taints(inv, settings) if settings.taint_unhealthy else None
    return slices_list(inv, settings, taints=taints)


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


def _nvml(args, settings):
    """NVML as ``sysdra run`` would use it (only -o slices reads the config file)."""
    use = settings.nvml if settings is not None else (args.nvml or "true").strip().lower() not in ("false", "no", "off", "0")
    if not use or not os.path.isdir(args.root):
        return None
    from discovery.nvml import Nvml

    driver_root = settings.nvidia_driver_root if settings is not None else (args.nvidia_driver_root or "/")
    return Nvml.open(args.root, driver_root)


def _exclusions(args, settings):
    """``exclude_devices`` as ``sysdra run`` would apply them (only -o slices reads the config file);
    ValueError for a bad rule of the flag."""
    from discovery.exclude import Exclusions

    if settings is not None:
        return Exclusions.parse(settings.exclude_devices)
    return Exclusions.parse(x for x in (args.exclude_devices or "").split(",") if x.strip())


def _static_mig(args, settings) -> bool:
    """``nvidia_mig`` as run would take it (only -o slices reads the config file); ValueError for a bad flag."""
    mig = settings.nvidia_mig if settings is not None else (args.nvidia_mig or "dynamic")
    if mig not in ("dynamic", "static"):
        raise ValueError(f"--nvidia-mig: dynamic or static, not {mig[:20]!r}")
    return mig == "static"


def _extra_attributes(settings):
    """-o slices: the operator's ``device_attributes`` (the config file), as run publishes them."""
    from discovery.extra_attributes import ExtraAttributes

    return ExtraAttributes.parse(settings.device_attributes, settings.driver_name) if settings is not None else ExtraAttributes()


def _away(settings):
    """-o slices: the NICs whose netdevs the agent moved into pods keep their facts, as run publishes them."""
    if settings is None:
        return None
    from agent.service.inpod import InPodNetdevs

    return InPodNetdevs(settings.plugin_dir)


def run(args) -> int:
    # only -o slices loads the settings (config file and all); the others read no more than the flags
    settings = _settings(args) if args.output == "slices" else None
    list_attributes = settings.list_attributes if settings is not None else bool(args.list_attributes)
    from agent.service.heap import freeze_startup

    if args.own_process:
        freeze_startup()
    try:
        uplink = settings.publish_uplink if settings is not None else bool(args.publish_uplink)
        inv = scan(args.root, list_attributes=list_attributes, nvml=_nvml(args, settings), publish_uplink=uplink,
                   exclude=_exclusions(args, settings), away=_away(settings), static_mig=_static_mig(args, settings),
                   extra_attributes=_extra_attributes(settings))
    except (FileNotFoundError, ValueError) as err:
        print(f"sysdra scan: {err}", file=sys.stderr)
        return 2
    if args.output == "json":
        _write(json_text(inv.to_json()))
    elif args.output == "slices":
        _write(json_text(_slices(inv, settings)))
    else:
        from discovery.render import render_table, render_tree

        _write((render_tree(inv) if args.output == "tree" else render_table(inv)).encode())
    return 0
