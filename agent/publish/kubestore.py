"""ResourceSlices in the Kubernetes API through lightkube's AsyncClient.

lightkube's ``delete`` takes no preconditions, so deletes go through its generic client
with a DeleteOptions body; everything else uses the public API."""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

import httpx2
from lightkube import ApiError, AsyncClient
from lightkube.core.selector import build_selector
from lightkube.resources.core_v1 import Node
from lightkube.resources.resource_v1 import ResourceSlice

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


class KubeStore:
    full_names = False

    def __init__(self, client: AsyncClient, *, node_name: str, driver_name: str):
        self.client = client
        self.node_name = node_name
        self.driver_name = driver_name
        self.fields = {"spec.nodeName": node_name, "spec.driver": driver_name}
        self.list_resource_version: str | None = None  # where a watch continues after a list

    async def list_slices(self) -> list[dict]:
        """Our slices, page by page as the server hands them; each page decoded in a worker thread
        (a large node's pool is megabytes of JSON: parsing it on the loop would hold it up)."""
        generic = self.client._client  # lightkube's list, its pages decoded off the loop
        request = generic.prepare_request("list", res=ResourceSlice,
                                          params={"fieldSelector": build_selector(self.fields, for_fields=True)})
        items: list[dict] = []
        try:
            more = True
            while more:
                response = await generic.send(generic.build_adapter_request(request))
                more, version, page = await asyncio.to_thread(_page, generic, response, request)
                items += page
        except (ApiError, httpx2.HTTPError, OSError) as err:
            raise _mapped(err) from err
        self.list_resource_version = version
        return items

    async def create(self, obj: dict) -> dict:
        try:
            return (await self.client.create(ResourceSlice.from_dict(obj))).to_dict()
        except (ApiError, httpx2.HTTPError, OSError) as err:
            raise _mapped(err) from err

    async def update(self, obj: dict) -> dict:
        try:
            return (await self.client.replace(ResourceSlice.from_dict(obj))).to_dict()
        except (ApiError, httpx2.HTTPError, OSError) as err:
            raise _mapped(err) from err

    async def delete(self, name: str, uid: str, resource_version: str) -> None:
        generic = self.client._client  # lightkube's GenericAsyncClient: no public delete preconditions
        request = generic.prepare_request("delete", res=ResourceSlice, name=name)
        request.data = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "preconditions": {"uid": uid or None, "resourceVersion": resource_version or None},
        }
        try:
            response = await generic.send(generic.build_adapter_request(request))
            generic.handle_response("delete", response, request)
        except (ApiError, httpx2.HTTPError, OSError) as err:
            raise _mapped(err) from err

    async def node_uid(self) -> str | None:
        try:
            node = await self.client.get(Node, self.node_name)
        except (ApiError, httpx2.HTTPError, OSError) as err:
            raise _mapped(err) from err
        return node.metadata.uid

    async def watch(self, resource_version: str | None) -> AsyncIterator[tuple[str, dict]]:
        """Events on our slices; lightkube reconnects on a clean end of stream.
        Errors (410 Gone, dropped connection) surface as StoreError for the caller to re-list;
        so does an event that cannot be decoded (cut short, wrong types: lightkube's decoder
        raises a ValueError), which would otherwise end the caller's watch for good."""
        try:
            async for kind, obj in self.client.watch(ResourceSlice, fields=self.fields, resource_version=resource_version):
                yield kind, obj.to_dict()
        except (ApiError, httpx2.HTTPError, OSError) as err:
            raise _mapped(err) from err
        except ValueError as err:
            raise StoreError(f"a watch event could not be read: {err}") from err


def _page(generic, response, request) -> tuple[bool, str | None, list[dict]]:
    """(more pages, the list's resourceVersion, the page's objects as dicts); ApiError as lightkube says."""
    more, version, objects = generic.handle_response("list", response, request)
    return more, version, [obj.to_dict() for obj in objects]


def kube_client(field_manager: str) -> AsyncClient:
    """Kubeconfig from $KUBECONFIG / ~/.kube/config, or the in-cluster service account."""
    return AsyncClient(field_manager=field_manager, timeout=httpx2.Timeout(10.0))
