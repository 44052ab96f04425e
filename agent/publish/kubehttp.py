"""The slice store's requests (kubestore.py) through lightkube's httpx client, each bounded, so
that a server, or a proxy or load balancer in between, that stalls, trickles or floods an
answer costs one failed attempt (retried with the publisher's backoff), never a publisher or a
watch that waits for ever or an agent that runs out of memory.

- a request's whole exchange has a deadline (``timeout``): httpx's timeout is each read's, so a
  server trickling its answer, a byte now and then, never ended one;
- an answer is read up to its size limit and no further (lightkube read it whole into memory);
- a watch is read line by line (one event each), each line bounded in size and in time:
  ``idle`` seconds without a complete line (kube-apiserver sends a bookmark about every minute
  on a watch without events, in a cluster where anything is written) and the watch is given up
  and made again by the caller.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import httpx2

from agent.apilimits import MAX_CLAIM_BYTES

REQUEST_TIMEOUT = 10.0  # seconds for a whole request (the claim requests' too: claimapi.TIMEOUT)
# Every object the server hands out fits etcd's request limit, as a claim does (apilimits);
# a list is read in pages of PAGE_ITEMS slices, so a page fits PAGE_ITEMS such objects.
MAX_OBJECT_BYTES = MAX_CLAIM_BYTES
PAGE_ITEMS = 8
MAX_PAGE_BYTES = PAGE_ITEMS * MAX_OBJECT_BYTES + 64 * 1024  # (+ the list's own metadata)
# The server ends a watch after WATCH_SECONDS (timeoutSeconds), and one silent for WATCH_IDLE is
# given up (a stalled server or proxy: the stream would never go on): either is made again from
# the last version. kube-apiserver sends a bookmark about every minute while the cluster's
# resourceVersion moves on (none while nothing at all is written), so a live watch is rarely
# made again.
WATCH_SECONDS = 300
WATCH_IDLE = 90.0


class AnswerTooLarge(Exception):
    """An answer (or a watch event) past its size limit: no API server sends one."""


class WatchSilent(Exception):
    """No line on a watch for its ``idle`` seconds."""


async def send(generic, br, *, timeout: float, limit: int) -> httpx2.Response:
    """``br`` (a lightkube BasicRequest) sent; its answer read whole, within ``timeout`` seconds
    and ``limit`` bytes, as a response lightkube's ``handle_response`` decodes."""
    request = generic.build_adapter_request(br)
    async with asyncio.timeout(timeout):
        response = await generic.send(request, stream=True)
        return await _read(response, limit, f"{br.method} {br.url}")


async def _read(response: httpx2.Response, limit: int, what: str) -> httpx2.Response:
    """The streamed ``response`` read whole (up to ``limit`` bytes) and closed."""
    try:
        body, size = [], 0
        async for chunk in response.aiter_bytes():  # (decompressed: the limit is on what is kept)
            body.append(chunk)
            size += len(chunk)
            if size > limit:
                raise AnswerTooLarge(f"{what}: the answer is more than {limit} bytes")
    finally:
        await response.aclose()
    # the body as read (no Content-Encoding left to undo), for lightkube's decoding and errors
    return httpx2.Response(response.status_code, headers={"Content-Type": response.headers.get("Content-Type", "")},
                           content=b"".join(body), request=response.request)


async def watch_lines(generic, br, *, timeout: float, idle: float, limit: int) -> AsyncIterator[bytes]:
    """The lines of one watch request's stream, until the server ends it. TimeoutError when the
    answer's head takes more than ``timeout`` seconds, WatchSilent when a line takes more than
    ``idle``; an error answer raises lightkube's ApiError; a line past ``limit`` bytes,
    AnswerTooLarge."""
    br.timeout = httpx2.Timeout(timeout, read=None)  # (a quiet watch is no failed read: ``idle`` decides)
    request = generic.build_adapter_request(br)
    async with asyncio.timeout(timeout):
        response = await generic.send(request, stream=True)
        if response.status_code != 200:
            generic.raise_for_status(await _read(response, limit, f"watch {br.url}"))
    try:
        chunks, buffer = response.aiter_bytes(), bytearray()
        while True:
            try:
                async with asyncio.timeout(idle):
                    line = await _line(chunks, buffer, limit, br.url)
            except TimeoutError:
                raise WatchSilent(f"watch {br.url}: no event for {idle:g} s") from None
            if line is None:
                return
            if line.strip():
                yield line
    finally:
        await response.aclose()


async def _line(chunks, buffer: bytearray, limit: int, url: str) -> bytes | None:
    """The next line of the stream (without its newline); at its end, what is left (a last line
    cut short: the decoder says what it is), then None."""
    while (end := buffer.find(b"\n")) < 0:
        if len(buffer) > limit:
            raise AnswerTooLarge(f"watch {url}: an event of more than {limit} bytes")
        chunk = await anext(chunks, None)
        if chunk is None:
            rest = bytes(buffer)
            buffer.clear()
            return rest if rest else None
        buffer += chunk
    line = bytes(buffer[:end])
    del buffer[:end + 1]
    return line
