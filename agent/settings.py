"""Settings of ``sysdra run``: flags > environment (SYSDRA_*) > config file > defaults.

An invalid value stops the agent with a message that names the setting and exit
code 78 (EX_CONFIG), which the systemd unit excludes from restarts.
"""

from __future__ import annotations

import os
import re
import socket
from typing import Any, Literal

import msgspec

from agent.names import is_subdomain

EX_CONFIG = 78
DEFAULT_CONFIG_FILE = "/etc/sysdra/config.yaml"
# The words a boolean setting may be written as (flags, SYSDRA_*, YAML strings), any case.
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


class ConfigError(Exception):
    """A bad setting; ``str()`` names it. The CLI exits with EX_CONFIG."""


def _default_node_name() -> str:
    return os.environ.get("NODE_NAME") or socket.gethostname()


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The agent's settings: typed and checked once, then read-only. :meth:`of` builds them
    from outside values (strings from flags and the environment, YAML values), converting
    each to its field's type; every constructor runs the checks in ``__post_init__``.

    msgspec rather than pydantic: this is the first thing ``sysdra run`` loads, and pydantic
    and the model cost ~100 ms of each start (docs/performance.md, "First publish")."""

    root: str = "/"
    node_name: str = msgspec.field(default_factory=_default_node_name)
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
    # The container runtime's NRI socket; the agent is an NRI plugin there (docs/networking.md). "" disables.
    nri_socket: str = "/var/run/nri/nri.sock"
    status_socket: str | None = None  # default <plugin dir>/status.sock
    health_interval: float = 10.0  # seconds between health re-checks / resends (<= 10)
    # Publish per-PF shared counters so a PF and its VFs are never allocated together;
    # needs the DRAPartitionableDevices feature gate on the cluster (docs/attributes.md "SR-IOV").
    pf_vf_exclusive: bool = False
    # Publish unhealthy devices with a NoSchedule DeviceTaint sysdra.io/unhealthy (docs/health.md).
    taint_unhealthy: bool = False
    # GPU partitions as devices with shared counters; compatibility groups need the cluster's
    # DRADeviceCompatibilityGroups gate (docs/partitions.md). Seconds a mode switch may take.
    partitions: bool = False
    compatibility_groups: bool = False
    partition_switch_timeout: float = 60.0
    # Device kinds published for sharing (consumable capacity) and their capacity policies;
    # checked by agent.publish.sharing.share_plan at start (docs/sharing.md).
    share: tuple[Literal["gpu", "nic"], ...] = ()
    share_policies: dict[str, Any] = msgspec.field(default_factory=dict)
    # KEP-5945 (alpha): device kind -> node operations the kubelet may skip for its devices,
    # e.g. {"accelerator": ["*"]} (docs/cluster-integration.md); upstream's rule is enforced.
    skip_node_operations: dict[str, list[str]] = msgspec.field(default_factory=dict)
    # NVIDIA (docs/nvidia.md): where the user-space driver is installed on the host (a host path,
    # read under root), whether to ask NVML for GPU facts, and whether to use the node's own
    # NVIDIA CDI spec (nvidia-ctk cdi generate) instead of putting the driver in our specs.
    # Publish the NICs of the host's default routes (and their bonds' slaves, bridges' ports, VFs)
    # too; off: the node's uplink is never allocatable (docs/networking.md).
    publish_uplink: bool = False
    nvidia_driver_root: str = "/"
    # The host's / as the container runtime sees it: host paths in CDI specs (driver files) are
    # under it. "/" on a node (also under a DaemonSet's --root=/host); a fixture tree's own path
    # when a runtime runs containers "on" that tree (tests, demos).
    cdi_host_root: str = "/"
    nvml: bool = True
    # XIDs of an application's own errors: an NVML XID event with one of them is not a GPU fault.
    nvidia_ignored_xids: tuple[int, ...] = (13, 31, 43, 45, 68, 109)
    nvidia_cdi_spec: bool = False

    @classmethod
    def of(cls, values: dict[str, Any]) -> Settings:
        """Settings from outside values, each converted to its field's type (``"0.5"`` to a
        float, ``"true"``/``"no"`` to a bool, ``"gpu,nic"`` to a tuple); ConfigError names
        the first bad one."""
        try:
            return msgspec.convert(_before(values), cls, strict=False)
        except msgspec.ValidationError as err:
            raise ConfigError(f"invalid setting {_message(str(err), values)}") from None

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes`` (typed values), checked like a new one."""
        return msgspec.structs.replace(self, **changes)

    def __post_init__(self) -> None:
        for name, check in _CHECKS:
            value = getattr(self, name)
            try:
                checked = check(value)
            except ValueError as err:
                raise ValueError(f"{name.replace('_', '-')}: {err}") from None
            if checked is not value:
                msgspec.structs.force_setattr(self, name, checked)  # normalised: absolute paths

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
    """The spellings a field's type does not take as they are: boolean words, a comma
    list for ``share``, YAML text for ``skip_node_operations`` (from SYSDRA_*)."""
    out = dict(values)
    for name, value in values.items():
        if isinstance(value, str) and name in _BOOLS:
            word = value.strip().lower()
            out[name] = True if word in _TRUE else False if word in _FALSE else value
        elif name == "share" and isinstance(value, str):  # --share gpu,nic / SYSDRA_SHARE=gpu,nic
            out[name] = [x.strip() for x in value.split(",") if x.strip()]
        elif name == "skip_node_operations" and isinstance(value, str):  # '{accelerator: ["*"]}'
            import yaml

            try:
                out[name] = yaml.safe_load(value) or {}
            except yaml.YAMLError as err:
                raise ConfigError(f"invalid setting skip-node-operations: not a YAML mapping: {err}") from None
    return out


