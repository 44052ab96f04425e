"""Settings of ``sysdra run``: flags > environment (SYSDRA_*) > config file > defaults.

An invalid value stops the agent with a message that names the setting and exit
code 78 (EX_CONFIG), which the systemd unit excludes from restarts.
"""

from __future__ import annotations

import os
import re
import socket
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from agent.fsutil import FileRefused, read_bounded
from agent.names import is_subdomain
from agent.settings_errors import error_message
from agent.settings_mps import MpsPodSettings, host_path as _host_path
from agent.settings_net import metrics_address as _metrics_address, nic_ipam as _ipam

EX_CONFIG = 78
DEFAULT_CONFIG_FILE = "/etc/sysdra/config.yaml"


class ConfigError(ValueError):
    """A bad setting; ``str()`` names it. The CLI exits with EX_CONFIG."""


def _default_node_name() -> str:
    # the kubelet's own default: the host name trimmed and lower-cased (component-helpers' GetHostname)
    return os.environ.get("NODE_NAME") or socket.gethostname().strip().lower()


def _absolute(v: str) -> str:
    if not v:
        raise ValueError("must not be empty")
    return os.path.abspath(v)  # relative to the working directory, like --cluster dir:PATH


def _root(v: str) -> str:
    v = _absolute(v)
    if not os.path.isdir(v):
        raise ValueError(f"{v} is not a directory")
    return v


def _driver(v: str) -> str:
    if len(v) > 63 or not is_subdomain(v):
        raise ValueError("must be a lower-case DNS subdomain of at most 63 characters")
    return v


def _node(v: str) -> str:
    if not is_subdomain(v):
        raise ValueError("must be a lower-case DNS subdomain (the Kubernetes node name)")
    return v


def _cluster(v: str) -> str:
    if v == "kube":
        return v
    if v.startswith("dir:") and len(v) > 4:
        return "dir:" + os.path.abspath(v[4:])
    raise ValueError("must be 'kube' or 'dir:PATH'")


def _non_negative(v: float) -> float:
    if not v >= 0:  # (NaN too: YAML's .nan is a float, and no number of seconds)
        raise ValueError("must not be negative or NaN")
    return v


def _health(v: float) -> float:
    if not 0 < v <= 10:
        raise ValueError("must be in (0, 10] seconds: the kubelet marks devices Unknown after 30 s")
    return v


def _switch_timeout(v: float) -> float:
    if not 0 < v <= 3600:
        raise ValueError("must be between 0 and 3600 seconds")
    return v


def _uid(v: str | None) -> str | None:
    if v is not None and not re.fullmatch(r"[A-Za-z0-9][-A-Za-z0-9_.]{0,127}", v):
        raise ValueError("must be a pod UID")
    return v


def _share(v: tuple[str, ...]) -> tuple[str, ...]:
    if len(set(v)) != len(v):
        raise ValueError("names a kind twice")
    return v


def _skip(v: dict[str, list[str]]) -> dict[str, list[str]]:
    from agent.nodeops import rule_problem
    from discovery.models import KINDS

    for kind, ops in v.items():
        if kind not in KINDS:
            raise ValueError(f"{kind!r} is not a device kind ({', '.join(KINDS)})")
        if problem := rule_problem(ops):
            raise ValueError(f"{kind}: {problem}")
    return v


def _exclude(v: tuple[str, ...]) -> tuple[str, ...]:
    from discovery.exclude import Exclusions

    return tuple(f"{what}:{pattern}" for what, pattern in Exclusions.parse(v).rules)


def _device_attributes(v: tuple[dict, ...]) -> tuple[dict, ...]:
    from discovery.extra_attributes import ExtraAttributes

    ExtraAttributes.parse(v)
    return v


def _taint_effects(v: dict[str, str]) -> dict[str, str]:
    """Fault reason code (or pattern: ``xid-*``) -> DeviceTaint effect."""
    for pattern in v:
        if not re.fullmatch(r"[a-z0-9*?\[\]-]{1,63}", pattern):
            raise ValueError(f"{pattern!r} is not a reason code or pattern (docs/health.md: xid-79, xid-*, link-down)")
    return v


def _shm_size(v: str) -> str:
    """A Kubernetes quantity of whole bytes, at least 1Mi (an MPS daemon's shm tmpfs)."""
    from agent.quantity import parse_quantity

    n = parse_quantity(v)
    if n.denominator != 1 or n < 1 << 20:
        raise ValueError(f"{v!r} is not a size of at least 1Mi in whole bytes")
    return v


