"""Where ResourceClaims are read from at prepare time: the API server or a ``dir:`` store.

``read_claim`` (blocking: a prepare calls it in the worker thread it runs the driver in, one
thread trip for the whole prepare) returns the ResourceClaim as a dict (resource.k8s.io/v1 JSON)
or raises ``ClaimError`` with a message fit for the kubelet's per-claim ``error``.
"""

from __future__ import annotations

import os
import stat
from typing import Protocol

import orjson

from agent.apilimits import MAX_CLAIM_BYTES
from agent.kubeletplugin.claimapi import ApiFailure, ClaimApi
from agent.settings import Settings




class ClaimError(Exception):
    """The claim could not be read; the message names it."""


class ClaimSource(Protocol):
    def read_claim(self, namespace: str, name: str) -> dict: ...


class DirClaimSource:
    """``PATH/resourceclaims/<namespace>/<name>.json`` (the ``--cluster dir:PATH`` store).

    Callers validate namespace and name (no separators, no ``..``) before calling.
    """

    def __init__(self, path: str):
        self.path = path

    def claim_path(self, namespace: str, name: str) -> str:
        return os.path.join(self.path, "resourceclaims", namespace, name + ".json")

    def read_claim(self, namespace: str, name: str) -> dict:
        path = self.claim_path(namespace, name)
        try:
            # O_NONBLOCK: a FIFO put where the file should be must not block a thread forever
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ClaimError(f"ResourceClaim {namespace}/{name} not found ({path})") from None
        except OSError as err:
            raise ClaimError(f"ResourceClaim {namespace}/{name}: cannot read {path}: {err.strerror or err}") from err
        try:
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise ClaimError(f"ResourceClaim {namespace}/{name}: {path} is not a regular file")
                if st.st_size > MAX_CLAIM_BYTES:
                    raise ClaimError(f"ResourceClaim {namespace}/{name}: {path} is {st.st_size} bytes, "
                                     f"more than {MAX_CLAIM_BYTES} (the API server's object size limit)")
                # sized by fstat (room for a concurrent append): read(MAX + 1) allocates MAX bytes
                raw = f.read(min(st.st_size + 4096, MAX_CLAIM_BYTES + 1))
                if len(raw) > MAX_CLAIM_BYTES:
                    raise ClaimError(f"ResourceClaim {namespace}/{name}: {path} grew past {MAX_CLAIM_BYTES} bytes")
                data = orjson.loads(raw)  # ValueError on bad or too deeply nested JSON
        except (OSError, ValueError, RecursionError) as err:
            raise ClaimError(f"ResourceClaim {namespace}/{name}: cannot read {path}: {err}") from err
        if not isinstance(data, dict):
            raise ClaimError(f"ResourceClaim {namespace}/{name}: {path} is not a JSON object")
        return data



class KubeClaimSource:
    """GET resource.k8s.io/v1 ResourceClaims from the API server (``claimapi.ClaimApi``)."""

    def __init__(self, client=None):
        self.api = client if isinstance(client, ClaimApi) else ClaimApi(client)

    def read_claim(self, namespace: str, name: str) -> dict:
        try:
            return self.api.read(namespace, name)
        except ApiFailure as err:
            raise ClaimError(f"ResourceClaim {namespace}/{name} not found" if err.code == 404 else str(err)) from err
        except Exception as err:  # network, TLS, config: the kubelet retries the claim
            raise ClaimError(f"ResourceClaim {namespace}/{name}: {type(err).__name__}: {err}") from err


def claim_source(settings: Settings, api: ClaimApi | None = None) -> ClaimSource:
    """The source matching ``--cluster``: ``dir:PATH`` or the API server (through ``api``,
    shared with the status writer)."""
    if settings.cluster_dir is not None:
        return DirClaimSource(settings.cluster_dir)
    return KubeClaimSource(api)
