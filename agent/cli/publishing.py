"""The publishing flags: the settings that decide what goes into the ResourceSlices.

``sysdra run`` and ``sysdra scan -o slices`` take exactly these (one definition, here), so
an operator sees with scan what run would publish. A new publishing setting is added to
``VALUE_FLAGS`` or ``SWITCH_FLAGS`` (and ``HELP``) here, and to ``agent.settings.Settings``;
both commands then have it. Values stay strings so a bad one is reported by Settings,
naming the setting (exit 78).
"""

from __future__ import annotations

VALUE_FLAGS: tuple[str, ...] = ("node-name", "driver-name", "share", "nvidia-driver-root", "nvml", "nvidia-mig", "exclude-devices",
                                "taint-effect")
SWITCH_FLAGS: tuple[str, ...] = ("list-attributes", "pf-vf-exclusive", "taint-unhealthy", "partitions", "compatibility-groups",
                                 "partition-type-attribute", "publish-uplink")
# One line each; docs/operations.md has the whole story of every setting.
HELP = {
    "node-name": "Kubernetes node name: the pool name and the slices' owner (default $NODE_NAME or the hostname)",
    "driver-name": "DRA driver name in slices, claims and CDI kinds (default sysdra.io)",
    "list-attributes": "publish list-typed attributes (needs the DRAListTypeAttributes gate on the cluster)",
    "pf-vf-exclusive": "publish per-PF counters so a PF and its VFs are never allocated together (partitionable devices)",
    "taint-unhealthy": "publish unhealthy devices with a device taint sysdra.io/unhealthy (effect: --taint-effect)",
    "taint-effect": "the taints' effect: None, NoSchedule (default) or NoExecute (evicts the pods using the device); per reason: taint_effects",
    "partitions": "publish GPU partitions (AMD compute partitions, NVIDIA MIG instances) with shared counters",
    "compatibility-groups": "with --partitions, every partition mode with compatibility groups (needs DRADeviceCompatibilityGroups)",
    "partition-type-attribute": "slices with counter-consuming devices name their partitionType attribute (needs DRAPartitionableDevicesType)",
    "nvidia-driver-root": "host directory holding the NVIDIA user-space driver (default /; e.g. /run/nvidia/driver, /usr/local/nvidia)",
    "nvml": "ask NVML (the driver's libnvidia-ml) for GPU memory, architecture and versions: true or false (default true)",
    "nvidia-mig": "whose MIG instances: dynamic (default; made per claim by the agent, with --partitions) or static (the operator's, published as they are)",
    "publish-uplink": "publish the NICs of the host's default routes too (bond slaves, bridge ports, VFs of the PF)",
    "exclude-devices": "devices never published, comma-separated: pci:<glob>, interface:<glob>, kind:<kind> (e.g. interface:ens1f*)",
    "share": "device kinds shared by several claims (consumable capacity), e.g. gpu,nic; policies: share_policies in the config file",
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


def checked(settings):
    """``settings`` once the publishing settings that Settings cannot judge alone (share
    policies, checked as the API server would) are valid; else ConfigError (exit 78)."""
    from agent.publish.sharing import share_plan
    from agent.settings import ConfigError

    try:
        share_plan(settings.share, settings.share_policies)
    except ValueError as err:
        raise ConfigError(f"invalid setting {err}") from err
    if "gpu" in settings.share and getattr(settings, "partitions", False):
        # a partition device is a copy of its GPU's entry: shares of it would publish the whole GPU's capacities
        raise ConfigError("invalid setting share: gpu cannot be combined with partitions (share the GPUs or partition them)")
    return settings


def publishing_values(args) -> dict:
    """setting name -> the flag's value, None where the flag was not given."""
    return {dest(flag): getattr(args, dest(flag), None) for flag in VALUE_FLAGS + SWITCH_FLAGS}