_CHECKS = {
    "root": _root, "kubelet_dir": _absolute, "cdi_dir": _absolute, "driver_name": _driver, "node_name": _node,
    "cluster": _cluster, "resync_interval": _non_negative, "debounce": _non_negative, "health_interval": _health, "taint_hold": _non_negative,
    "rolling_update_uid": _uid, "partition_switch_timeout": _switch_timeout, "share": _share,
    "skip_node_operations": _skip, "nvidia_driver_root": _host_path, "cdi_host_root": _host_path,
    "nri_socket": lambda v: _absolute(v) if v else v, "nvidia_mps_shm_size": _shm_size, "exclude_devices": _exclude,
    "device_attributes": _device_attributes, "taint_effects": _taint_effects, "nic_ipam": _ipam, "cni_bin_dir": _host_path,
    "metrics_address": _metrics_address,
}


class Settings(BaseModel):
    """The agent's settings: a pydantic model, typed and checked once, then read-only. Every
    constructor converts outside values (strings from flags and the environment, YAML values)
    to each field's type (``"0.5"`` to a float, ``"yes"``/``"off"`` to a bool) and runs the
    checks below; a bad value raises ConfigError naming the setting."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    root: str = "/"
    node_name: str = Field(default_factory=_default_node_name)
    driver_name: str = "sysdra.io"
    kubelet_dir: str = "/var/lib/kubelet"
    cdi_dir: str = "/var/run/cdi"
    cluster: str = "kube"  # "kube" or "dir:PATH"
    list_attributes: bool = False
    resync_interval: float = 300.0  # seconds between full rescans
    debounce: float = 0.25  # seconds to wait for a burst of hardware events to settle
    rolling_update_uid: str | None = None
    device_metadata: bool = True
    # Write status.devices (Ready condition, data, networkData) of prepared claims (docs/cluster-integration.md).
    claim_status: bool = True
    log_format: Literal["text", "json"] = "text"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    metrics_address: str = "127.0.0.1:9478"  # "" disables
    status_socket: str | None = None  # default <plugin dir>/status.sock
    health_interval: float = 10.0  # seconds between health re-checks / resends (<= 10)
    # Publish per-PF shared counters so a PF and its VFs are never allocated together;
    # needs the DRAPartitionableDevices feature gate on the cluster (docs/attributes.md "SR-IOV").
    pf_vf_exclusive: bool = False
    # Publish unhealthy devices with a DeviceTaint sysdra.io/unhealthy (docs/health.md).
    taint_unhealthy: bool = False
    taint_hold: float = 60.0  # seconds a recovered device stays tainted (a flapping link stays tainted)
    # The taints' effect (resource.k8s.io/v1 DeviceTaint: None, NoSchedule, NoExecute evicts the pods
    # using the device), and per fault reason code or pattern (xid-*: NoExecute), which wins.
    taint_effect: Literal["None", "NoSchedule", "NoExecute"] = "NoSchedule"
    taint_effects: dict[str, Literal["None", "NoSchedule", "NoExecute"]] = Field(default_factory=dict, max_length=64)
    # GPU partitions as devices with shared counters; compatibility groups need the cluster's
    # DRADeviceCompatibilityGroups gate (docs/partitions.md). Seconds a mode switch may take.
    partitions: bool = False
    compatibility_groups: bool = False
    # Slices with counter-consuming devices name the attribute stating each one's partition type
    # (partitionTypeAttribute); the cluster's alpha gate DRAPartitionableDevicesType (docs/partitions.md).
    partition_type_attribute: bool = False
    partition_switch_timeout: float = 60.0
    # Device kinds published for sharing (consumable capacity) and their capacity policies;
    # checked by agent.publish.sharing.share_plan at start (docs/sharing.md).
    share: tuple[Literal["gpu", "nic"], ...] = ()
    share_policies: dict[str, Any] = Field(default_factory=dict)
    # KEP-5945 (alpha): device kind -> node operations the kubelet may skip for its devices,
    # e.g. {"accelerator": ["*"]} (docs/cluster-integration.md); upstream's rule is enforced.
    skip_node_operations: dict[str, list[str]] = Field(default_factory=dict)
    # Publish the NICs of the host's default routes (and their bonds' slaves, bridges' ports, VFs)
    # too; off: the node's uplink is never allocatable (docs/networking.md).
    publish_uplink: bool = False
    # Devices never published (pci:<glob>, interface:<glob>, kind:<kind>; discovery/exclude.py).
    exclude_devices: tuple[str, ...] = ()
    # Attributes the operator gives devices: [{match: [pci:<glob>|interface:<glob>|kind:<kind>, ...],
    # attributes: {name: value or {copy: <attribute>}}}] (discovery/extra_attributes.py).
    device_attributes: tuple[dict[str, Any], ...] = ()
    # A claim may take a NIC the host uses (an address, a bond or bridge port: prepare/hostuse.py)
    # if its NicConfig/VfioConfig says allowHostInUse; off: refused (docs/networking.md).
    allow_host_in_use_nics: bool = False
    # IPAM pools for claimed NICs' netdevs (a NicConfig's ipamPool): name -> a CNI IPAM plugin's
    # configuration ({type: host-local, ranges: ...}), the plugin run from cni_bin_dir (a host path,
    # read under root) at each pod sandbox (docs/networking.md, "Addresses from an IPAM pool").
    nic_ipam: dict[str, dict[str, Any]] = Field(default_factory=dict, max_length=64)
    cni_bin_dir: str = "/opt/cni/bin"
    # NVIDIA (docs/nvidia.md): where the user-space driver is installed on the host (a host path,
    # read under root), whether to ask NVML for GPU facts, and whether to use the node's own
    # NVIDIA CDI spec (nvidia-ctk cdi generate) instead of putting the driver in our specs.
    nvidia_driver_root: str = "/"
    nvml: bool = True
    nvidia_cdi_spec: bool = False
    # XIDs of an application's own errors: an NVML XID event with one of them is not a GPU fault.
    nvidia_ignored_xids: tuple[int, ...] = (13, 31, 43, 45, 68, 109)
    # With --share gpu: the shares of an NVIDIA GPU are clients of an MPS control daemon the agent
    # runs for that GPU, so their limits are enforced (docs/sharing.md); false: accounting only.
    nvidia_mps: bool = True
    # The size of each MPS daemon's shm tmpfs (its and its clients' /dev/shm), a quantity (1Gi).
    nvidia_mps_shm_size: str = "1Gi"
    # While a GPU's MPS daemon runs, its compute mode is EXCLUSIVE_PROCESS (set through NVML, set back when
    # the daemon stops): a share's container that bypasses the daemon gets no GPU (docs/sharing.md).
    nvidia_mps_exclusive: bool = False
    # The MPS daemons in pods of their own (the DaemonSet: docs/sharing.md); None: the agent's processes.
    nvidia_mps_pod: MpsPodSettings | None = None
    # MIG mode through NVML, by the agent: on for a claim of a MIG device (--partitions) of a GPU not
    # in MIG mode, off for a claim of the whole GPU (or a share of it) of a GPU in MIG mode, where CUDA
    # sees no device, and back on when that claim goes; false fails such claims, saying so (docs/partitions.md).
    nvidia_mig_enable: bool = False
    # Whose MIG instances: "dynamic" (the agent makes each claim's instance at prepare and destroys, at
    # start, instances no claim made; with --partitions and NVML) or "static" (the operator's layout,
    # nvidia-smi or mig-parted: published as it is, with NVML's profiles, never changed by the agent).
    nvidia_mig: Literal["dynamic", "static"] = "dynamic"
    # The host's / as the container runtime sees it: host paths in CDI specs (driver files) are
    # under it. "/" on a node (also under a DaemonSet's --root=/host); a fixture tree's own path
    # when a runtime runs containers "on" that tree (tests, demos).
    cdi_host_root: str = "/"
    # The container runtime's NRI socket: a NIC's netdev goes into its pod's network namespace
    # (docs/networking.md); "" turns the NRI plugin off.
    nri_socket: str = "/var/run/nri/nri.sock"
    # on: a claim's CDI device adds the host groups of its group-owned nodes to the container
    # process (additionalGids, CDI 0.7.0), so a non-root container opens root:render 0660 nodes;
    # off by default: runtimes on a CDI library < 0.7 reject the whole spec file for the field,
    # and nothing the agent reliably sees tells it the runtime's (docs/kubelet-plugin.md).
    cdi_additional_gids: Literal["off", "on"] = "off"

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as err:
            raise ConfigError(f"invalid setting {error_message(err, Settings)}") from None
        # KEP-5304 metadata specs take the driver name as their CDI vendor (kind <driver>/metadata),
        # which must start with a letter: refused here, not as every claim's spec error
        if self.device_metadata and not self.driver_name[:1].isalpha():
            raise ConfigError(f"invalid setting driver-name: {self.driver_name!r} starts with a digit, and "
                              "device metadata uses it as a CDI vendor, which must start with a letter "
                              "(choose another name, or device-metadata: false)")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"settings are read-only ({name}): make a changed copy with replace()")

    @classmethod
    def of(cls, values: dict[str, Any]) -> Settings:
        """Settings from outside values (also ``"gpu,nic"`` for ``share`` and ``exclude_devices``, YAML text for
        ``skip_node_operations``); ConfigError names the first bad one."""
        return cls(**_before(values))

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes``, checked like a new one."""
        return type(self)(**{**self.__dict__, **changes})

    @field_validator(*_CHECKS)
    @classmethod
    def check_value(cls, value: Any, info: ValidationInfo) -> Any:
        """The checks a value's type cannot express; a returned value replaces the given one."""
        return _CHECKS[info.field_name](value)

    # --- derived paths ----------------------------------------------------------
    @property
    def cluster_dir(self) -> str | None:
        return self.cluster[4:] if self.cluster.startswith("dir:") else None

    @property
    def plugin_dir(self) -> str:
        return os.path.join(self.kubelet_dir, "plugins", self.driver_name)

    @property
    def registry_dir(self) -> str:
        return os.path.join(self.kubelet_dir, "plugins_registry")


