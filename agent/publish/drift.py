"""Notice when someone else changes our slices (the kubelet's wipe, another writer)
and ask the publisher to repair it. Only triggers: the publisher re-lists and diffs."""

from __future__ import annotations

import asyncio
import logging

from agent.publish.backoff import Backoff
from agent.publish.store import Gone, StoreError

log = logging.getLogger("sysdra.publish")


async def watch_api(store, publisher, backoff: Backoff | None = None) -> None:
    """Follow a watch on our slices and request a sync on every event (a bookmark only moves
    the version on: the server's sign of a live watch on a quiet pool). A dropped stream
    resumes from the last version seen; 410 Gone (or no version yet) starts over from a
    fresh list. Any failure also requests a sync, in case something was missed."""
    backoff = backoff or Backoff(initial=0.5, cap=30.0)
    version = store.list_resource_version
    while True:
        try:
            async for kind, obj in store.watch(version):
                backoff.reset()
                version = obj.get("metadata", {}).get("resourceVersion") or version
                if kind == "BOOKMARK":
                    continue
                log.debug("watch: %s %s", kind, obj.get("metadata", {}).get("name"))
                publisher.request_sync()
        except Gone:
            version = None
        except StoreError as err:
            log.warning("watch on resourceslices failed: %s; resuming", err)
        except Exception:  # noqa: BLE001 - a bug must not end the watch for good (wipes unrepaired)
            log.exception("unexpected error in the watch on resourceslices; resuming")
        publisher.request_sync()
        await asyncio.sleep(backoff.next())
        version = version or store.list_resource_version


def watch_dir(directory: str, publisher, observe):
    """File events in the offline ``resourceslices`` dir: a file deleted or edited by
    someone else is repaired like the kubelet's wipe. ``observe(paths, callback,
    recursive=)`` starts the file watcher (the daemon's, which calls back on the event loop);
    returns the started observer."""
    return observe([directory], lambda path: publisher.request_sync(), recursive=False)
