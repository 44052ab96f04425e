"""Where metadata lives: host files, in-container paths and the CDI spec per request.

Names follow the Go kubeletplugin helper byte for byte (consumers such as KubeVirt build
the in-container path themselves, cleanup tools glob the spec names):

- host file  ``<plugin dir>/dra-device-metadata/<namespace>_<claim>/<request>/metadata.json``
- CDI spec   ``<cdi dir>/<driver>_metadata_<claimUID>_<request>.json``, kind
  ``<driver>/metadata``, device ``<claimUID>_<request>``, one ``ro,bind`` mount
- container  ``/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/<request>/<driver>-metadata.json``
  (``resourceclaimtemplates/<podClaimName>/...`` for claims made from a template)

``<request>`` is always the base request name (``req/sub`` -> ``req``).

Every name is checked (``agent.names``) before it becomes part of a path, and every host
path is checked to stay below its base: these names come from claims and the checkpoint.
"""

from __future__ import annotations

import hashlib
import os

from agent.fsutil import inside
from agent.names import check_label, check_subdomain, check_uid, is_uid
from cdi.spec import finish, qualified_name

CONTAINER_DIR = "/var/run/kubernetes.io/dra-device-attributes"
HOST_DIR_NAME = "dra-device-metadata"
FILE_NAME = "metadata.json"


def host_root(plugin_dir: str) -> str:
    return os.path.join(plugin_dir, HOST_DIR_NAME)


NAME_MAX = 255  # bytes of one file name (Linux file systems)
NAME_HASH = 16  # hex digits of the name's SHA-256 in a shortened directory name


def claim_dir(plugin_dir: str, namespace: str, name: str) -> str:
    # namespaces are DNS labels and names DNS subdomains: neither contains "_"
    check_label("claim namespace", namespace)
    check_subdomain("claim name", name)
    return inside(host_root(plugin_dir), claim_dir_name(namespace, name))


def claim_dir_name(namespace: str, name: str) -> str:
    """``<namespace>_<name>`` (the Go helper's), or, where that is longer than a file name can be
    (a namespace of 63 and a name of 253 are valid: 317 bytes), the name cut and its hash after a
    second ``_``: the Go helper's mkdir fails there, and so would every unprepare's removal. No
    name of the Go form has two ``_``: a shortened one is never another claim's."""
    full = f"{namespace}_{name}"
    if len(full) <= NAME_MAX:
        return full
    digest = hashlib.sha256(name.encode()).hexdigest()[:NAME_HASH]
    return f"{full[:NAME_MAX - NAME_HASH - 1]}_{digest}"


def host_file(plugin_dir: str, namespace: str, name: str, request: str) -> str:
    check_label("request name", request)
    return inside(claim_dir(plugin_dir, namespace, name), request, FILE_NAME)


def container_path(driver: str, claim_name: str, request: str, pod_claim_name: str | None) -> str:
    check_subdomain("claim name", claim_name)
    check_label("request name", request)
    if pod_claim_name:
        check_label("pod-claim-name annotation", pod_claim_name)
        base = f"{CONTAINER_DIR}/resourceclaimtemplates/{pod_claim_name}"
    else:
        base = f"{CONTAINER_DIR}/resourceclaims/{claim_name}"
    return f"{base}/{request}/{driver}-metadata.json"


def spec_prefix(driver: str, claim_uid: str = "") -> str:
    return f"{driver}_metadata_{claim_uid}_" if claim_uid else f"{driver}_metadata_"


def spec_path(cdi_dir: str, driver: str, claim_uid: str, request: str) -> str:
    check_uid("claim uid", claim_uid)
    check_label("request name", request)
    return os.path.join(cdi_dir, f"{spec_prefix(driver, claim_uid)}{request}.json")


def kind(driver: str) -> str:
    return f"{driver}/metadata"


def cdi_device(claim_uid: str, request: str) -> str:
    return f"{claim_uid}_{request}"


def cdi_id(driver: str, claim_uid: str, request: str) -> str:
    return qualified_name(kind(driver), cdi_device(claim_uid, request))


def build_spec(driver: str, claim_uid: str, request: str, host_path: str, ctr_path: str) -> dict:
    """The validated spec that bind-mounts one metadata file read-only."""
    mount = {"hostPath": host_path, "containerPath": ctr_path, "options": ["ro", "bind"]}
    return finish({
        "kind": kind(driver),
        "devices": [{"name": cdi_device(claim_uid, request), "containerEdits": {"mounts": [mount]}}],
    })


def list_specs(cdi_dir: str, driver: str) -> dict[str, list[str]]:
    """``{claimUID: [spec paths]}`` of our metadata specs. Claim UIDs contain no ``_``."""
    prefix = spec_prefix(driver)
    try:
        names = os.listdir(cdi_dir)
    except FileNotFoundError:
        return {}
    out: dict[str, list[str]] = {}
    for name in sorted(names):
        if name.startswith(prefix) and name.endswith(".json"):
            uid = name[len(prefix):].split("_", 1)[0]
            if not is_uid(uid):
                continue
            out.setdefault(uid, []).append(os.path.join(cdi_dir, name))
    return out
