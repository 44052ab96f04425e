"""Offline cluster: ResourceSlices as ``PATH/resourceslices/<name>.json``, one object per
file, written atomically. uid and resourceVersion are kept in the files so the
reconciler's preconditions mean the same as against the API server."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid

from agent.fsutil import atomic_write_json, clean_stale_temps, make_dirs, read_bounded
from agent.publish.store import Conflict, NotFound, StoreError

log = logging.getLogger("sysdra.publish")

MAX_FILE_BYTES = 4 << 20  # one ResourceSlice: the API server takes at most ~1.5 MiB


class DirStore:
    full_names = True

    def __init__(self, cluster_dir: str, *, node_name: str, driver_name: str):
        self.directory = os.path.join(cluster_dir, "resourceslices")
        self.node_name = node_name
        self.driver_name = driver_name
        make_dirs(self.directory, 0o755)
        clean_stale_temps(self.directory)
        self._cache: dict[str, tuple[tuple[int, int, int], dict]] = {}

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name + ".json")

    def _read(self, name: str) -> dict | None:
        """Parsed file; re-parsed only when its (inode, mtime, size) changed (atomic writes
        make a new inode, so any write by anyone is seen). Callers treat it as read-only."""
        path = self.path(name)
        try:
            st = os.stat(path)  # (a file replaced after it: a new stamp at the next read)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            hit = self._cache.get(name)
            if hit is not None and hit[0] == stamp:
                return hit[1]
            obj = json.loads(read_bounded(path, MAX_FILE_BYTES))
        except FileNotFoundError:
            self._cache.pop(name, None)
            return None
        except (OSError, ValueError, RecursionError) as err:  # (RecursionError: JSON nested too deep)
            # a half-edited or foreign file: not ours to interpret, but do not crash
            why = "nested too deep" if isinstance(err, RecursionError) else err
            log.warning("ignoring unreadable slice file %s: %s", self.path(name), why)
            return None
        self._cache[name] = (stamp, obj)
        return obj

    def _list(self) -> list[dict]:
        out = []
        try:
            names = sorted(os.listdir(self.directory))
        except OSError as err:
            raise StoreError(f"cannot list {self.directory}: {err}") from err
        for gone in set(self._cache) - {n[: -len(".json")] for n in names}:
            del self._cache[gone]
        for fname in names:
            if fname.startswith(".") or not fname.endswith(".json"):
                continue
            name = fname[: -len(".json")]
            obj = self._read(name)
            if not self._ours(obj):
                continue
            meta = obj.get("metadata")
            if not isinstance(meta, dict) or meta.get("name") != name:
                # a file is addressed by its name, as an object of the API server by its own: a copy or
                # a move of one of ours is that other object (and replaced as one that is not ours)
                obj = {**obj, "metadata": {**(meta if isinstance(meta, dict) else {}), "name": name}}
            out.append(obj)
        return out

    def _ours(self, obj: object) -> bool:
        """Whether a listing shows ``obj`` as a slice of this node's driver."""
        spec = obj.get("spec") if isinstance(obj, dict) else None  # another's file may hold any JSON
        return isinstance(spec, dict) and spec.get("nodeName") == self.node_name and spec.get("driver") == self.driver_name

    def _whole(self, obj: object) -> bool:
        """Whether ``obj``, at the name of one of our slices, is one the reconciler lists as its
        pool's (the agent's pool is named after its node): else nothing would replace it."""
        pool = obj["spec"].get("pool") if self._ours(obj) else None  # type: ignore[index]
        return isinstance(pool, dict) and pool.get("name") == self.node_name

    def _set_aside(self, name: str) -> None:
        """A file under the name of one of our slices (the name holds our driver and node) that
        the reconciler does not take for its pool's: damaged (it does not parse, holds no slice, or a
        flipped byte names another driver, node or pool). Kept for the operator as ``<name>.json.damaged-<ns>``,
        which no listing reads."""
        aside = f"{self.path(name)}.damaged-{time.time_ns()}"
        try:
            os.replace(self.path(name), aside)
        except FileNotFoundError:
            return
        except OSError as err:
            raise StoreError(f"cannot move the damaged {self.path(name)} aside: {err}") from err
        self._cache.pop(name, None)
        log.warning("slice file %s is damaged (not a slice of this node's pool): moved to %s, the slice written anew", self.path(name), aside)

    def _write(self, obj: dict) -> dict:
        name = obj["metadata"]["name"]
        try:
            atomic_write_json(self.path(name), obj)
            st = os.stat(self.path(name))
        except OSError as err:
            self._cache.pop(name, None)
            raise StoreError(str(err)) from err
        # what we wrote is what a read would return: no re-parse, no second copy in memory
        self._cache[name] = ((st.st_ino, st.st_mtime_ns, st.st_size), obj)
        return obj

    @staticmethod
    def _own(obj: dict) -> dict:
        """Our copy: new top level and metadata (we set uid/resourceVersion); the spec is
        shared with the caller and treated as read-only by both sides."""
        return {**obj, "metadata": dict(obj["metadata"])}

    def _create(self, obj: dict) -> dict:
        name = obj["metadata"]["name"]
        if os.path.exists(self.path(name)):
            if self._whole(self._read(name)):
                raise Conflict(f"resourceslice {name} already exists")
            self._set_aside(name)  # damaged: no listing shows it, so every create would conflict for ever
        obj = self._own(obj)
        obj["metadata"].update(uid=str(uuid.uuid4()), resourceVersion="1")
        return self._write(obj)

    def _check(self, name: str, uid: str | None, resource_version: str | None) -> dict:
        old = self._read(name)
        if old is None:
            raise NotFound(f"resourceslice {name} not found")
        meta = _meta(old)
        if uid and meta.get("uid") != uid:
            raise Conflict(f"resourceslice {name}: uid precondition failed")
        if resource_version and meta.get("resourceVersion") != resource_version:
            raise Conflict(f"resourceslice {name}: resourceVersion precondition failed")
        return old

    def _update(self, obj: dict) -> dict:
        meta = obj["metadata"]
        old = self._check(meta["name"], meta.get("uid"), meta.get("resourceVersion"))
        obj, had = self._own(obj), _meta(old)
        obj["metadata"]["uid"] = had.get("uid") if isinstance(had.get("uid"), str) else str(uuid.uuid4())
        obj["metadata"]["resourceVersion"] = str(_version(had) + 1)
        return self._write(obj)

    def _delete(self, name: str, uid: str, resource_version: str) -> None:
        self._check(name, uid, resource_version)
        try:
            os.unlink(self.path(name))
        except FileNotFoundError as err:
            raise NotFound(name) from err
        except OSError as err:
            raise StoreError(str(err)) from err

    # async facade: file I/O is short; fsync can take a while on a busy disk
    async def list_slices(self) -> list[dict]:
        return await asyncio.to_thread(self._list)

    async def create(self, obj: dict) -> dict:
        return await asyncio.to_thread(self._create, obj)

    async def update(self, obj: dict) -> dict:
        return await asyncio.to_thread(self._update, obj)

    async def delete(self, name: str, uid: str, resource_version: str) -> None:
        await asyncio.to_thread(self._delete, name, uid, resource_version)


def _meta(obj: object) -> dict:
    """A file's metadata; {} where a damaged file holds none (its object is still addressed by the file's name)."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    return meta if isinstance(meta, dict) else {}


def _version(meta: dict) -> int:
    """A file's resourceVersion as a number; 0 for a damaged one (the next write is 1, as a create's)."""
    value = meta.get("resourceVersion")
    return int(value) if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) < 20 else 0
