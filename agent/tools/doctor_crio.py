"""``sysdra doctor``'s check of CRI-O's config: CDI reads the agent's spec dir, NRI is on at the
agent's socket and takes external plugins.

CRI-O reads ``/etc/crio/crio.conf`` and then every file below ``/etc/crio/crio.conf.d`` in
lexical order, a later file's keys replacing an earlier's one by one (``UpdateFromPath``). CDI is
always on, its specs read from ``[crio.runtime] cdi_spec_dirs`` (default ``/etc/cdi``,
``/var/run/cdi``). NRI (``[crio.nri]``) is on by default since CRI-O 1.30 (``enable_nri``; off
before, so an unset key is a warning), listening on ``nri_listen`` (default
``/var/run/nri/nri.sock``); ``nri_disable_connections = true`` shuts out every plugin not started
by CRI-O itself, the agent's included.
"""

from __future__ import annotations

import os
import tomllib

from agent.fsutil import read_bounded
from agent.tools.doctor_runtime import CDI_DIRS, MAX_CONFIG_BYTES, _merge
from agent.tools.findings import Finding, ok

CRIO_CONFIG = "etc/crio/crio.conf"  # under the root
CRIO_DROP_INS = "etc/crio/crio.conf.d"
NRI_SOCKET = "/var/run/nri/nri.sock"


def config_files(path: str, drop_ins: str) -> list[str]:
    """The files CRI-O reads, in its order: the main file, then every file below the drop-in dir
    as Go's ``filepath.Walk`` visits them (each directory's entries by name, a subdirectory's
    files where its name sorts)."""
    return ([path] if os.path.isfile(path) else []) + _walk(drop_ins)


def _walk(top: str) -> list[str]:
    try:
        names = sorted(os.listdir(top))
    except OSError:
        return []
    out: list[str] = []
    for name in names:
        p = os.path.join(top, name)
        out += _walk(p) if os.path.isdir(p) else [p]
    return out


def check_crio(root: str, nri_socket: str, cdi_dir: str, path: str | None = None, drop_ins: str | None = None) -> list[Finding]:
    path = path or os.path.join(root, CRIO_CONFIG)
    drop_ins = drop_ins or os.path.join(root, CRIO_DROP_INS)
    files = config_files(path, drop_ins)
    if not files:
        return [Finding("crio", "skip", f"no CRI-O config at {path} or {drop_ins}: CRI-O is not checked")]
    config: dict = {}
    for name in files:
        try:
            _merge(config, tomllib.loads(read_bounded(name, MAX_CONFIG_BYTES).decode()))
        except (OSError, ValueError, RecursionError) as err:  # (TOMLDecodeError, not UTF-8: ValueErrors)  # (nested too deep to parse)
            why = "nested too deep" if isinstance(err, RecursionError) else err
            return [Finding("crio", "warn", f"{name}: cannot read it: {why}", "check the file (crio config shows what CRI-O reads)")]
    crio = config.get("crio") if isinstance(config.get("crio"), dict) else {}
    where = ", ".join(files)
    return [_cdi(where, _table(crio, "runtime"), cdi_dir), _nri(where, _table(crio, "nri"), nri_socket)]


def _table(crio: dict, name: str) -> dict:
    table = crio.get(name)
    return table if isinstance(table, dict) else {}


def _cdi(where: str, runtime: dict, cdi_dir: str) -> Finding:
    dirs = runtime.get("cdi_spec_dirs", list(CDI_DIRS))
    if isinstance(dirs, list) and os.path.normpath(cdi_dir) not in {os.path.normpath(str(d)) for d in dirs}:
        return Finding("crio-cdi", "fail", f"{where}: cdi_spec_dirs {dirs} lacks the agent's cdi_dir {cdi_dir}: "
                                           "containers get none of the claims' devices",
                       f"add {cdi_dir} to cdi_spec_dirs in [crio.runtime] (a drop-in in /etc/crio/crio.conf.d), "
                       "or set cdi_dir to one of them; then restart CRI-O")
    return ok("crio-cdi", f"CRI-O reads CDI specs from {cdi_dir}")


def _nri(where: str, nri: dict, nri_socket: str) -> Finding:
    if not nri_socket:
        return Finding("crio-nri", "skip", "nri_socket is empty: the agent does not use NRI")
    fix = "set enable_nri = true in [crio.nri] (a drop-in in /etc/crio/crio.conf.d), then restart CRI-O"
    enabled = nri.get("enable_nri")
    if enabled is False:
        return Finding("crio-nri", "fail", f"{where}: enable_nri = false: claimed NICs' netdevs stay on the host", fix)
    if nri.get("nri_disable_connections") is True:
        return Finding("crio-nri", "fail", f"{where}: nri_disable_connections = true: no external plugin, the agent "
                                           "included, may connect", "set nri_disable_connections = false in [crio.nri]")
    served = nri.get("nri_listen", NRI_SOCKET)
    if os.path.normpath(str(served)) != os.path.normpath(nri_socket):
        return Finding("crio-nri", "warn", f"{where}: CRI-O serves NRI at {served}, the agent connects to {nri_socket}",
                       "make nri_socket and nri_listen name the same socket (the DaemonSet mounts the host's /var/run/nri)")
    if enabled is None:
        return Finding("crio-nri", "warn", f"{where}: enable_nri is not set: CRI-O 1.30 and later have NRI on, earlier "
                                           "ones off (claimed NICs' netdevs would stay on the host)", fix)
    return ok("crio-nri", f"CRI-O serves NRI at {served}")
