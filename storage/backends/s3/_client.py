"""``S3Client``: where every S3 request of the backend is made.

It wraps s3fs's aiobotocore client (requests run on s3fs's event loop) and, for the
bodies of data requests (part uploads, ranged GETs), the direct path of ``_http`` where
the client's configuration allows it; it turns errors into the contract's built-in
errors and holds the upload slots of one filesystem object (parts in flight across all
its streams); the module also keeps the process-wide pool of part buffers. The
filesystem (``_filesystem``) and the data path (``_io``) both go through its public
functions and methods; neither reaches into the other.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import crc32c
import fsspec.asyn
import s3fs

from storage.backends._buffers import BufferPool
from storage.backends._clients import Shared, options_key
from storage.backends._connections import PooledResponse
from storage.backends._retry import Retry
from storage.backends.cancel import Cancel, StreamCancelled, current
from storage.backends.s3._compat import call_s3
from storage.backends.s3._http import DirectPath, direct_path, retryable

# A part is handed to aiohttp in slices of this size (no copies; at most one slice is
# copied into asyncio's buffer when the socket is full).
_SEND_CHUNK = 1 << 20

# Private s3fs instances (their retry loop is switched off), shared by the filesystem
# objects of one process that have the same options: a client costs ~0.1 s of CPU to
# build, which a 250 MB checkpoint would otherwise pay on every save and load.
_CLIENTS: Shared[s3fs.S3FileSystem] = Shared()


def shared_s3fs(options: dict[str, Any]) -> s3fs.S3FileSystem:
    """An s3fs client for ``options`` with one retry layer (botocore's), one per
    process and set of options."""

    def build() -> s3fs.S3FileSystem:
        client = s3fs.S3FileSystem(**options)
        client.retries = 1
        return client

    return _CLIENTS.get(options_key(options), build)


#: Part buffers kept for reuse by every S3 filesystem of the process (see
#: ``BufferPool``: kept buffers make a long-lived job's saves fault their memory in
#: once, as the CRT client's buffer pool does).
PART_BUFFERS = BufferPool(256 << 20)


def split_path(path: str) -> tuple[str, str]:
    """``bucket/key`` -> ``(bucket, key)``."""
    bucket, _, key = path.partition("/")
    return bucket, key


def crc32c_header(data: Any) -> str:
    """The ``x-amz-checksum-crc32c`` value of ``data`` or of a CRC32C already computed
    (base64 of the big-endian CRC)."""
    crc = data if isinstance(data, int) else crc32c.crc32c(data)
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


class S3Client:
    """Requests, error translation and upload slots for one filesystem.

    ``translate`` needs the filesystem's error vocabulary (URLs, attempts, what to
    check) and removes credentials from what it quotes, so the filesystem hands it over
    as ``translate`` (raise its result ``from`` its ``__cause__``); ``checksum`` sends a
    CRC32C of every uploaded body, which the store verifies (S3, SeaweedFS); ``direct``
    lets part uploads and ranged GETs take the direct path where it applies."""

    def __init__(
        self,
        s3: s3fs.S3FileSystem,
        *,
        translate: Callable[[BaseException, str, str], BaseException],
        url: Callable[[str], str],
        max_attempts: int,
        part_size: int,
        max_concurrency: int,
        checksum: bool,
        direct: bool = True,
    ) -> None:
        self.s3 = s3
        self.translate = translate
        self.url = url
        self.max_attempts = max_attempts
        #: botocore's standard mode, as the direct path retries its requests.
        self.retry = Retry(max_attempts, retryable)
        self.part_size = part_size
        self.checksum = checksum
        self.slots = threading.BoundedSemaphore(max_concurrency)
        self._max_concurrency = max_concurrency
        self._use_direct = direct
        self._direct: DirectPath | None = None
        self._direct_known = False
        self._uploads: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    # --- requests ------------------------------------------------------------------

    def run(self, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any, **kwargs: Any) -> Any:
        """Run ``func(*args, **kwargs)`` on the client's event loop and wait for it."""
        return fsspec.asyn.sync(self.s3.loop, func, *args, **kwargs)

    def call(
        self, method: str, path: str, action: str, *, cancel: Cancel | None = None, **kwargs: Any
    ) -> Any:
        """One request, interrupted by ``cancel`` (default: the calling thread's, so a
        save or load past its deadline interrupts its HEADs, LISTs and metadata PUTs too);
        errors come back translated."""
        cancel = cancel if cancel is not None else current()
        try:
            if cancel is None:
                return self.run(call_s3, self.s3, method, **kwargs)
            return cancel.run(self.s3.loop, call_s3, self.s3, method, **kwargs)
        except StreamCancelled:
            raise
        except Exception as exc:
            error = self.translate(exc, path, action)
            raise error from error.__cause__

    def send(self, method: str, on_error: Callable[[BaseException], None], **kwargs: Any) -> None:
        """Start one request and do not wait for it; ``on_error`` hears of a failure."""

        def done(future: concurrent.futures.Future[Any]) -> None:
            exc = None if future.cancelled() else future.exception()
            if exc is not None:
                on_error(exc)

        coroutine = call_s3(self.s3, method, **kwargs)
        asyncio.run_coroutine_threadsafe(coroutine, self.s3.loop).add_done_callback(done)

    def checksum_args(self, data: Any, crc: int | None = None) -> dict[str, str]:
        """The checksum argument of an upload of ``data`` (``crc``: its CRC32C, if known)."""
        if not self.checksum:
            return {}
        return {"ChecksumCRC32C": crc32c_header(data if crc is None else crc)}

    # --- data requests ---------------------------------------------------------------

    def direct(self, bucket: str) -> DirectPath | None:
        """The direct path for requests to ``bucket``, or ``None`` (then s3fs)."""
        if not self._direct_known:
            with self._lock:
                if not self._direct_known and self._use_direct:
                    self._direct = direct_path(self.s3, self.run, self.max_attempts)
                self._direct_known = True
        direct = self._direct
        return direct if direct is not None and direct.serves(bucket) else None

    def get_object(
        self, path: str, action: str, *, cancel: Cancel | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        """A streamed GET (``Range``, ``IfMatch`` as botocore names them): the response
        with ``ETag`` and ``Body``; read the body with :meth:`fill`, close it with
        :meth:`close_body`. ``cancel`` interrupts the request and the body's reads."""
        bucket, key = split_path(path)
        direct = self.direct(bucket)
        if direct is None:
            result: dict[str, Any] = self.call(
                "get_object", path, action, cancel=cancel, Bucket=bucket, Key=key, **kwargs
            )
            return result
        try:
            return direct.get_object(
                bucket, key, kwargs.get("Range"), kwargs.get("IfMatch"), cancel
            )
        except StreamCancelled:
            raise
        except Exception as exc:
            error = self.translate(exc, path, action)
            raise error from error.__cause__

    def fill(
        self, body: Any, view: memoryview, progress: list[int], cancel: Cancel | None = None
    ) -> None:
        """Read ``body`` into ``view`` until it is full or the body ends, counting in
        ``progress[0]`` (so a caller knows what arrived before an error); the body of
        a GET made with ``cancel`` is interrupted by it."""
        if isinstance(body, PooledResponse):
            while progress[0] < len(view):
                n = body.readinto(view[progress[0] :])
                if not n:
                    return
                progress[0] += n
            return
        if cancel is None:
            self.run(_fill, body, view, progress)
        else:
            cancel.run(self.s3.loop, _fill, body, view, progress)

    def close_body(self, body: Any) -> None:
        """Close a response body from any thread."""
        if isinstance(body, PooledResponse):
            body.close()
        else:  # aiohttp bodies belong to the loop
            self.s3.loop.call_soon_threadsafe(body.close)

    def upload_part(
        self,
        group: Cancel,
        path: str,
        upload_id: str,
        number: int,
        data: memoryview,
        crc: int | None = None,
    ) -> tuple[concurrent.futures.Future[str], dict[str, str]]:
        """Start uploading part ``number`` (``crc``: the CRC32C of ``data``, if known); a
        future of its ETag, and the checksum arguments that completing the upload must
        repeat. ``data`` must stay unchanged until the future is done; cancelling
        ``group`` interrupts the part, :meth:`settle` stops the parts of ``group``."""
        bucket, key = split_path(path)
        checksum = self.checksum_args(data, crc)
        direct = self.direct(bucket)
        if direct is not None:
            header = checksum.get("ChecksumCRC32C")
            future = self._upload_pool().submit(
                direct.upload_part, bucket, key, upload_id, number, data, header, group
            )
            return future, checksum
        body = _PartBody(data)
        future = group.start(
            self.s3.loop,
            _upload_part,
            self.s3,
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            PartNumber=number,
            Body=body,
            **checksum,
        )
        future.add_done_callback(lambda _: body.release())
        return future, checksum

    def settle(self, group: Cancel, futures: list[concurrent.futures.Future[str]]) -> None:
        """Stop the parts of ``group``: those not started never start, started ones are
        interrupted, and all are waited for, so none lands after this returns."""
        for future in futures:
            future.cancel()
        group.cancel()
        tasks = group.tasks()
        if tasks:
            with contextlib.suppress(Exception):
                self.run(_settle, tasks)
        concurrent.futures.wait(futures)

    def _upload_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._uploads is None:
                self._uploads = concurrent.futures.ThreadPoolExecutor(
                    self._max_concurrency, thread_name_prefix="dcp-storage-s3-put"
                )
            return self._uploads


async def _fill(body: Any, view: memoryview, progress: list[int]) -> None:
    while progress[0] < len(view):
        chunk = await body.read(len(view) - progress[0])
        if not chunk:
            return
        view[progress[0] : progress[0] + len(chunk)] = chunk
        progress[0] += len(chunk)


async def _upload_part(s3: s3fs.S3FileSystem, **kwargs: Any) -> str:
    resp = await call_s3(s3, "upload_part", **kwargs)
    return str(resp["ETag"])


async def _settle(tasks: list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class _PartBody:
    """A part's bytes as a body botocore can measure and rewind and aiohttp sends
    without copies: not an ``io.IOBase``, so aiohttp takes it as an async iterable and
    writes memoryview slices of the part straight to the socket (a file-like body costs
    a thread-pool round trip and a bytes copy per 256 KiB; a bytes body a copy of the
    whole part). An in-flight part costs its buffer and nothing more; a retry seeks
    back to 0 and iterates again."""

    def __init__(self, data: memoryview) -> None:
        self._data = data
        self._pos = 0

    def __len__(self) -> int:
        return len(self._data) - self._pos

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: len(self._data)}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = len(self._data) if size is None or size < 0 else self._pos + size
        chunk = bytes(self._data[self._pos : end])
        self._pos += len(chunk)
        return chunk

    async def __aiter__(self) -> AsyncIterator[memoryview]:
        while self._pos < len(self._data):
            chunk = self._data[self._pos : self._pos + _SEND_CHUNK]
            self._pos += len(chunk)
            yield chunk

    def close(self) -> None:
        pass  # a retry may need this body again

    def release(self) -> None:
        # Clients keep requests alive in reference cycles; the part's memory goes now.
        self._data = memoryview(b"")
