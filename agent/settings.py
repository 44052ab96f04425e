"""Settings of ``sysdra run``: flags > environment (SYSDRA_*) > config file > defaults.

An invalid value stops the agent with a message that names the setting and exit
code 78 (EX_CONFIG), which the systemd unit excludes from restarts.
"""

from __future__ import annotations

import os
import re
import socket
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from agent.names import is_subdomain

EX_CONFIG = 78
DEFAULT_CONFIG_FILE = "/etc/sysdra/config.yaml"


class ConfigError(Exception):
    """A bad setting; ``str()`` names it. The CLI exits with EX_CONFIG."""


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    root: str = "/"
    node_name: str = Field(default_factory=lambda: os.environ.get("NODE_NAME") or socket.gethostname())
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
    # Publish unhealthy devices with a NoSchedule DeviceTaint sysdra.io/unhealthy (docs/health.md).
    taint_unhealthy: bool = False
    # GPU partitions as devices with shared counters; compatibility groups need the cluster's
    # DRADeviceCompatibilityGroups gate (docs/partitions.md). Seconds a mode switch may take.
    partitions: bool = False
    compatibility_groups: bool = False
    partition_switch_timeout: float = 60.0

    @field_validator("partition_switch_timeout")
    @classmethod
    def _positive_timeout(cls, v: float) -> float:
        if not 0 < v <= 3600:
            raise ValueError("must be between 0 and 3600 seconds")
        return v
    # Device kinds published for sharing (consumable capacity) and their capacity policies;
    # checked by agent.publish.sharing.share_plan at start (docs/sharing.md).
    share: tuple[Literal["gpu", "nic"], ...] = ()
    share_policies: dict[str, Any] = Field(default_factory=dict)

    @field_validator("share", mode="before")
    @classmethod
    def _share_list(cls, v):
        if isinstance(v, str):  # --share gpu,nic / SYSDRA_SHARE=gpu,nic
            v = [x.strip() for x in v.split(",") if x.strip()]
        if isinstance(v, (list, tuple)) and len(set(v)) != len(v):
            raise ValueError("names a kind twice")
        return tuple(v) if isinstance(v, list) else v
    # KEP-5945 (alpha): device kind -> node operations the kubelet may skip for its devices,
    # e.g. {"accelerator": ["*"]} (docs/cluster-integration.md); upstream's rule is enforced.
    skip_node_operations: dict[str, list[str]] = Field(default_factory=dict)

    @field_validator("root", "kubelet_dir", "cdi_dir")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v:
            raise ValueError("must not be empty")
        return os.path.abspath(v)  # relative to the working directory, like --cluster dir:PATH

    @field_validator("root")
    @classmethod
    def _root_exists(cls, v: str) -> str:
        if not os.path.isdir(v):
            raise ValueError(f"{v} is not a directory")
        return v

    @field_validator("driver_name")
    @classmethod
    def _driver(cls, v: str) -> str:
        if len(v) > 63 or not is_subdomain(v):
            raise ValueError("must be a lower-case DNS subdomain of at most 63 characters")
        return v

    @field_validator("node_name")
    @classmethod
    def _node(cls, v: str) -> str:
        if not is_subdomain(v):
            raise ValueError("must be a lower-case DNS subdomain (the Kubernetes node name)")
        return v

    @field_validator("cluster")
    @classmethod
    def _cluster(cls, v: str) -> str:
        if v == "kube":
            return v
        if v.startswith("dir:") and len(v) > 4:
            return "dir:" + os.path.abspath(v[4:])
        raise ValueError("must be 'kube' or 'dir:PATH'")

    @field_validator("resync_interval", "debounce")
    @classmethod
    def _non_negative(cls, v: float) -> float:
        if v < 0:
            raise ValueError("must not be negative")
        return v

    @field_validator("health_interval")
    @classmethod
    def _health(cls, v: float) -> float:
        if not 0 < v <= 10:
            raise ValueError("must be in (0, 10] seconds: the kubelet marks devices Unknown after 30 s")
        return v

    @field_validator("rolling_update_uid")
    @classmethod
    def _uid(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9][-A-Za-z0-9_.]{0,127}", v):
            raise ValueError("must be a pod UID")
        return v

    @field_validator("skip_node_operations", mode="before")
    @classmethod
    def _skip_text(cls, v: Any) -> Any:
        if isinstance(v, str):  # SYSDRA_SKIP_NODE_OPERATIONS='{accelerator: ["*"]}' (YAML or JSON)
            import yaml

            try:
                v = yaml.safe_load(v) or {}
            except yaml.YAMLError as err:
                raise ValueError(f"not a YAML mapping: {err}") from None
        return v

    @field_validator("skip_node_operations")
    @classmethod
    def _skip(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        from agent.nodeops import rule_problem
        from discovery.models import KINDS

        for kind, ops in v.items():
            if kind not in KINDS:
                raise ValueError(f"{kind!r} is not a device kind ({', '.join(KINDS)})")
            if problem := rule_problem(ops):
                raise ValueError(f"{kind}: {problem}")
        return v

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


# Names accepted in the config file and as SYSDRA_<NAME> environment variables.
FIELDS = tuple(Settings.model_fields)


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
    try:
        return Settings(**merged)
    except ValidationError as err:
        parts = []
        for e in err.errors():
            loc = ".".join(str(x) for x in e["loc"]) or "settings"
            parts.append(f"{loc.replace('_', '-')}: {e['msg']}")
        raise ConfigError("invalid setting " + "; ".join(parts)) from err
