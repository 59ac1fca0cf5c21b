"""The GCS data path: uploads from reused buffers, ranged GETs streamed into the caller's
buffer with resume. Requests use gcsfs's session, credentials, timeouts, error mapping
(``validate_response``) and retry rule (``is_retriable``, the same attempts and
backoff); the requests themselves are made here, because gcsfs's ``_call`` reads every
body whole and follows the 308 of a resumable chunk as a redirect."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import io
import logging
import random
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import quote

import aiohttp
import fsspec.asyn
import gcsfs
from gcsfs.retry import is_retriable, validate_response

from storage.backends._buffers import BufferPool
from storage.backends._ranges import RangeMismatchError, check_range
from storage.backends._secrets import BY_FORM
from storage.backends.cancel import Cancel, current

log = logging.getLogger("storage.backends._gcs")

#: Upload buffers of every GCS filesystem of the process (see ``BufferPool``).
BUFFERS = BufferPool(256 << 20)

# A body is handed to the socket in slices of this size: no copy of the whole body
# (aiohttp joins a bytes-like body with its headers; asyncio copies what the socket does
# not take at once), at most one slice is copied when the socket is full.
_SEND_SLICE = 1 << 20
# Breaks of a response body in a row (no byte received in between) before a read fails.
_BODY_RETRIES = 5
_BODY_ERRORS = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError)

#: ``errors(action)``: a context that turns client errors into the contract's, naming
#: the object and ``action`` (the filesystem's ``_errors``).
Errors = Callable[[str], contextlib.AbstractContextManager[None]]


class _Body:
    """Byte buffers as one body: an async iterable of memoryview slices. Every
    iteration starts again from the first byte, so a retried request sends it whole."""

    def __init__(self, *parts: memoryview) -> None:
        self.parts = parts
        self.size = sum(len(p) for p in parts)

    async def __aiter__(self) -> AsyncIterator[memoryview]:
        for part in self.parts:
            for start in range(0, len(part), _SEND_SLICE):
                yield part[start : start + _SEND_SLICE]


class _Budget:
    """Bytes that uploads may hold beyond their one buffer, across the process."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._used = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self._used + n > self.limit:
                return False
            self._used += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self._used -= n


#: Full buffers that uploads of the process may hold, waiting to go up as one request
#: (see ``Upload``), at most this many bytes together.
HELD = _Budget(256 << 20)


T = TypeVar("T")


async def _retrying(gcs: gcsfs.GCSFileSystem, attempt: Callable[[], Awaitable[T]]) -> T:
    """``attempt()`` with gcsfs's retries: what ``is_retriable`` accepts (5xx, 408, 429,
    connection errors) is tried again after ``random() + 2 ** (n - 1)`` s."""
    retries = int(getattr(gcs, "retries", 6))
    for n in range(retries):
        if n:
            await asyncio.sleep(min(random.random() + 2 ** (n - 1), 32))
        try:
            return await attempt()
        except Exception as exc:
            if n == retries - 1 or not is_retriable(exc):
                raise
    raise AssertionError("unreachable")


async def _request(
    gcs: gcsfs.GCSFileSystem,
    method: str,
    url: str,
    *,
    params: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
    data: Any = None,
    json: Any = None,
) -> tuple[Any, bytes]:
    """One request with retries; returns (headers, body). A 308 is an answer here."""

    async def attempt() -> tuple[Any, bytes]:
        await gcs._set_session()
        async with gcs.session.request(
            method,
            url,
            params=gcs._get_params(params or {}),
            headers=gcs._get_headers(headers),
            data=data,
            json=json,
            timeout=gcs.requests_timeout,
            allow_redirects=False,
        ) as resp:
            contents = await resp.read()
            validate_response(resp.status, contents, url)
            return resp.headers, contents

    return await _retrying(gcs, attempt)


def _split(path: str) -> tuple[str, str]:
    bucket, _, key = path.partition("/")
    return bucket, key


