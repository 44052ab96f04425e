"""``sysdra doctor``'s checks of the container runtime's side and of kept GPU faults: the NRI
plugin's state (from the running agent), containerd's config (CDI and NRI on, the same NRI
socket and CDI dir as the agent's), and the GPU faults kept across restarts.

containerd 2.x (config ``version = 3``; 2.4 writes 4) has CDI and NRI on unless the config turns
them off; containerd 1.7 (``version = 2``) has both off unless it turns them on (``enable_cdi =
true``, an NRI section with ``disable = false``). A version 2 file may also be read by containerd
2.x (which migrates it, with its own defaults on), so an unset key there is a warning, not a
failure. Imports are followed as containerd follows them: each file's own ``imports``, imports of
imports included (``/etc/containerd/conf.d/*.toml`` only where a config imports it, as ``containerd
config default`` writes), their ``disabled_plugins`` added. containerd 2.x first migrates an
imported file of an older version (its CRI plugin's keys move to ``io.containerd.cri.v1.runtime``)
and merges its plugin keys into the config's, key by key (``containerd config dump`` of 2.4 shows
so; tests/test_doctor_runtime.py compares with it); containerd 1.7 replaces a plugin's whole table
with an imported file's.
"""

from __future__ import annotations

import glob
import os
import tomllib

from agent.fsutil import read_bounded
from agent.tools.findings import Finding, ok

CONTAINERD_CONFIG = "etc/containerd/config.toml"  # under the root
NRI = "io.containerd.nri.v1.nri"
# where enable_cdi and cdi_spec_dirs live, by config version
CRI = {2: "io.containerd.grpc.v1.cri", 3: "io.containerd.cri.v1.runtime", 4: "io.containerd.cri.v1.runtime"}
CDI_DIRS = ("/etc/cdi", "/var/run/cdi")  # containerd's default cdi_spec_dirs


# --- the NRI plugin, as the running agent reports it ---------------------------------------------
def check_nri(status: dict | None) -> list[Finding]:
    """``status``: the agent's status document (None: not running, which registration says)."""
    nri = (status or {}).get("nri")
    if nri is None:
        return []
    waiting = nri.get("claimsWaiting") or []
    claims = ", ".join(f"{c.get('namespace')}/{c.get('name')}" for c in waiting)
    stuck = f"; claims whose netdevs stay on the host: {claims}" if waiting else ""
    state, reason = nri.get("state"), nri.get("reason")
    if state == "registered":
        return [ok("nri", f"registered with {nri.get('runtime') or 'the runtime'} on {nri.get('socket')}: "
                          "claimed NICs' netdevs move into their pods")]
    if state == "disabled":
        return [Finding("nri", "skip", f"nri_socket is empty: claimed NICs' netdevs are never moved into pods{stuck}")]
    fix = ("enable NRI in the runtime (containerd 1.7: [plugins.\"io.containerd.nri.v1.nri\"] disable = false; CRI-O: "
           "[crio.nri] enable_nri = true) and point nri_socket at its socket; or nri_socket: \"\" on nodes without NICs to move")
    level = "fail" if waiting else "warn"
    return [Finding("nri", level, f"NRI plugin {state}: {reason or 'no reason given'}{stuck}", fix)]


# --- containerd's config -------------------------------------------------------------------------
def check_containerd(root: str, nri_socket: str, cdi_dir: str, path: str | None = None) -> list[Finding]:
    """containerd's config at ``path`` (default ``<root>/etc/containerd/config.toml``), its
    imports merged as containerd merges them."""
    path = path or os.path.join(root, CONTAINERD_CONFIG)
    try:
        config = _load(path, root)
    except FileNotFoundError:
        return [Finding("containerd", "skip", f"no containerd config at {path}: its defaults apply (2.x: CDI and NRI "
                                              "on; 1.7: both off); another runtime is not checked")]
    except (OSError, tomllib.TOMLDecodeError, ValueError, RecursionError) as err:  # (nested too deep to parse)
        why = "nested too deep" if isinstance(err, RecursionError) else err
        return [Finding("containerd", "warn", f"{path}: cannot read it: {why}", "check the file (containerd config dump)")]
    version = config.get("version", 1)
    if version not in CRI:
        return [Finding("containerd", "warn", f"{path}: config version {version}: containerd before 1.7 has no CDI",
                        "upgrade containerd to 2.x (or 1.7 with a version 2 config)")]
    plugins = config.get("plugins") if isinstance(config.get("plugins"), dict) else {}
    disabled = config.get("disabled_plugins") or []
    return [_cdi(path, version, _table(plugins, CRI[version]), disabled, cdi_dir),
            *_nri(path, version, _table(plugins, NRI), disabled, nri_socket)]