def _message(text: str, values: dict[str, Any]) -> str:
    """msgspec's ``Expected `float`, got `str` - at `$.debounce``` -> ``debounce: expected
    float, got str 'soon'``; a check's own message already starts with the setting's name."""
    what, sep, where = text.rpartition(" - at `$.")
    if not sep:
        if text.startswith("Object contains unknown field"):
            return text.rpartition(" ")[2].strip("`").replace("_", "-") + ": no such setting"
        return text
    name = re.split(r"[.\[`]", where, maxsplit=1)[0]
    given = f" {values[name]!r}"[:80] if what.startswith("Expected") and isinstance(values.get(name), str) else ""
    return f"{name.replace('_', '-')}: {what[:1].lower()}{what[1:].replace('`', '')}{given}"


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
    if v < 0:
        raise ValueError("must not be negative")
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


def _host_path(v: str) -> str:
    """A host path (read under root, not resolved here: it names a directory of the host)."""
    if not v.startswith("/") or "\x00" in v or len(v) > 4096:
        raise ValueError(f"{v!r} is not an absolute path")
    return os.path.normpath(v)


def _optional_path(v: str) -> str:
    return _absolute(v) if v else v


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


_CHECKS = (
    ("root", _root), ("kubelet_dir", _absolute), ("cdi_dir", _absolute), ("driver_name", _driver),
    ("node_name", _node), ("cluster", _cluster), ("resync_interval", _non_negative), ("debounce", _non_negative),
    ("health_interval", _health), ("rolling_update_uid", _uid), ("partition_switch_timeout", _switch_timeout),
    ("share", _share), ("skip_node_operations", _skip), ("nvidia_driver_root", _host_path), ("cdi_host_root", _host_path),
    ("nri_socket", _optional_path),
)  # fmt: skip
_BOOLS = frozenset(f.name for f in msgspec.structs.fields(Settings) if f.type is bool)


# Names accepted in the config file and as SYSDRA_<NAME> environment variables.
FIELDS = Settings.__struct_fields__


def _env_values(environ: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in FIELDS:
        key = "SYSDRA_" + name.upper()
        if key in environ:
            out[name] = environ[key]
    return out


def load_config_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return {}
    except OSError as err:
        raise ConfigError(f"config file {path}: {err}") from err
    if not text.strip():  # no file content (e.g. /dev/null): the YAML parser is not even loaded
        return {}
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path}: {err}") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping")
    # accept both node_name and node-name / nodeName spellings
    out = {}
    for key, value in data.items():
        norm = re.sub(r"(?<!^)(?=[A-Z])", "_", str(key)).replace("-", "_").lower()
        out[norm] = value
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