def _before(values: dict[str, Any]) -> dict[str, Any]:
    """The spellings a field's type does not take as they are: a comma list for ``share`` and ``exclude_devices``,
    YAML text for ``skip_node_operations``, ``nvidia_mps_pod``, ``taint_effects`` and ``nic_ipam`` (from SYSDRA_*), a
    YAML bool for ``cdi_additional_gids`` (``on``/``off`` unquoted)."""
    out = dict(values)
    for name, value in values.items():
        if name in ("share", "exclude_devices") and isinstance(value, str):  # --share gpu,nic / SYSDRA_SHARE=gpu,nic
            out[name] = [x.strip() for x in value.split(",") if x.strip()]
        elif name in ("skip_node_operations", "nvidia_mps_pod", "taint_effects", "nic_ipam", "device_attributes") and isinstance(value, str):  # '{accelerator: ["*"]}'
            from agent.settings_yaml import YamlError, load as yaml_load  # (YAML is loaded only when there is some)

            try:
                out[name] = yaml_load(value) or {"nvidia_mps_pod": None, "device_attributes": ()}.get(name, {})
            except YamlError as err:
                raise ConfigError(f"invalid setting {name.replace('_', '-')}: not a YAML mapping: {err}") from None
        elif name == "cdi_additional_gids" and isinstance(value, bool):  # YAML reads a bare on/off as a bool
            out[name] = "on" if value else "off"
    return out


