"""``sysdra doctor``'s check of the node's IPAM pools (``nic_ipam``; docs/networking.md, "Addresses
from an IPAM pool"): each pool's plugin is in ``cni_bin_dir`` under the root, runs, and speaks CNI
1.0 (asked with ``CNI_COMMAND=VERSION``, which changes nothing), and the pools have the NRI plugin
they serve (leases are made when it moves a netdev)."""

from __future__ import annotations

import json
import subprocess

from agent.tools.findings import Finding, ok

CHECK = "ipam"


def check_ipam(settings) -> list[Finding]:
    if not settings.nic_ipam:
        return []
    from agent.prepare.ipam import CNI_VERSION, Ipam

    ipam = Ipam.of(settings)
    found = []
    if not settings.nri_socket:
        found.append(Finding(CHECK, "warn", "nic_ipam has pools but NRI is off (nri_socket: \"\"): no netdev moves, so no "
                             "lease is ever made", "turn NRI on (docs/networking.md) or remove nic_ipam"))
    for name, config in sorted(settings.nic_ipam.items()):
        plugin = ipam.plugin(name)
        fix = f"install the CNI plugin {config['type']!r} in {settings.cni_bin_dir} (containernetworking-plugins), or set cni_bin_dir"
        try:
            done = subprocess.run([plugin], input=b"{}", env={"CNI_COMMAND": "VERSION"}, capture_output=True, timeout=10)
            versions = json.loads(done.stdout).get("supportedVersions") or []
            if not isinstance(versions, list) or not all(isinstance(v, str) for v in versions):
                raise ValueError(f"supportedVersions is not a list of versions: {versions!r}"[:200])
        except (OSError, subprocess.TimeoutExpired, ValueError, AttributeError, RecursionError) as err:
            why = "its VERSION answer is nested too deep" if isinstance(err, RecursionError) else err
            found.append(Finding(CHECK, "fail", f"IPAM pool {name}: {plugin} does not run as a CNI plugin: {why}", fix))
            continue
        if CNI_VERSION not in versions:
            found.append(Finding(CHECK, "fail", f"IPAM pool {name}: {plugin} speaks CNI {', '.join(versions) or '?'}, "
                                 f"not {CNI_VERSION}", "install a CNI plugin release of 2021 or later (CNI 1.0)"))
            continue
        found.append(ok(CHECK, f"IPAM pool {name}: {config['type']} at {plugin} (CNI {CNI_VERSION})"))
    return found
