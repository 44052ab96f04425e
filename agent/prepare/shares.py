"""Prepare per share: what one allocation result becomes in the claim's CDI spec.

A result of a multi-allocatable device carries a ``shareID`` and its ``consumedCapacity``
(docs/sharing.md). Each share is its own CDI device ``<claimUID>-<device>-<shareID>`` (the
dra-example-driver's naming; identical names for two shares broke container creation upstream,
kubernetes#134519), with the same device nodes and the share's environment:

- ``SYSDRA_SHARE_ID``, ``SYSDRA_SHARE_DEVICE`` and ``SYSDRA_SHARE_<CAPACITY>`` (the consumed
  quantity as the scheduler wrote it, e.g. ``20Gi``) with ``SYSDRA_SHARE_<CAPACITY>_VALUE`` (the
  plain number) — for the usual one share per container;
- the same per device, ``SYSDRA_DEVICE_<NAME>_SHARE`` and ``SYSDRA_DEVICE_<NAME>_<CAPACITY>``,
  which stay distinct when one container holds shares of several devices;
- ``<CAPACITY>`` is the capacity's name after its domain, upper-case, or its whole name where
  two capacities would set the same variable (``memory`` and ``example.com/memory``:
  ``MEMORY`` and ``EXAMPLE_COM_MEMORY``; ``cdi.claim.capacity_keys``): no variable is set twice;
- on NVIDIA GPUs, unless the claim's ``GpuConfig`` says ``sharing.mpsLimits: false``, the CUDA
  MPS client limits: ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` from ``compute`` (percent of the
  GPU) and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<MiB>M`` from ``memory`` (device 0: the share's
  GPU as the container sees it when it is the container's only GPU). They bind only where an
  MPS control daemon serves the container; elsewhere the share is accounted, not enforced.

A claim config's ``env`` goes on every device it applies to, shared or not.
"""

from __future__ import annotations

import re

from agent.prepare.allocation import ClaimFailed, Result
from agent.prepare.claimconfig import Config, GpuConfig, env_of
from agent.quantity import parse_quantity, plain
from cdi.claim import ClaimDevice, capacity_keys, env_name
from discovery.models import Device


def device_key(device: str, share_id: str | None) -> str:
    """The per-claim ID of a result: ``<device>`` or ``<device>-<shareID>``."""
    return f"{device}-{share_id}" if share_id else device


_SHARE_SUFFIX = re.compile(r"^(.+)-([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})$")


def split_key(key: str) -> dict:
    """``device_key``'s inverse -> ``{"device", "shareID"}`` (adopting specs of a lost checkpoint)."""
    m = _SHARE_SUFFIX.match(key)
    return {"device": m.group(1), "shareID": m.group(2)} if m else {"device": key, "shareID": None}


def share_env(dev: Device, share_id: str, consumed: tuple[tuple[str, str], ...], config: Config | None) -> list[str]:
    per_device = env_name(dev.name)
    env = [f"SYSDRA_SHARE_ID={share_id}", f"SYSDRA_SHARE_DEVICE={dev.name}", f"{per_device}_SHARE={share_id}"]
    values = {}
    try:
        keys = capacity_keys(name for name, _ in consumed)
    except ValueError as err:
        raise ClaimFailed(f"share {share_id} of {dev.name}: {err}") from None
    for name, quantity in consumed:
        key = keys[name]
        values[name] = parse_quantity(quantity)  # checked by allocation.our_results
        env += [f"SYSDRA_SHARE_{key}={quantity}", f"SYSDRA_SHARE_{key}_VALUE={plain(values[name])}",
                f"{per_device}_{key}={quantity}"]
    mps = not isinstance(config, GpuConfig) or config.sharing.mpsLimits
    if dev.kind == "gpu" and dev.pci.vendor_id == "10de" and mps:
        if "compute" in values:
            pct = max(1, min(100, int(values["compute"])))
            env.append(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={pct}")
        if "memory" in values and values["memory"] >= 2**20:
            env.append(f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={int(values['memory'] // 2**20)}M")
    return env


def claim_device(dev: Device, result: Result, config: Config | None) -> ClaimDevice:
    """The CDI device of one allocation result."""
    env = share_env(dev, result.share_id, result.consumed, config) if result.share_id else []
    return ClaimDevice(dev, device_key(dev.name, result.share_id), tuple(env + env_of(config)))


def recorded(dev: Device, record: dict) -> ClaimDevice:
    """The CDI device of a checkpointed device record (rebuilding the spec after a reboot)."""
    # an older agent may have recorded a variable twice: the first one is what it meant
    env: dict[str, str] = {}
    for e in record.get("cdiEnv") or ():
        env.setdefault(e.partition("=")[0], e)
    return ClaimDevice(dev, device_key(dev.name, record.get("shareID")), tuple(env.values()))