# Names accepted in the config file and as SYSDRA_<NAME> environment variables.
FIELDS = tuple(Settings.model_fields)


def _env_values(environ: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in FIELDS:
        key = "SYSDRA_" + name.upper()
        if key in environ:
            out[name] = environ[key]
    return out


MAX_CONFIG_BYTES = 1 << 20  # the chart's file is ~300 bytes


def load_config_file(path: str) -> dict[str, Any]:
    try:
        text = read_bounded(path, MAX_CONFIG_BYTES).decode()
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path}: not UTF-8 text (byte {err.start})") from None
    except FileNotFoundError:
        return {}
    except FileRefused as err:  # a FIFO (a blocking open waited for ever), /dev/zero, a sparse file
        raise ConfigError(f"config file {path}: {err}") from None
    except OSError as err:
        raise ConfigError(f"config file {path}: {err}") from err
    if not text.strip():  # no file content (e.g. /dev/null): the YAML parser is not even loaded
        return {}
    from agent.settings_yaml import YamlError, load as yaml_load

    try:
        data = yaml_load(text)
    except YamlError as err:
        raise ConfigError(f"config file {path}: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping")
    # accept both node_name and node-name / nodeName spellings
    out, spelled = {}, {}
    for key, value in data.items():
        norm = re.sub(r"(?<!^)(?=[A-Z])", "_", str(key)).replace("-", "_").lower()
        if norm in out:  # which one was meant cannot be told: the file's last would win unseen
            raise ConfigError(f"config file {path}: setting {norm} given twice ({spelled[norm]!s}, {key!s})")
        out[norm], spelled[norm] = value, key
    unknown = sorted(set(out) - set(FIELDS))
    if unknown:
        raise ConfigError(f"config file {path}: unknown setting(s) {', '.join(unknown)}")
    return out


def build_settings(
    flags: dict[str, Any],
    config_file: str | None = None,
    environ: dict[str, str] | None = None,
) -> Settings:
    """Merge the sources in precedence order and validate once."""
    environ = dict(os.environ if environ is None else environ)
    path = config_file or environ.get("SYSDRA_CONFIG") or DEFAULT_CONFIG_FILE
    explicit = bool(config_file or environ.get("SYSDRA_CONFIG"))
    if explicit and not os.path.exists(path):
        raise ConfigError(f"config file {path}: does not exist")
    merged: dict[str, Any] = {}
    merged.update(load_config_file(path))
    merged.update(_env_values(environ))
    merged.update({k: v for k, v in flags.items() if v is not None})
    return Settings.of(merged)