def _load(path: str, root: str) -> dict:
    """The config at ``path`` with its imports, theirs too (cmd/containerd/server/config/config.go,
    LoadConfigWithPlugins: breadth first, each file once)."""
    config = _read(path)
    version = config.get("version", 1)
    whole_tables = version == 2  # containerd 1.7: "Replace entire sections instead of merging map's values"
    loaded, pending = {path}, _imports(path, config, root)
    while pending:
        name, pending = pending[0], pending[1:]
        if name in loaded:
            continue
        loaded.add(name)
        more = _read(name)
        if isinstance(version, int) and version >= 3:
            _migrate(more)
        plugins = more.get("plugins")
        if isinstance(plugins, dict):
            if whole_tables:
                config.setdefault("plugins", {}).update(plugins)
            else:
                _merge(config.setdefault("plugins", {}), plugins)
        disabled = more.get("disabled_plugins")
        if isinstance(disabled, list):
            have = config.get("disabled_plugins") if isinstance(config.get("disabled_plugins"), list) else []
            config["disabled_plugins"] = have + [d for d in disabled if d not in have]
        pending += _imports(name, more, root)
    return config


MAX_CONFIG_BYTES = 4 << 20  # a runtime's config file: a few KiB


def _read(path: str) -> dict:
    return tomllib.loads(read_bounded(path, MAX_CONFIG_BYTES).decode())  # (a FIFO: refused, not waited on)


def _imports(path: str, config: dict, root: str) -> list[str]:
    """The files ``config`` (read from ``path``) imports, under the root, globs expanded."""
    imports = config.get("imports") or []
    if not isinstance(imports, list) or not all(isinstance(i, str) for i in imports):
        raise ValueError(f"{path}: imports is not a list of paths")
    out = []
    for pattern in imports:
        pattern = os.path.join(root, pattern.lstrip("/")) if os.path.isabs(pattern) else os.path.join(os.path.dirname(path), pattern)
        out += sorted(glob.glob(pattern))
    return out


def _migrate(config: dict) -> None:
    """What containerd 2.x does to an imported file of version 1 or 2 before merging it: the v1
    plugin name ``cri`` becomes ``io.containerd.grpc.v1.cri``, whose keys (enable_cdi,
    cdi_spec_dirs) the CRI runtime plugin takes where it has none (plugins/cri/runtime/plugin.go)."""
    version = config.get("version", 1)
    if not isinstance(version, int) or version >= 3:
        return
    plugins = config.get("plugins") if isinstance(config.get("plugins"), dict) else {}
    if version < 2:
        if "cri" in plugins:
            plugins[CRI[2]] = plugins.pop("cri")
        if isinstance(config.get("disabled_plugins"), list):
            config["disabled_plugins"] = [CRI[2] if d == "cri" else d for d in config["disabled_plugins"]]
    old = plugins.get(CRI[2])
    if isinstance(old, dict):
        new = plugins.setdefault(CRI[3], {})
        if isinstance(new, dict):
            for key in ("enable_cdi", "cdi_spec_dirs"):
                if key in old:
                    new.setdefault(key, old[key])


def _merge(into: dict, more: dict) -> None:
    """``more``'s keys into ``into``, tables merged key by key, anything else replaced."""
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _table(plugins: dict, name: str) -> dict | None:
    table = plugins.get(name)
    return table if isinstance(table, dict) else None


