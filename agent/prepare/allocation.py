"""Our part of a claim's allocation, checked before anything is recorded or written.

The claim object is input: ``status.allocation.devices.results`` may hold anything. Each
of our results must have the API's types and formats (request and device names, a string
``shareID``, a boolean ``adminAccess``), and no device (or share of one) may be allocated
twice; otherwise the claim fails as a whole with a message saying which result is wrong.

Results whose ``skipNodeOperations`` (KEP-5945, copied from their slice at allocation) skip
NodePrepareResources are left out: the kubelet calls us for a claim only when some of our
devices need preparing, and those that do not are never an error."""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent import nodeops
from agent.apilimits import MAX_ATTRIBUTES_AND_CAPACITIES, MAX_POOL, MAX_RESULTS
from agent.names import InvalidName, check_label, check_request, is_subdomain, is_uid
from agent.quantity import parse_quantity


class ClaimFailed(Exception):
    """One claim cannot be prepared; the message goes to the kubelet as that claim's error."""


@dataclass(frozen=True)
class Result:
    """One allocation result of our driver."""

    request: str  # "req" or "req/sub"
    pool: str
    device: str
    share_id: str | None
    consumed: tuple[tuple[str, str], ...] = ()  # consumedCapacity of a share: (capacity, quantity), by name
    admin: bool = False  # adminAccess: monitoring beside the device's other claims (prepare/ownership.py)


_CAPACITY_NAME = re.compile(r"^(?:[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?/)?[A-Za-z_][A-Za-z0-9_]{0,31}$")


def _consumed(i: int, value: object) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_ATTRIBUTES_AND_CAPACITIES:
        raise ClaimFailed(f"allocation result {i}: consumedCapacity is not a map of at most {MAX_ATTRIBUTES_AND_CAPACITIES} capacities")
    out = []
    for name in value:
        if not isinstance(name, str) or not _CAPACITY_NAME.match(name):
            raise ClaimFailed(f"allocation result {i}: consumedCapacity name {str(name)[:80]!r} is not a capacity name")
    for name, q in sorted(value.items()):
        try:
            if parse_quantity(q) < 0:
                raise ValueError(f"{q!r} is negative")
        except ValueError as err:
            raise ClaimFailed(f"allocation result {i}: consumedCapacity {name}: {err}") from None
        out.append((name, q))
    return tuple(out)


def allocated(claim: dict, field: str, limit: int) -> list:
    """``status.allocation.devices.<field>`` of the claim: a list of at most ``limit``
    entries (none when unallocated), or ClaimFailed naming the level that has the wrong shape."""
    node, path = claim, ""
    for key in ("status", "allocation", "devices"):
        node, path = node.get(key), f"{path}.{key}" if path else key
        if node is None:
            return []
        if not isinstance(node, dict):
            raise ClaimFailed(f"{path} is not an object")
    entries = node.get(field)
    if entries is None:
        return []
    if not isinstance(entries, list) or len(entries) > limit:
        raise ClaimFailed(f"{path}.{field} is not a list of at most {limit} entries (the API server's limit)")
    return entries


def our_results(claim: dict, driver_name: str) -> tuple[list[dict], list[Result]]:
    """-> (our raw results, in order, for the fingerprint; the checked ones), or ClaimFailed."""
    raw: list[dict] = []
    checked: list[Result] = []
    seen: set[tuple[str, str, str | None]] = set()
    for i, r in enumerate(allocated(claim, "results", MAX_RESULTS)):
        if not isinstance(r, dict):
            raise ClaimFailed(f"allocation result {i} is not an object")
        if r.get("driver") != driver_name:
            continue
        skip = r.get("skipNodeOperations")
        if skip is not None and not (isinstance(skip, list) and all(isinstance(op, str) for op in skip)):
            raise ClaimFailed(f"allocation result {i}: skipNodeOperations is not a list of strings")
        if nodeops.skips(skip, nodeops.PREPARE):  # KEP-5945: this device needs no node work
            continue
        try:
            request = check_request(r.get("request"))
            pool, device = r.get("pool"), r.get("device")
            if not isinstance(pool, str) or len(pool) > MAX_POOL or not all(map(is_subdomain, pool.split("/"))):
                raise ClaimFailed(f"allocation result {i}: pool {str(pool)[:80]!r} is not DNS subdomains "
                                  f"separated by '/', at most {MAX_POOL} characters")
            check_label(f"allocation result {i}: device", device)
        except InvalidName as err:
            raise ClaimFailed(f"allocation result {i}: {err}") from None
        share = r.get("shareID")
        if share is not None and not is_uid(share):
            raise ClaimFailed(f"allocation result {i}: shareID {str(share)[:80]!r} is not a UID string")
        admin = r.get("adminAccess")
        if admin is not None and not isinstance(admin, bool):
            raise ClaimFailed(f"allocation result {i}: adminAccess {str(admin)[:80]!r} is not a boolean")
        key = (pool, device, share or None)
        if key in seen:
            what = f"share {share} of device" if share else "device"
            raise ClaimFailed(f"allocation result {i}: {what} {pool}/{device} is allocated twice")
        seen.add(key)
        raw.append(r)
        checked.append(Result(request, pool, device, share or None, _consumed(i, r.get("consumedCapacity")), bool(admin)))
    return raw, checked
