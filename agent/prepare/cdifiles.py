"""Our per-claim CDI spec files: ``<cdi-dir>/k8s.<driver>-claim_<claimUID>.json``.

Only files with our exact prefixes are ever listed, written or removed: the CDI directory is
shared with other drivers and the runtime. Paths read back from the checkpoint are not
trusted: :func:`is_ours` decides, from the name alone, whether a path is one of our files.
"""

from __future__ import annotations

import json
import logging
import os

from agent.fsutil import atomic_write_json, clean_stale_temps, read_bounded, remove_file
from agent.names import check_uid, is_uid
from cdi.spec import SpecError, validate, vendor_of

log = logging.getLogger(__name__)


def claim_spec_prefix(driver_name: str) -> str:
    return f"{vendor_of(driver_name)}-claim_"


def claim_spec_path(cdi_dir: str, driver_name: str, claim_uid: str) -> str:
    check_uid("claim uid", claim_uid)  # a UID has no separator: the path stays in cdi_dir
    return os.path.join(cdi_dir, f"{claim_spec_prefix(driver_name)}{claim_uid}.json")


def is_ours(cdi_dir: str, driver_name: str, path: object, uid: str = "") -> bool:
    """Whether ``path`` names one of our spec files in ``cdi_dir``: directly in it, with our
    claim or metadata prefix (``<vendor>-claim_``, ``<driver>_metadata_``) and ``.json``; with
    ``uid``, one of that claim's (a checkpoint entry never names another claim's file)."""
    if not isinstance(path, str) or os.path.dirname(path) != os.path.normpath(cdi_dir):
        return False
    name = os.path.basename(path)
    if not name.endswith(".json") or "\x00" in name:
        return False
    if uid:
        return name == f"{claim_spec_prefix(driver_name)}{uid}.json" or name.startswith(f"{driver_name}_metadata_{uid}_")
    return name.startswith((claim_spec_prefix(driver_name), f"{driver_name}_metadata_"))


def write_spec(path: str, spec: dict, check: bool = True) -> None:
    """Validate, then write atomically with mode 0644 (runtimes and non-root readers read it).
    ``check=False`` only for a spec fresh from :func:`cdi.spec.finish`, which validated it.

    Not fsynced: the CDI dir is tmpfs (/run/cdi) in production, and wherever it lives,
    ``Driver.recover()`` rewrites every prepared claim's specs from the checkpoint after a
    reboot (boot ID change), which is the only way to lose the page cache."""
    if check:
        validate(spec)
    atomic_write_json(path, spec, mode=0o644, durable=False, dir_mode=0o755)


MAX_SPEC_BYTES = 4 << 20  # a claim's spec is a few KiB


def read_spec(path: str) -> dict:
    """Parse and validate a spec file; SpecError names the file and the problem."""
    try:
        spec = json.loads(read_bounded(path, MAX_SPEC_BYTES))
        validate(spec)
    except (OSError, ValueError) as err:  # json.JSONDecodeError and SpecError are ValueErrors
        raise SpecError(f"{path}: {err}") from err
    except RecursionError:  # JSON nested too deep to parse: unreadable like any other damage
        raise SpecError(f"{path}: nested too deep") from None
    return spec


def remove_spec(path: str) -> bool:
    """Our spec at ``path`` gone; True if it was there. Something else under its name (a
    directory) is left, said: no claim's unprepare or the agent's start fails on it."""
    try:
        return remove_file(path)
    except OSError as err:
        log.error("CDI spec %s not removed: %s", path, err)
        return False


def list_claim_specs(cdi_dir: str, driver_name: str) -> dict[str, str]:
    """``{claimUID: path}`` of our claim spec files present in ``cdi_dir``."""
    prefix = claim_spec_prefix(driver_name)
    try:
        names = os.listdir(cdi_dir)
    except FileNotFoundError:
        return {}
    out = {}
    for name in names:
        uid = name[len(prefix):-len(".json")]
        if name.startswith(prefix) and name.endswith(".json") and is_uid(uid):
            out[uid] = os.path.join(cdi_dir, name)
    return out


def clean_our_temps(cdi_dir: str, driver_name: str) -> int:
    """Temp files from a crash mid-write (``.<specname>.XXXX.tmp``); others' temps are left alone."""
    return clean_stale_temps(cdi_dir, prefix="." + claim_spec_prefix(driver_name))
