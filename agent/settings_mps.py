"""``nvidia_mps_pod``, the settings of the MPS control daemons' own pods (agent/settings.py's
``Settings`` holds it), and the check of a host path both use."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

from agent.names import is_subdomain


def host_path(v: str) -> str:
    """A host path (read under root, not resolved here: it names a directory of the host)."""
    if not v.startswith("/") or "\x00" in v or len(v) > 4096:
        raise ValueError(f"{v!r} is not an absolute path")
    return os.path.normpath(v)


class MpsPodSettings(BaseModel):
    """``nvidia_mps_pod``: the MPS control daemons run in pods of their own on this node (the
    DaemonSet's agent, whose pod may end while shares run: prepare/mps_pods.py). The chart
    writes it; keys as in YAML (camelCase) or snake_case."""

    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True)
    image: str = Field(min_length=1, max_length=1024)  # one with sh, grep and tail (the agent's own)
    namespace: str  # the agent's
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    image_pull_secrets: tuple[str, ...] = ()
    priority_class_name: str = ""
    # the pods' ServiceAccount (no token is mounted): one that exists, the agent's; "": the namespace's default
    service_account_name: str = ""
    # the host directory of the driver root (nvidia_driver_root as the host has it); None: that one
    host_driver_root: str | None = None
    start_timeout: float = Field(default=120.0, gt=0, le=3600)  # seconds: an image pull, a sandbox

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        if len(v) > 63 or not is_subdomain(v) or "." in v:
            raise ValueError(f"{v!r} is not a DNS label")
        return v

    @field_validator("image_pull_secrets", "priority_class_name", "service_account_name")
    @classmethod
    def _names(cls, v: Any) -> Any:
        for name in (v,) if isinstance(v, str) else v:
            if name and not is_subdomain(name):
                raise ValueError(f"{name!r} is not an object name")
        return v

    @field_validator("host_driver_root")
    @classmethod
    def _host_root(cls, v: str | None) -> str | None:
        return None if v is None else host_path(v)
