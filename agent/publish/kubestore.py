"""ResourceSlices in the Kubernetes API through lightkube's AsyncClient.

Requests are built and their answers decoded by lightkube's generic client, and sent through
``kubehttp``: each bounded in time and size (a stalled or flooding server is a failed attempt,
retried by the caller). Deletes carry preconditions in a DeleteOptions body."""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

import httpx2
import msgspec
from lightkube import ApiError, AsyncClient
from lightkube.core import decoders
from lightkube.core.selector import build_selector
from lightkube.resources.core_v1 import Node
from lightkube.resources.resource_v1 import ResourceSlice

from agent.publish import kubehttp
from agent.publish.store import Conflict, Gone, Invalid, NotFound, StoreError

log = logging.getLogger("sysdra.publish")


def _mapped(err: Exception) -> StoreError:
    if isinstance(err, ApiError):
        code = err.status.code
        message = f"API error {code}: {err.status.message}"
        if code == 409:
            return Conflict(message)
        if code == 404:
            return NotFound(message)
        if code == 410:
            return Gone(message)
        if code == 422:
            causes = err.status.details.causes if err.status.details is not None else None
            return Invalid(message, tuple(c.field for c in causes or () if c.field))
        return StoreError(message)
    return StoreError(f"API request failed: {type(err).__name__}: {err}")


# what a request may end in: the server's error, the connection's, a deadline, a size
# limit, an answer that is not what it says (msgspec's errors are ValueErrors)
_FAILURES = (ApiError, httpx2.HTTPError, OSError, kubehttp.AnswerTooLarge, ValueError)