class Upload(io.RawIOBase):
    """Writes one object, ``part_size`` bytes at a time into buffers from ``BUFFERS``.

    An object up to ``single_request_size`` goes up in one request
    (``uploadType=media``): its full buffers are held until it ends, as long as the
    process-wide ``HELD`` budget has room. A larger object (or one that finds no room)
    goes up as a resumable upload whose chunks are the buffers, sent in order (the
    protocol allows no other), the last one finalizing it. So memory stays within one
    buffer per open upload plus ``HELD.limit``. Nothing is visible at ``path`` before
    :meth:`finish` returns; :meth:`abort` cancels the resumable session. Cancelling the
    calling thread's ``Cancel`` interrupts the upload's requests; the session is then
    cancelled without waiting for the stalled store."""

    def __init__(
        self,
        gcs: gcsfs.GCSFileSystem,
        path: str,
        errors: Errors,
        *,
        part_size: int,
        single_request_size: int,
    ) -> None:
        super().__init__()
        self._gcs = gcs
        self._path = path
        self._errors = errors
        self._part_size = part_size
        self._single = single_request_size
        self._buf = BUFFERS.take(part_size)
        self._fill = 0
        self._held: list[bytearray] = []
        self._sent = 0
        self._location: str | None = None
        self._done = False
        self._cancel = Cancel(current())

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        while view:
            take = min(len(view), self._part_size - self._fill)
            self._buf[self._fill : self._fill + take] = view[:take]
            self._fill += take
            view = view[take:]
            if self._fill == self._part_size:
                if self._location is None and self._hold():
                    continue
                with self._errors("uploading"):
                    for buffer in [*self._held, self._buf]:
                        self._cancel.run(self._gcs.loop, self._send_chunk, memoryview(buffer))
                        self._drop_held()
                self._fill = 0
        return total

    def finish(self) -> None:
        """Publish the object (the only request, or the last chunk)."""
        data = memoryview(self._buf)[: self._fill]
        try:
            with self._errors("uploading"):
                if self._location is None:
                    self._cancel.run(self._gcs.loop, self._upload_whole, data)
                else:
                    self._cancel.run(self._gcs.loop, self._send_chunk, data, final=True)
        except BaseException:
            self.abort()
            raise
        self._release()

    def abort(self) -> None:
        """Cancel the upload; nothing is published. Errors are logged, not raised."""
        if self._done:
            return
        self._release()
        location, self._location = self._location, None
        if location is None:
            return
        if self._cancel.cancelled.is_set():
            # Past a deadline the store is stalled: nothing may wait on it now.
            def done(future: concurrent.futures.Future[Any]) -> None:
                exc = None if future.cancelled() else future.exception()
                if exc is not None:
                    self._abort_failed(exc)

            request = _request(self._gcs, "DELETE", location)
            asyncio.run_coroutine_threadsafe(request, self._gcs.loop).add_done_callback(done)
            return
        try:
            fsspec.asyn.sync(self._gcs.loop, _request, self._gcs, "DELETE", location)
        except Exception as exc:  # the caller's error is the one to report
            self._abort_failed(exc)

    def _abort_failed(self, exc: BaseException) -> None:
        log.warning(
            "could not cancel the resumable upload of gs://%s: %s (GCS drops "
            "sessions unused for a week)",
            self._path,
            BY_FORM.redact(str(exc)),  # the session URL is a credential (upload_id=)
        )

    def close(self) -> None:
        # DCP transforms may close what they wrap; the upload ends in finish() or abort().
        if not self.closed:
            super().close()

    def _hold(self) -> bool:
        """Keep the full buffer for a single request, if the object may still fit."""
        if (len(self._held) + 2) * self._part_size > self._single:
            return False
        if not HELD.take(self._part_size):
            return False
        self._held.append(self._buf)
        self._buf = BUFFERS.take(self._part_size)
        self._fill = 0
        return True

    def _drop_held(self) -> None:
        if self._held:
            BUFFERS.give(self._held.pop(0))
            HELD.give(self._part_size)

    def _release(self) -> None:
        self._done = True
        while self._held:
            self._drop_held()
        buffer, self._buf = self._buf, bytearray()
        if buffer:
            BUFFERS.give(buffer)

    async def _upload_whole(self, data: memoryview) -> None:
        bucket, key = _split(self._path)
        body = _Body(*(memoryview(b) for b in self._held), data)
        await _request(
            self._gcs,
            "POST",
            f"{self._gcs._location}/upload/storage/v1/b/{quote(bucket, safe='')}/o",
            params={"uploadType": "media", "name": key},
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(body.size)},
            data=body,
        )

    async def _send_chunk(self, data: memoryview, *, final: bool = False) -> None:
        gcs = self._gcs
        if self._location is None:
            bucket, key = _split(self._path)
            headers, _ = await _request(
                gcs,
                "POST",
                f"{gcs._location}/upload/storage/v1/b/{quote(bucket, safe='')}/o",
                params={"uploadType": "resumable", "name": key},
                json={"name": key},
                headers={"X-Upload-Content-Type": "application/octet-stream"},
            )
            self._location = str(headers["Location"])
        start, size = self._sent, len(data)
        while True:
            total = str(start + len(data)) if final else "*"
            first_last = f"{start}-{start + len(data) - 1}" if data else "*"
            headers, _ = await _request(
                gcs,
                "PUT",
                self._location,
                headers={
                    "Content-Range": f"bytes {first_last}/{total}",
                    "Content-Length": str(len(data)),
                },
                data=_Body(data),
            )
            # 308 with the range the server has persisted; the rest goes again.
            persisted = headers.get("Range")
            if persisted is None and not final:
                raise OSError(f"gs://{self._path}: the server kept no byte of a chunk")
            end = int(persisted.rpartition("-")[2]) + 1 if persisted else start + len(data)
            if end >= start + len(data):
                break
            data, start = data[end - start :], end
        self._sent += size