def _cdi(path: str, version: int, cri: dict | None, disabled: list, cdi_dir: str) -> Finding:
    section = f"[plugins.\"{CRI[version]}\"]"
    fix = f"set enable_cdi = true in {section} of {path}, then restart containerd"
    if CRI[version] in disabled:
        return Finding("containerd-cdi", "fail", f"{path}: the CRI plugin {CRI[version]} is disabled", f"remove it from disabled_plugins; {fix}")
    enabled = (cri or {}).get("enable_cdi")
    if enabled is False and version == 2:
        return Finding("containerd-cdi", "fail", f"{path}: enable_cdi = false: containers get none of the claims' devices", fix)
    if enabled is False:  # containerd 2.0 honours it; later 2.x dropped the key (CDI always on)
        return Finding("containerd-cdi", "warn", f"{path}: enable_cdi = false: a containerd 2.x that still knows the key "
                                                 "gives containers none of the claims' devices", f"remove enable_cdi = false from {section}")
    if enabled is None and version == 2:
        return Finding("containerd-cdi", "warn", f"{path}: enable_cdi is not set: containerd 1.7 then ignores CDI (2.x has "
                                                 "it on): containers would get none of the claims' devices", fix)
    dirs = (cri or {}).get("cdi_spec_dirs", list(CDI_DIRS))
    if isinstance(dirs, list) and os.path.normpath(cdi_dir) not in {os.path.normpath(str(d)) for d in dirs}:
        return Finding("containerd-cdi", "fail", f"{path}: cdi_spec_dirs {dirs} lacks the agent's cdi_dir {cdi_dir}",
                       f"add {cdi_dir} to cdi_spec_dirs in {section}, or set cdi_dir to one of them")
    return ok("containerd-cdi", f"{path}: CDI on, specs read from {cdi_dir}")


def _nri(path: str, version: int, nri: dict | None, disabled: list, nri_socket: str) -> list[Finding]:
    fix = f"add [plugins.\"{NRI}\"] with disable = false to {path}, then restart containerd"
    if not nri_socket:
        return [Finding("containerd-nri", "skip", "nri_socket is empty: the agent does not use NRI")]
    if NRI in disabled or (nri or {}).get("disable") is True:
        return [Finding("containerd-nri", "fail", f"{path}: NRI is disabled: claimed NICs' netdevs stay on the host", fix)]
    if (nri or {}).get("disable_connections") is True:
        return [Finding("containerd-nri", "fail", f"{path}: NRI's disable_connections = true: no external plugin, the agent "
                                                  "included, may connect", f"set disable_connections = false in [plugins.\"{NRI}\"]")]
    if version == 2 and (nri or {}).get("disable") is not False:  # 1.7's default is disable = true
        said = "no" if nri is None else "a"
        return [Finding("containerd-nri", "warn", f"{path}: {said} [plugins.\"{NRI}\"] section without disable = false: "
                                                  "containerd 1.7 then has NRI off (2.x on): claimed NICs' netdevs would "
                                                  "stay on the host", fix)]
    served = (nri or {}).get("socket_path", "/var/run/nri/nri.sock")
    if os.path.normpath(str(served)) != os.path.normpath(nri_socket):
        return [Finding("containerd-nri", "warn", f"{path}: containerd serves NRI at {served}, the agent connects to {nri_socket}",
                        "make nri_socket and socket_path name the same socket (the DaemonSet mounts the host's /var/run/nri)")]
    validator = (nri or {}).get("default_validator")
    if isinstance(validator, dict) and validator.get("enable") is True:
        return [ok("containerd-nri", f"{path}: NRI on at {served}, its default validator on (a pod's "
                                     "required-plugins.noderesource.dev annotation holds its containers until the agent is back)")]
    return [ok("containerd-nri", f"{path}: NRI on at {served}; its default validator is off: containers of a pod that "
                                 "starts while the agent is not registered start before their netdevs are moved in "
                                 "(docs/networking.md)")]


# --- kept GPU faults -----------------------------------------------------------------------------
def check_gpu_faults(plugin_dir: str, root: str) -> list[Finding]:
    """The GPU faults the agent keeps across restarts (agent/health/faults.py): each a warning."""
    from agent.health.faults import FaultStore

    store = FaultStore(plugin_dir, root)
    kept = store.load()
    found = [Finding("gpu-faults", "warn", problem, "fix or remove the file; the agent keeps no fault it cannot read")
             for problem in store.problems]
    for f in sorted(kept.values(), key=lambda f: f.device):
        found.append(Finding("gpu-fault", "warn", f"{f.device} ({f.uuid}) unhealthy since this boot's {f.reason}: "
                                                  f"{f.message}", f"reset the GPU (nvidia-smi -r) or reboot; after a "
                                                  f"reset, sysdra health clear {f.device}"))
    return found
