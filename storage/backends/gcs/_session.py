"""Requests through gcsfs's aiohttp session: the uploads' requests, and the GETs of a
client whose configuration the direct path (``_direct``) does not reproduce.

They use gcsfs's session, credentials, timeouts, error mapping (``validate_response``)
and retry rule (``is_retriable``, the same attempts; :func:`policy`); the requests
themselves are made here, because gcsfs's ``_call`` reads every body whole and follows
the 308 of a resumable chunk as a redirect.
"""

from __future__ import annotations

import asyncio
import http.client
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

import aiohttp
import gcsfs
from gcsfs.retry import is_retriable, validate_response

from storage.backends._connections import BodyBroken
from storage.backends._retry import Retry
from storage.backends.cancel import Cancel
from storage.backends.gcs import _compat as compat

# A body is handed to the socket in slices of this size: no copy of the whole body
# (aiohttp joins a bytes-like body with its headers; asyncio copies what the socket does
# not take at once), at most one slice is copied when the socket is full.
_SEND_SLICE = 1 << 20
_ERROR_BODY_LIMIT = 1 << 16
_BODY_ERRORS = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError)

T = TypeVar("T")


def retriable(exc: BaseException) -> bool:
    """gcsfs's rule (5xx, 408, 429, an expired token, client errors), and the
    connection errors of ``http.client`` that aiohttp would have raised as its own."""
    if isinstance(exc, (ConnectionError, TimeoutError, http.client.HTTPException)):
        return True
    return bool(is_retriable(exc))


def policy(gcs: gcsfs.GCSFileSystem) -> Retry:
    """gcsfs's attempts (``retries``, 6 by default) and rule (:func:`retriable`), with
    waits of up to 1, 2, 4, ... 32 s."""
    return Retry(int(getattr(gcs, "retries", 6)), retriable, base=1.0, cap=32.0)


def split(path: str) -> tuple[str, str]:
    bucket, _, key = path.partition("/")
    return bucket, key


class Answer(Protocol):
    """The response to one GET, its body read into the caller's buffers."""

    status: int
    #: The ``Content-Encoding`` its body still has (``None``: none, or the client
    #: decoded it).
    encoding: str | None

    def header(self, name: str) -> str | None: ...

    def readinto(self, view: memoryview) -> int:
        """Up to ``len(view)`` bytes of the body; 0 at its end; :class:`BodyBroken`
        when it breaks off."""
        ...

    def error_body(self) -> bytes:
        """The start of an error answer's body; the answer is closed."""
        ...

    def close(self) -> None: ...


#: ``get(path, first, last, generation, cancel)``: one attempt at a GET of ``path``
#: (``first=None``: the whole object; ``last=None``: to its end), pinned to
#: ``generation`` when given; its :class:`Answer`, whatever the status.
Get = Callable[[str, int | None, int | None, str | None, Cancel], Answer]


class UploadBody:
    """Byte buffers as one body: an async iterable of memoryview slices. Every
    iteration starts again from the first byte, so a retried request sends it whole."""

    def __init__(self, *parts: memoryview) -> None:
        self.parts = parts
        self.size = sum(len(p) for p in parts)

    async def __aiter__(self) -> AsyncIterator[memoryview]:
        for part in self.parts:
            for start in range(0, len(part), _SEND_SLICE):
                yield part[start : start + _SEND_SLICE]


async def retrying(gcs: gcsfs.GCSFileSystem, attempt: Callable[[], Awaitable[T]]) -> T:
    """``attempt()`` with gcsfs's retries (:func:`policy`)."""
    retry = policy(gcs)
    for n in range(1, retry.attempts + 1):
        try:
            return await attempt()
        except Exception as exc:
            if n >= retry.attempts or not retry.retryable(exc):
                raise
        await asyncio.sleep(retry.delay(n))
    raise AssertionError("unreachable")