class KubeStore:
    full_names = False

    def __init__(self, client: AsyncClient, *, node_name: str, driver_name: str):
        self.client = client
        self.generic = client._client  # lightkube's GenericAsyncClient: requests built and decoded there
        self.node_name = node_name
        self.driver_name = driver_name
        self.fields = {"spec.nodeName": node_name, "spec.driver": driver_name}
        self.list_resource_version: str | None = None  # where a watch continues after a list
        # the bounds of every request (kubehttp; tests make them small)
        self.timeout, self.watch_idle = kubehttp.REQUEST_TIMEOUT, kubehttp.WATCH_IDLE
        self.max_object, self.max_page = kubehttp.MAX_OBJECT_BYTES, kubehttp.MAX_PAGE_BYTES

    async def _call(self, method: str, limit: int | None = None, br=None, **request):
        """One request (``br``, or one made of ``request``), bounded in time and size; its answer
        decoded by lightkube (a list page in a worker thread: megabytes of JSON on a large node
        would hold up the loop)."""
        br = br or self.generic.prepare_request(method, **{"res": ResourceSlice, **request})
        try:
            response = await kubehttp.send(self.generic, br, timeout=self.timeout, limit=limit or self.max_object)
            if method == "list":
                return await asyncio.to_thread(_page, self.generic, response, br)
            return self.generic.handle_response(method, response, br)
        except TimeoutError:
            raise StoreError(f"API request {br.method} {br.url}: no answer within {self.timeout:g} s") from None
        except _FAILURES as err:
            raise _mapped(err) from err

    async def list_slices(self) -> list[dict]:
        """Our slices, page by page (each page's size bounded)."""
        br = self.generic.prepare_request("list", res=ResourceSlice, params={
            "fieldSelector": build_selector(self.fields, for_fields=True), "limit": kubehttp.PAGE_ITEMS})
        items: list[dict] = []
        more = True
        while more:  # (lightkube's decoding puts the next page's continue token into br)
            more, version, page = await self._call("list", self.max_page, br)
            items += page
        self.list_resource_version = version
        return items

    async def create(self, obj: dict) -> dict:
        return (await self._call("post", obj=ResourceSlice.from_dict(obj))).to_dict()

    async def update(self, obj: dict) -> dict:
        return (await self._call("put", obj=ResourceSlice.from_dict(obj), name=obj["metadata"]["name"])).to_dict()

    async def dry_run_update(self, obj: dict) -> dict:
        """The slice as the server would store ``obj`` (``dryRun=All``): nothing is written."""
        try:
            return (await self.client.replace(ResourceSlice.from_dict(obj), dry_run=True)).to_dict()
        except (ApiError, httpx2.HTTPError, OSError) as err:
            raise _mapped(err) from err

    async def delete(self, name: str, uid: str, resource_version: str) -> None:
        br = self.generic.prepare_request("delete", res=ResourceSlice, name=name)
        br.data = {"apiVersion": "v1", "kind": "DeleteOptions",
                   "preconditions": {"uid": uid or None, "resourceVersion": resource_version or None}}
        await self._call("delete", br=br)

    async def node_uid(self) -> str | None:
        return (await self._call("get", res=Node, name=self.node_name)).metadata.uid

    async def watch(self, resource_version: str | None) -> AsyncIterator[tuple[str, dict]]:
        """Events on our slices, from watches the server ends after ``kubehttp.WATCH_SECONDS``,
        each made again from the last version seen, as is one silent for ``watch_idle`` seconds
        (a stalled server or proxy; or a quiet pool: the server goes on from that version either
        way). Bookmarks come as ("BOOKMARK", {"metadata": {"resourceVersion": ...}}). Errors
        (410 Gone, a dropped connection, no answer, an event cut short or of the wrong types)
        surface as StoreError for the caller to resume or re-list; a watch the server ends
        without a line ends this one (the caller resumes after its backoff, not at once)."""
        version = resource_version
        while True:
            lines = 0
            try:
                async for line in kubehttp.watch_lines(self.generic, self._watch_request(version), timeout=self.timeout,
                                                       idle=self.watch_idle, limit=self.max_object):
                    kind, obj = _event(line)
                    lines += 1
                    version = (obj.get("metadata") or {}).get("resourceVersion") or version
                    yield kind, obj
            except kubehttp.WatchSilent:
                log.debug("the watch on our slices was silent for %g s: made again", self.watch_idle)
                continue
            except TimeoutError:
                raise StoreError(f"watch on our slices: no answer within {self.timeout:g} s") from None
            except _FAILURES as err:
                if isinstance(err, ValueError):
                    raise StoreError(f"a watch event could not be read: {err}") from err
                raise _mapped(err) from err
            if not lines:
                return

    def _watch_request(self, version: str | None):
        # bookmarks only from a version: from none, kube-apiserver without its watch cache sends
        # the initial bookmark and then none of the events (v1.37.2; test_apiserver_faults.py, an uncached server)
        return self.generic.prepare_request("list", res=ResourceSlice, watch=True, params={
            "fieldSelector": build_selector(self.fields, for_fields=True), "resourceVersion": version,
            "timeoutSeconds": kubehttp.WATCH_SECONDS, "allowWatchBookmarks": "true" if version else None})


def _event(line: bytes) -> tuple[str, dict]:
    """(type, object as a dict) of a watch line; ApiError for an ERROR event, ValueError for
    one no server writes (cut short, wrong types)."""
    event = decoders.decode_watch_event(line)
    if event.type == "ERROR":
        raise ApiError(status=decoders.decode_status(event.object))
    if event.type == "BOOKMARK":
        meta = msgspec.json.decode(event.object, type=_Bookmark).metadata
        return event.type, {"metadata": {"resourceVersion": meta.resourceVersion}}
    if event.type not in ("ADDED", "MODIFIED", "DELETED"):
        raise ValueError(f"unknown watch event type {event.type!r}")
    return event.type, decoders.decode_object(event.object, ResourceSlice).to_dict()


class _BookmarkMeta(msgspec.Struct):
    resourceVersion: str


class _Bookmark(msgspec.Struct):
    metadata: _BookmarkMeta


def _page(generic, response, request) -> tuple[bool, str | None, list[dict]]:
    """(more pages, the list's resourceVersion, the page's objects as dicts); ApiError as lightkube says."""
    more, version, objects = generic.handle_response("list", response, request)
    return more, version, [obj.to_dict() for obj in objects]


def kube_client(field_manager: str) -> AsyncClient:
    """Kubeconfig from $KUBECONFIG / ~/.kube/config, or the in-cluster service account."""
    return AsyncClient(field_manager=field_manager, timeout=httpx2.Timeout(kubehttp.REQUEST_TIMEOUT))
