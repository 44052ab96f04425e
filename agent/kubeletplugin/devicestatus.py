"""ResourceClaim ``status.devices`` entries (KEP-4817): their limits and checks, exactly as
kube-apiserver v1.37 validates them (``pkg/apis/resource/validation``: ``validateDeviceStatus``,
``validateNetworkDeviceData``, ``validateRawExtension``; apimachinery ``ValidateConditions``).

An entry the server would reject with 422 makes the whole status write fail, and with it the
entries that were fine, so every entry is checked before it is written (``problems``).
"""

from __future__ import annotations

import ipaddress
import re

import orjson

from agent.names import is_label, is_subdomain

from agent.apilimits import (MAX_CONDITIONS, MAX_DATA_BYTES, MAX_DRIVER, MAX_HARDWARE_ADDRESS, MAX_INTERFACE_NAME,
                             MAX_IPS, MAX_MESSAGE, MAX_POOL, MAX_REASON)

_REASON = re.compile(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
STATUSES = ("True", "False", "Unknown")


def key(entry: dict) -> tuple[str, str, str, str]:
    """The list-map key of ``status.devices``: driver, pool, device, shareID."""
    return entry.get("driver", ""), entry.get("pool", ""), entry.get("device", ""), entry.get("shareID") or ""


def is_k8s_uuid(value: object) -> bool:
    """``format=k8s-uuid``: RFC 4122 normalized form, lower-case."""
    return isinstance(value, str) and _UUID.fullmatch(value) is not None


def _label_name_problem(value: str) -> str | None:
    """metav1 ``ValidateLabelName``: ``[prefix/]name``, prefix a DNS subdomain, name <= 63."""
    prefix, sep, name = value.rpartition("/")
    if sep and not (prefix and is_subdomain(prefix)):
        return "prefix must be a DNS subdomain"
    if not name or len(name) > 63 or not _QUALIFIED_NAME.fullmatch(name):
        return "must be a qualified name (alphanumerics, '-', '_', '.', at most 63, alphanumeric at both ends)"
    return None


def _pool_problem(pool: object) -> str | None:
    if not isinstance(pool, str) or not pool:
        return "pool is required"
    if len(pool) > MAX_POOL:
        return f"pool is longer than {MAX_POOL}"
    if not all(is_subdomain(part) for part in pool.split("/")):
        return "pool must be DNS subdomains separated by '/'"
    return None


def canonical_interface_address(value: str) -> str | None:
    """The canonical ``ip/prefix`` form the server demands (``IsValidInterfaceAddress``), or
    None when ``value`` is not an interface address at all."""
    if "/" not in value:
        return None
    try:
        iface = ipaddress.ip_interface(value)
    except ValueError:
        return None
    ip, prefix = iface.ip, iface.network.prefixlen
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        if prefix < 96:  # Go prints it as IPv4 with a negative prefix ("1.2.3.4/-32"): never valid
            return None
        return f"{ip.ipv4_mapped}/{prefix - 96}"  # Go prints a mapped address as IPv4
    return f"{ip}/{prefix}"


def condition_problems(cond: object, where: str) -> list[str]:
    if not isinstance(cond, dict):
        return [f"{where}: not an object"]
    out = []
    ctype = cond.get("type")
    if not isinstance(ctype, str) or not ctype:
        out.append(f"{where}.type: required")
    elif problem := _label_name_problem(ctype):
        out.append(f"{where}.type {ctype[:80]!r}: {problem}")
    if cond.get("status") not in STATUSES:
        out.append(f"{where}.status: must be one of {', '.join(STATUSES)}")
    gen = cond.get("observedGeneration", 0)
    if type(gen) is not int or gen < 0:
        out.append(f"{where}.observedGeneration: must be an integer >= 0")
    if not cond.get("lastTransitionTime"):
        out.append(f"{where}.lastTransitionTime: required")
    reason = cond.get("reason")
    if not isinstance(reason, str) or not reason:
        out.append(f"{where}.reason: required")
    else:
        if not _REASON.fullmatch(reason):
            out.append(f"{where}.reason {reason[:80]!r}: must start with a letter and hold only letters, digits and '_,:'")
        if len(reason) > MAX_REASON:
            out.append(f"{where}.reason: longer than {MAX_REASON} bytes")
    message = cond.get("message", "")
    if not isinstance(message, str) or len(message) > MAX_MESSAGE:
        out.append(f"{where}.message: must be a string of at most {MAX_MESSAGE} bytes")
    return out


def network_problems(net: object, where: str) -> list[str]:
    if net is None:
        return []
    if not isinstance(net, dict):
        return [f"{where}: not an object"]
    out = []
    for field, limit in (("interfaceName", MAX_INTERFACE_NAME), ("hardwareAddress", MAX_HARDWARE_ADDRESS)):
        value = net.get(field, "")
        if not isinstance(value, str):
            out.append(f"{where}.{field}: not a string")
        elif len(value.encode()) > limit:
            out.append(f"{where}.{field}: longer than {limit} bytes")
    ips = net.get("ips") or []
    if not isinstance(ips, list):
        return out + [f"{where}.ips: not a list"]
    if len(ips) > MAX_IPS:
        out.append(f"{where}.ips: {len(ips)} addresses, at most {MAX_IPS}")
    if len(set(map(str, ips))) != len(ips):
        out.append(f"{where}.ips: duplicate addresses")
    for ip in ips:
        canon = canonical_interface_address(ip) if isinstance(ip, str) else None
        if canon is None:
            out.append(f"{where}.ips: {str(ip)[:80]!r} is not an address in CIDR form (e.g. 192.0.2.5/24)")
        elif canon != ip:
            out.append(f"{where}.ips: {ip!r} is not in canonical form ({canon!r})")
    return out


def data_problems(data: object, where: str) -> list[str]:
    if data is None:
        return []
    if not isinstance(data, dict):
        return [f"{where}: must be a JSON object"]
    size = len(orjson.dumps(data))
    if size > MAX_DATA_BYTES:
        return [f"{where}: {size} bytes of JSON, at most {MAX_DATA_BYTES}"]
    return []


def problems(entry: object, allocated: set[tuple[str, str, str, str]] | None = None) -> list[str]:
    """Why the server would reject this ``status.devices`` entry ([] when it would not).
    ``allocated``: the claim's allocated (driver, pool, device, shareID) keys, when known."""
    if not isinstance(entry, dict):
        return ["entry is not an object"]
    where = "/".join(str(part) for part in key(entry)[:3] if part)
    out = []
    driver = entry.get("driver")
    if not (isinstance(driver, str) and len(driver) <= MAX_DRIVER and is_subdomain(driver)):
        out.append(f"{where}: driver must be a DNS subdomain of at most {MAX_DRIVER}")
    if problem := _pool_problem(entry.get("pool")):
        out.append(f"{where}: {problem}")
    if not is_label(entry.get("device")):
        out.append(f"{where}: device must be a DNS label")
    share = entry.get("shareID")
    if share is not None and not is_k8s_uuid(share):
        out.append(f"{where}: shareID must be a lower-case RFC 4122 UUID")
    if allocated is not None and key(entry) not in allocated:
        out.append(f"{where}: must be an allocated device in the claim")
    conditions = entry.get("conditions") or []
    if not isinstance(conditions, list):
        out.append(f"{where}.conditions: not a list")
        conditions = []
    if len(conditions) > MAX_CONDITIONS:
        out.append(f"{where}.conditions: {len(conditions)}, at most {MAX_CONDITIONS}")
    types = [c.get("type") for c in conditions if isinstance(c, dict)]
    if len(set(types)) != len(types):
        out.append(f"{where}.conditions: duplicate types")
    for i, cond in enumerate(conditions):
        out += condition_problems(cond, f"{where}.conditions[{i}]")
    out += data_problems(entry.get("data"), f"{where}.data")
    out += network_problems(entry.get("networkData"), f"{where}.networkData")
    return out


def allocated_keys(claim: dict) -> set[tuple[str, str, str, str]]:
    """The (driver, pool, device, shareID) keys ``status.allocation`` holds."""
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    return {key(r) for r in results if isinstance(r, dict)}
