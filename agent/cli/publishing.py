"""The publishing flags: the settings that decide what goes into the ResourceSlices.

``sysdra run`` and ``sysdra scan -o slices`` take exactly these (one definition, here), so
an operator sees with scan what run would publish. A new publishing setting is added to
``VALUE_FLAGS`` or ``SWITCH_FLAGS`` (and ``HELP``) here, and to ``agent.settings.Settings``;
both commands then have it. Values stay strings so a bad one is reported by Settings,
naming the setting (exit 78).
"""

from __future__ import annotations

VALUE_FLAGS: tuple[str, ...] = ("node-name", "driver-name")
SWITCH_FLAGS: tuple[str, ...] = ("list-attributes", "pf-vf-exclusive", "taint-unhealthy", "partitions", "compatibility-groups")
# One line each; docs/operations.md has the whole story of every setting.
HELP = {
    "node-name": "Kubernetes node name: the pool name and the slices' owner (default $NODE_NAME or the hostname)",
    "driver-name": "DRA driver name in slices, claims and CDI kinds (default sysdra.io)",
    "list-attributes": "publish list-typed attributes (needs the DRAListTypeAttributes gate on the cluster)",
    "pf-vf-exclusive": "publish per-PF counters so a PF and its VFs are never allocated together (partitionable devices)",
    "taint-unhealthy": "publish unhealthy devices with a NoSchedule device taint sysdra.io/unhealthy",
    "partitions": "publish GPU partitions (AMD compute partitions, NVIDIA MIG instances) with shared counters",
    "compatibility-groups": "with --partitions, every partition mode with compatibility groups (needs DRADeviceCompatibilityGroups)",
}


def dest(flag: str) -> str:
    return flag.replace("-", "_")


def add_value_flag(parser, flag: str, help_text: str) -> None:
    parser.add_argument(f"--{flag}", dest=dest(flag), metavar=flag.split("-")[-1].upper(), help=help_text)


def add_switch_flag(parser, flag: str, help_text: str) -> None:
    parser.add_argument(f"--{flag}", dest=dest(flag), action="store_const", const=True, default=None, help=help_text)


def add_publishing_flags(parser) -> None:
    for flag in VALUE_FLAGS:
        add_value_flag(parser, flag, HELP[flag])
    for flag in SWITCH_FLAGS:
        add_switch_flag(parser, flag, HELP[flag])


def publishing_values(args) -> dict:
    """setting name -> the flag's value, None where the flag was not given."""
    return {dest(flag): getattr(args, dest(flag), None) for flag in VALUE_FLAGS + SWITCH_FLAGS}
