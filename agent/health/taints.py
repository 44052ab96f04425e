"""The DeviceTaint an unhealthy device is published with (docs/health.md, "Taints").

``resource.k8s.io/v1`` DeviceTaint effects (k8s.io/api v0.37.2, resource/v1/types.go):
``None`` (informational), ``NoSchedule`` (no new claim gets the device) and ``NoExecute`` (the
pods using it are evicted too, unless they tolerate it); there is no PreferNoSchedule. The effect
is ``taint_effect`` (NoSchedule by default) unless ``taint_effects`` names the fault's reason
code: exactly, else the first pattern (``xid-*``) that matches, in the order written.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

TAINT_KEY = "sysdra.io/unhealthy"
EFFECTS = ("None", "NoSchedule", "NoExecute")


def effect_for(reason: str, default: str, by_reason: dict[str, str]) -> str:
    if reason in by_reason:
        return by_reason[reason]
    return next((effect for pattern, effect in by_reason.items() if fnmatchcase(reason, pattern)), default)


def taint_for(reason: str, default: str = "NoSchedule", by_reason: dict[str, str] | None = None) -> dict:
    """The taint of a device unhealthy for ``reason`` (its fault's code), in ResourceSlice encoding."""
    return {"key": TAINT_KEY, "value": reason, "effect": effect_for(reason, default, by_reason or {})}
