"""Inventory device -> its ``resource.k8s.io`` API encoding (name, attributes, capacity).

Neutral ground: the publishing side puts it into ResourceSlices and the prepare side into
KEP-5304 metadata, and neither imports the other for it."""

from __future__ import annotations


def device_api(device) -> dict:
    """``Device.to_api()``, about twice as fast (it runs for every device of the pool). The
    attribute value dicts are each value's shared, read-only ``AttributeValue.api``."""
    out: dict = {"name": device.name}
    if device.attributes:
        out["attributes"] = {k: v.api for k, v in sorted(device.attributes.items())}
    if device.capacity:
        out["capacity"] = {k: {"value": v} for k, v in sorted(device.capacity.items())}
    return out
