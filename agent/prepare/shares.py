"""Prepare per share: what one allocation result becomes in the claim's CDI spec.

A result of a multi-allocatable device carries a ``shareID`` and its ``consumedCapacity``
(docs/sharing.md). Each share is its own CDI device ``<claimUID>-<device>-<shareID>`` (the
dra-example-driver's naming; identical names for two shares broke container creation upstream,
kubernetes#134519), with the same device nodes and the share's environment:

- ``SYSDRA_SHARE_ID``, ``SYSDRA_SHARE_DEVICE`` and ``SYSDRA_SHARE_<CAPACITY>`` (the consumed
  quantity as the scheduler wrote it, e.g. ``20Gi``) with ``SYSDRA_SHARE_<CAPACITY>_VALUE`` (the
  plain number) — where all the claim's shares are of one device;
- the same per device, ``SYSDRA_DEVICE_<NAME>_SHARE`` and ``SYSDRA_DEVICE_<NAME>_<CAPACITY>``,
  which stay distinct when one container holds shares of several devices;
- a container may be given all of a claim's CDI devices, and a runtime keeps one of two values of
  a variable: so every CDI device of a claim's shares of one device carries them together (IDs
  comma-separated, capacities and MPS limits summed, a sum as a plain number);
- ``<CAPACITY>`` is the capacity's name after its domain, upper-case, or its whole name where
  two capacities would set the same variable (``memory`` and ``example.com/memory``:
  ``MEMORY`` and ``EXAMPLE_COM_MEMORY``; ``cdi.claim.capacity_keys``): no variable is set twice;
- on NVIDIA GPUs, unless the claim's ``GpuConfig`` says ``sharing.mpsLimits: false``, the CUDA
  MPS client limits: ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` from ``compute`` (percent of the
  GPU) and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<MiB>M`` from ``memory`` (device 0: the share's
  GPU as the container sees it when it is the container's only GPU). They bind only where an
  MPS control daemon serves the container; elsewhere the share is accounted, not enforced. A
  client has one daemon and one set of limits: a claim with MPS shares of two GPUs is refused.

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


def _share_env(dev: Device, group: list[tuple[Result, Config | None]], generic: bool) -> list[str]:
    """The environment of every CDI device of ``group``: the claim's shares of ``dev``."""
    one = len(group) == 1
    ids = ",".join(r.share_id for r, _ in group)
    per_device = env_name(dev.name)
    env = [f"SYSDRA_SHARE_ID={ids}", f"SYSDRA_SHARE_DEVICE={dev.name}"] if generic else []
    env.append(f"{per_device}_SHARE={ids}")
    totals, written = {}, {}
    for r, _ in group:
        for name, quantity in r.consumed:  # checked by allocation.our_results
            totals[name] = totals.get(name, 0) + parse_quantity(quantity)
            written[name] = quantity
    try:
        keys = capacity_keys(totals)
    except ValueError as err:
        raise ClaimFailed(f"share {ids} of {dev.name}: {err}") from None
    for name, total in totals.items():
        key, shown = keys[name], written[name] if one else plain(total)  # several: the sum, a plain number
        if generic:
            env += [f"SYSDRA_SHARE_{key}={shown}", f"SYSDRA_SHARE_{key}_VALUE={plain(total)}"]
        env.append(f"{per_device}_{key}={shown}")
    mps = {not isinstance(config, GpuConfig) or config.sharing.mpsLimits for _, config in group}
    if len(mps) > 1:
        raise ClaimFailed(f"the claim's shares of {dev.name} differ in sharing.mpsLimits: one container may hold "
                          "them all, and an MPS client has one set of limits")
    if dev.kind == "gpu" and dev.pci.vendor_id == "10de" and mps == {True}:
        if "compute" in totals:
            pct = max(1, min(100, int(totals["compute"])))
            env.append(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={pct}")
        if "memory" in totals and totals["memory"] >= 2**20:
            env.append(f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={int(totals['memory'] // 2**20)}M")
    return env


def claim_devices(entries: list[tuple[Device, Result, Config | None]]) -> list[ClaimDevice]:
    """The CDI device of each allocation result of a claim, in order. A container may be given
    all of a claim's CDI devices, so they never set one variable to two values: every share of a
    device carries the claim's shares of it together (IDs, summed capacities and MPS limits),
    and the generic ``SYSDRA_SHARE_*`` only where all the claim's shares are of one device."""
    groups: dict[str, list[tuple[Result, Config | None]]] = {}
    for dev, r, config in entries:
        if r.share_id:
            groups.setdefault(dev.name, []).append((r, config))
    by_name = {dev.name: dev for dev, _, _ in entries}
    envs = {name: _share_env(by_name[name], group, len(groups) == 1) for name, group in groups.items()}
    return [ClaimDevice(dev, device_key(dev.name, r.share_id), tuple((envs[dev.name] if r.share_id else []) + env_of(config)))
            for dev, r, config in entries]


def claim_device(dev: Device, result: Result, config: Config | None) -> ClaimDevice:
    """The CDI device of a claim's only allocation result."""
    return claim_devices([(dev, result, config)])[0]


def one_mps_gpu(devices: list[ClaimDevice]) -> None:
    """ClaimFailed for a claim with MPS clients of two GPUs: a CUDA process talks to one control
    daemon (one ``/tmp/nvidia-mps``) under one set of limits, so a container given both would
    keep one GPU's pipe and limits. Separate claims (for separate containers) serve them."""
    gpus = list(dict.fromkeys(c.device.name for c in devices if any(e.startswith("CUDA_MPS_") for e in c.env)))
    if len(gpus) > 1:
        raise ClaimFailed(f"the claim holds MPS shares of {len(gpus)} GPUs ({', '.join(gpus)}): a container is a "
                          "client of one GPU's MPS daemon; ask for each GPU's share in a claim of its own")


def recorded(dev: Device, record: dict) -> ClaimDevice:
    """The CDI device of a checkpointed device record (rebuilding the spec after a reboot)."""
    # an older agent may have recorded a variable twice: the first one is what it meant
    env: dict[str, str] = {}
    for e in record.get("cdiEnv") or ():
        env.setdefault(e.partition("=")[0], e)
    return ClaimDevice(dev, device_key(dev.name, record.get("shareID")), tuple(env.values()))
