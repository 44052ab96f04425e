"""Addresses for a claim's netdev from an IPAM pool of the node (``nic_ipam``; docs/networking.md,
"Addresses from an IPAM pool"): a CNI IPAM plugin (host-local, whereabouts, dhcp, static ...) run
as the container runtime runs one, once per pod sandbox, so every pod of a claim template gets an
address of its own where a ``NicConfig``'s static ``addresses`` would give all of them the same.

The pools are the node admin's: a pool names a plugin and its ``ipam`` configuration, and a
claim's ``NicConfig`` names a pool (``ipamPool``), never a plugin or a configuration, because the
agent runs the plugin as root with what the configuration says (a claim author could otherwise
run any CNI plugin of the node, or point host-local's ``dataDir`` anywhere).

CNI 1.0 (the CNI spec's "Execution protocol"): the plugin ``<cni_bin_dir>/<type>``, its environment
``CNI_COMMAND`` ADD or DEL, ``CNI_CONTAINERID`` the sandbox's ID, ``CNI_NETNS`` its namespace,
``CNI_IFNAME`` the netdev's name in the pod (where it is when the ADD runs: dhcp looks it up),
``CNI_PATH``, ``CNI_ARGS`` the sandbox's pod as the runtime gives it (whereabouts needs it); on stdin the network configuration
``{cniVersion, name: sysdra-<pool>, ipam}``; an ADD's result (``ips``, ``routes``) on stdout, an
error as ``{code, msg, details}``. A lease is keyed by sandbox and interface name: host-local
refuses a second ADD for the same pair, so an ADD whose result was not recorded (a crash) is
released (DEL, which takes what is not there) before it is asked again. host-local keeps its
leases under ``<plugin dir>/ipam`` unless the pool says ``dataDir``: the agent's own state, which
outlives its restarts (a container's own file system would not). Blocking: worker threads only.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import subprocess
from collections.abc import Mapping

from pydantic import ValidationError

from agent.prepare.netdevs import MAX_ADDRESSES, MAX_ROUTES, Route, cidr

log = logging.getLogger(__name__)

CNI_VERSION = "1.0.0"
# seconds a plugin may take: it runs holding the netdev records' lock, which every pod with a
# netdev waits for (agent/nri/movelock.py); the runtime gives up on the sandbox after ~2 s anyway
TIMEOUT = 10.0
_DEFAULT = {4: "0.0.0.0/0", 6: "::/0"}


class IpamError(Exception):
    """The pool's plugin gave no lease (or could not release one); the sandbox's error."""


class Ipam:
    @classmethod
    def of(cls, settings) -> Ipam:
        """The node's pools as the agent's settings say."""
        return cls(settings.nic_ipam, os.path.join(settings.root, settings.cni_bin_dir.lstrip("/")),
                   os.path.join(settings.plugin_dir, "ipam"))

    def __init__(self, pools: Mapping[str, dict], bin_dir: str, data_dir: str):
        self.pools = pools  # name -> the CNI ipam configuration (settings.nic_ipam)
        self.bin_dir = bin_dir  # the CNI plugins as the agent runs them (cni_bin_dir under the root)
        self.data_dir = data_dir  # host-local's leases unless the pool says where

    def refusal(self, pool: str) -> str | None:
        """Why a claim cannot name ``pool``, or None."""
        if pool in self.pools:
            return None
        return f"NicConfig ipamPool {pool!r} is not one of this node's IPAM pools ({', '.join(sorted(self.pools)) or 'none'}: nic_ipam)"

    def config_for(self, pool: str) -> dict:
        """The configuration a lease of ``pool`` is asked with now (host-local's leases where the
        agent keeps them unless the pool says). The move records it before the ADD, and the DEL that
        gives the lease back uses it, as CNI asks (a DEL gets the ADD's configuration): a pool
        changed or removed meanwhile still gives back what it leased."""
        if pool not in self.pools:
            raise IpamError(f"IPAM pool {pool!r} is not configured (nic_ipam) any more")
        config = dict(self.pools[pool])
        if config["type"] == "host-local":
            config.setdefault("dataDir", self.data_dir)
        return config

    def plugin(self, pool: str, config: dict | None = None) -> str:
        """The plugin of ``config`` (None: the pool's now) as the agent runs it."""
        return os.path.join(self.bin_dir, (config if config is not None else self.pools[pool])["type"])

    def _run(self, command: str, pool: str, config: dict, sandbox: str, netns: str | None, ifname: str,
             pod: str | None) -> bytes:
        plugin = self.plugin(pool, config)
        netconf = json.dumps({"cniVersion": CNI_VERSION, "name": f"sysdra-{pool}", "ipam": config}).encode()
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "CNI_COMMAND": command,
               "CNI_CONTAINERID": sandbox, "CNI_NETNS": netns or "", "CNI_IFNAME": ifname, "CNI_PATH": self.bin_dir}
        if pod:  # the sandbox's pod as the runtime names it (whereabouts allocates for it, and needs it)
            namespace, name = pod.split("/", 1)
            env["CNI_ARGS"] = (f"IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name};"
                               f"K8S_POD_INFRA_CONTAINER_ID={sandbox}")
        try:
            done = subprocess.run([plugin], input=netconf, env=env, capture_output=True, timeout=TIMEOUT)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise IpamError(f"IPAM pool {pool!r}: {plugin}: {err}") from None
        if done.returncode != 0:
            raise IpamError(f"IPAM pool {pool!r}: {command} failed: {_error(done.stdout, done.stderr)}")
        return done.stdout

    def lease(self, pool: str, sandbox: str, netns: str, ifname: str,
              config: dict | None = None, pod: str | None = None) -> tuple[list[str], list[Route]]:
        """A lease for the sandbox's netdev -> (addresses with their prefix, routes), asked with
        ``config`` (the move's ``ipamConfig``; None: the pool's now) for ``pod`` (the move's
        ``podRef``, namespace/name: CNI_ARGS as the runtime gives them). Whatever the pair held
        before (an ADD whose result was never recorded) is released first."""
        config = config if config is not None else self.config_for(pool)
        self.release(pool, sandbox, netns, ifname, config, pod)
        out = self._run("ADD", pool, config, sandbox, netns, ifname, pod)
        try:
            return _result(json.loads(out))
        except (ValueError, KeyError, TypeError, ValidationError, RecursionError) as err:  # (JSON nested too deep)
            self.release(pool, sandbox, netns, ifname, config, pod)
            why = "nested too deep" if isinstance(err, RecursionError) else err
            raise IpamError(f"IPAM pool {pool!r}: the plugin's result is not one this agent can use: {why}") from None

    def release(self, pool: str, sandbox: str, netns: str | None, ifname: str, config: dict | None = None,
                pod: str | None = None) -> None:
        """The sandbox's lease given back with ``config`` and ``pod``, those it was asked with (None:
        the pool's now, for a move recorded without it; no CNI_ARGS)."""
        self._run("DEL", pool, config if config is not None else self.config_for(pool), sandbox, netns, ifname, pod)


def _error(stdout: bytes, stderr: bytes) -> str:
    """A plugin's error as it gave it (``msg: details``), bounded."""
    try:
        doc = json.loads(stdout)
        text = f"{doc.get('msg')}" + (f": {doc['details']}" if doc.get("details") else "")
    except (ValueError, AttributeError, RecursionError):  # not a CNI error object (or nested too deep to tell)
        text = (stdout or stderr).decode(errors="replace").strip()
    return text[:500] or "no message"


def _result(doc: dict) -> tuple[list[str], list[Route]]:
    """A CNI result's addresses and routes, checked as a ``NicConfig``'s are. A route without a
    gateway takes the gateway of its family's address, as CNI has it; a default route needs one."""
    if not isinstance(doc, dict):
        raise ValueError(f"a result is a JSON object, not {type(doc).__name__}")
    ips = [(cidr(ip["address"]), ip.get("gateway")) for ip in doc.get("ips") or []]
    if not ips or len(ips) > MAX_ADDRESSES:
        raise ValueError(f"{len(ips)} addresses (1 to {MAX_ADDRESSES})")
    gateways = {ipaddress.ip_interface(a).version: gw for a, gw in ips if gw}
    routes = []
    for r in (doc.get("routes") or [])[:MAX_ROUTES]:
        family = ipaddress.ip_network(r["dst"], strict=False).version
        destination = "default" if r["dst"] == _DEFAULT[family] else r["dst"]
        routes.append(Route(destination=destination, gateway=r.get("gw") or gateways.get(family)))
    return [a for a, _ in ips], routes
