"""Checks of the settings that name network things: the metrics endpoint's address and the
node's IPAM pools (``nic_ipam``); agent/settings.py runs them."""

from __future__ import annotations

import json
import re

from agent.names import is_label


def ipam_config_problem(config: object, limit: int = 16 << 10) -> str | None:
    """Why ``config`` is not a CNI IPAM configuration the agent runs: its ``type`` names a plugin
    file of ``cni_bin_dir``, never a path (agent/prepare/ipam.py runs it as root); at most ``limit`` bytes."""
    if not isinstance(config, dict) or not re.fullmatch(r"[a-z0-9][a-z0-9._-]{0,62}", str(config.get("type"))):
        return "needs a 'type' naming a CNI IPAM plugin (host-local, whereabouts, ...)"
    if len(json.dumps(config)) > limit:
        return f"larger than {limit >> 10} KiB"
    return None


def nic_ipam(v: dict[str, dict]) -> dict[str, dict]:
    """``nic_ipam``: pool name (a DNS label) -> a CNI IPAM configuration (``ipam_config_problem``)."""
    for name, config in v.items():
        if not is_label(name):
            raise ValueError(f"pool {name!r}: not a DNS label")
        if problem := ipam_config_problem(config):
            raise ValueError(f"pool {name!r}: {problem}")
    return v


def parse_address(address: str) -> tuple[str, int]:
    """``"127.0.0.1:9478"``, ``"[::1]:9478"`` -> (host, port). An empty host is refused:
    binding every interface must be written out (``0.0.0.0:9478``)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"metrics address {address!r}: expected HOST:PORT")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"metrics address {address!r}: port is not a number") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"metrics address {address!r}: port out of range")
    return host, number


def metrics_address(v: str) -> str:
    if v:
        try:
            parse_address(v)
        except ValueError as err:
            raise ValueError(str(err).removeprefix(f"metrics address {v!r}: ") + f" ({v!r}; \"\" disables)") from None
    return v
