"""The kubelet's claim references and the ResourceClaims fetched for them, checked before use:
both are untrusted input, and names from them become paths and API requests."""

from __future__ import annotations

from agent import names
from agent.kubeletplugin.types import ClaimRef


def check_ref(ref: ClaimRef) -> str | None:
    """Why the kubelet's claim reference is unusable, or None. Nothing unchecked reaches a path."""
    for field, value in (("uid", ref.uid), ("namespace", ref.namespace), ("name", ref.name)):
        if not value:
            return f"claim {field} is empty"
        if len(value) > 253:
            return f"claim {field} is {len(value)} characters long (at most 253)"
        if "/" in value or "\\" in value or ".." in value or "\x00" in value:
            return f"claim {field} {value!r} contains a path separator or '..'"
    if not names.is_uid(ref.uid):
        return f"claim uid {ref.uid!r} is malformed"
    if not names.is_label(ref.namespace):
        return f"claim namespace {ref.namespace!r} is not a DNS label"
    if not names.is_subdomain(ref.name):
        return f"claim name {ref.name!r} is not a DNS subdomain"
    return None


def check_claim(ref: ClaimRef, claim: object) -> str | None:
    """Why the fetched ResourceClaim cannot be used for ``ref``, or None. Its identity must be
    the request's (the object, not the kubelet, would otherwise choose our paths), and the
    parts the driver reads must have their API types."""
    what = f"ResourceClaim {ref.namespace}/{ref.name}"
    if not isinstance(claim, dict):
        return f"{what} is not an object"
    meta = claim.get("metadata")
    if not isinstance(meta, dict):
        return f"{what}: metadata is not an object"
    for field, want in (("namespace", ref.namespace), ("name", ref.name)):
        if meta.get(field) != want:
            return f"{what}: its metadata.{field} is {meta.get(field)!r}, not the requested {want!r}"
    uid = meta.get("uid")
    if uid != ref.uid:
        return f"{what} has UID {uid}, not {ref.uid}: it was replaced"
    annotations = meta.get("annotations")
    if annotations is not None and not (isinstance(annotations, dict)
                                        and all(isinstance(k, str) and isinstance(v, str) for k, v in annotations.items())):
        return f"{what}: metadata.annotations is not a map of strings"
    status = claim.get("status")
    if status is not None and not isinstance(status, dict):
        return f"{what}: status is not an object"
    alloc = (status or {}).get("allocation")
    if not alloc:
        return f"{what} is not allocated"
    if not isinstance(alloc, dict):
        return f"{what}: status.allocation is not an object"
    devices = alloc.get("devices")
    if devices is not None and not isinstance(devices, dict):
        return f"{what}: status.allocation.devices is not an object"
    results = (devices or {}).get("results")
    if results is not None and not isinstance(results, list):
        return f"{what}: status.allocation.devices.results is not a list"
    return None