class RangeReader(io.RawIOBase):
    """``[offset, offset + length)`` of an object (``length=None``: to its end) through
    one streamed ranged GET, copied from the socket's chunks straight into the caller's
    buffer; the answer must be the range asked for (``_ranges.check_range``).

    Opening the GET is retried as gcsfs retries requests; a body that breaks off is
    resumed with a ranged GET from the next byte, pinned to the object's generation (a
    replaced object is never stitched together), up to ``_BODY_RETRIES`` breaks in a
    row. A range that starts past the end reads as empty (a short read). Cancelling
    the calling thread's ``Cancel`` interrupts its requests."""

    def __init__(
        self,
        gcs: gcsfs.GCSFileSystem,
        path: str,
        offset: int,
        length: int | None,
        errors: Errors,
    ) -> None:
        super().__init__()
        self._gcs = gcs
        self._path = path
        self._errors = errors
        self._pos = offset
        self._end = None if length is None else offset + length
        self._resp: aiohttp.ClientResponse | None = None
        self._generation: str | None = None
        self._left = memoryview(b"")  # received beyond what the caller took
        self._eof = length == 0
        self._cancel = Cancel(current())

    def readable(self) -> bool:
        return True

    def open(self) -> None:
        """Send the GET now (errors such as a missing object surface here)."""
        if not self._eof and self._resp is None:
            with self._errors("reading"):
                self._cancel.run(self._gcs.loop, self._open)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if self._end is not None:
            view = view[: max(0, self._end - self._pos + len(self._left))]
        if not view:
            return 0
        if self._left:
            n = min(len(view), len(self._left))
            view[:n] = self._left[:n]
            self._left = self._left[n:]
            return n
        if self._eof:
            return 0
        with self._errors("reading"):
            got: int = self._cancel.run(self._gcs.loop, self._fill, view)
        return got

    def close(self) -> None:
        if not self.closed:
            resp, self._resp = self._resp, None
            if resp is not None:
                self._gcs.loop.call_soon_threadsafe(resp.close)
            super().close()

    async def _open(self) -> None:
        await _retrying(self._gcs, self._open_once)

    async def _open_once(self) -> None:
        gcs = self._gcs
        await gcs._set_session()
        url = gcs.url(self._path, generation=self._generation)
        last = None if self._end is None else self._end - 1
        ranged = last is not None or self._pos > 0
        asked = {"Range": f"bytes={self._pos}-{'' if last is None else last}"} if ranged else {}
        headers = gcs._get_headers(asked)
        resp = await gcs.session.get(
            url, params=gcs._get_params({}), headers=headers, timeout=gcs.requests_timeout
        )
        if resp.status == 416:  # the range starts past the end
            resp.release()
            self._eof = True
            return
        if resp.status >= 400:
            contents = await resp.read()
            resp.release()
            validate_response(resp.status, contents, self._path)
        if ranged:
            try:
                check_range(
                    resp.status,
                    resp.headers.get("Content-Range"),
                    self._pos,
                    last,
                    f"gs://{self._path}",
                )
            except RangeMismatchError:
                resp.close()
                raise
        self._generation = resp.headers.get("X-Goog-Generation", self._generation)
        self._resp = resp

    async def _fill(self, view: memoryview) -> int:
        got, failures = 0, 0
        while got < len(view) and not self._eof:
            if self._resp is None:
                await self._open()
                continue
            try:
                chunk = await self._resp.content.readany()
            except _BODY_ERRORS as exc:
                self._resp.close()
                self._resp = None
                failures += 1
                if failures > _BODY_RETRIES:
                    raise OSError(
                        f"gs://{self._path}: the response body broke off {failures} times "
                        f"in a row: {exc!r}"
                    ) from exc
                await asyncio.sleep(random.random() * min(5.0, 0.2 * 2 ** (failures - 1)))
                continue
            if not chunk:  # the body ended: the object is shorter than the range
                self._resp.release()
                self._resp = None
                self._eof = True
                break
            failures = 0
            data = memoryview(chunk)
            if self._end is not None:
                data = data[: self._end - self._pos]  # never past the range
            n = min(len(data), len(view) - got)
            view[got : got + n] = data[:n]
            got += n
            self._pos += len(data)
            self._left = data[n:]
            if self._end is not None and self._pos >= self._end:
                self._resp.release()
                self._resp = None
                self._eof = True
        return got