async def request(
    gcs: gcsfs.GCSFileSystem,
    method: str,
    url: str,
    *,
    params: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
    data: Any = None,
    json: Any = None,
) -> tuple[Any, bytes]:
    """One request with retries; returns (headers, the start of the body: 64 KiB at
    most, which any answer of an upload request fits). A 308 is an answer here."""

    async def attempt() -> tuple[Any, bytes]:
        await compat.set_session(gcs)
        async with gcs.session.request(
            method,
            url,
            params=compat.params(gcs, params or {}),
            headers=compat.headers(gcs, headers),
            data=data,
            json=json,
            timeout=gcs.requests_timeout,
            allow_redirects=False,
        ) as resp:
            # Not read on: a store that keeps sending must not hold the upload (a longer
            # body is not read to its end, and its connection is closed, not reused).
            contents = await resp.content.read(_ERROR_BODY_LIMIT)
            validate_response(resp.status, contents, url)
            return resp.headers, contents

    return await retrying(gcs, attempt)


def range_header(first: int | None, last: int | None) -> dict[str, str]:
    """The ``Range`` header of a GET from byte ``first`` to ``last`` (both included)."""
    if first is None:
        return {}
    return {"Range": f"bytes={first}-{'' if last is None else last}"}


class StreamedGet:
    """GETs through gcsfs's aiohttp session (a :data:`Get`): their bodies arrive as
    aiohttp's chunks on gcsfs's event loop and are copied into the caller's buffer."""

    def __init__(self, gcs: gcsfs.GCSFileSystem) -> None:
        self._gcs = gcs

    def __call__(
        self,
        path: str,
        first: int | None,
        last: int | None,
        generation: str | None,
        cancel: Cancel,
    ) -> Answer:
        resp = cancel.run(self._gcs.loop, self._open, path, first, last, generation)
        return _StreamedAnswer(self._gcs.loop, resp, cancel)

    async def _open(
        self, path: str, first: int | None, last: int | None, generation: str | None
    ) -> aiohttp.ClientResponse:
        gcs = self._gcs
        await compat.set_session(gcs)
        return await gcs.session.get(
            gcs.url(path, generation=generation),
            params=compat.params(gcs, {}),
            headers=compat.headers(gcs, range_header(first, last)),
            timeout=gcs.requests_timeout,
        )


class _StreamedAnswer:
    def __init__(
        self, loop: asyncio.AbstractEventLoop, resp: aiohttp.ClientResponse, cancel: Cancel
    ) -> None:
        self._loop = loop
        self._resp: aiohttp.ClientResponse | None = resp
        self._cancel = cancel
        self._left = memoryview(b"")  # received beyond what the caller took
        self._broken: BaseException | None = None
        self.status = resp.status
        # gcsfs's session decodes a gzip or deflate body (aiohttp's auto_decompress).
        encoding = resp.headers.get("Content-Encoding")
        decoded = (encoding or "").strip().lower() in ("gzip", "deflate")
        self.encoding: str | None = None if decoded else encoding

    def header(self, name: str) -> str | None:
        assert self._resp is not None
        return self._resp.headers.get(name)

    def readinto(self, view: memoryview) -> int:
        if self._left:
            n = min(len(view), len(self._left))
            view[:n] = self._left[:n]
            self._left = self._left[n:]
            return n
        if self._broken is not None:
            raise BodyBroken(f"response body broke off: {self._broken!r}") from self._broken
        got: int = self._cancel.run(self._loop, self._fill, view)
        return got

    async def _fill(self, view: memoryview) -> int:
        """Chunks copied into ``view`` until it is full or the body ends; a break after
        some bytes is raised by the next call."""
        assert self._resp is not None
        got = 0
        while got < len(view):
            try:
                chunk = await self._resp.content.readany()
            except _BODY_ERRORS as exc:
                if not got:
                    raise BodyBroken(f"response body broke off: {exc!r}") from exc
                self._broken = exc
                break
            if not chunk:
                break
            n = min(len(chunk), len(view) - got)
            view[got : got + n] = memoryview(chunk)[:n]
            self._left = memoryview(chunk)[n:]
            got += n
        return got

    def error_body(self) -> bytes:
        assert self._resp is not None
        try:
            body: bytes = self._cancel.run(self._loop, self._resp.content.read, _ERROR_BODY_LIMIT)
        except _BODY_ERRORS:
            body = b""
        self.close()
        return body

    def close(self) -> None:
        resp, self._resp = self._resp, None
        if resp is not None:
            # Read to its end, the connection goes back to the session's pool.
            done = resp.content.at_eof() and not self._left
            self._loop.call_soon_threadsafe(resp.release if done else resp.close)
