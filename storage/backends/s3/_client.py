"""``S3Client``: where every S3 request of the backend is made.

It wraps s3fs's aiobotocore client (requests run on s3fs's event loop), turns botocore
errors into the contract's built-in errors and holds the upload slots of one
filesystem object (parts in flight across all its streams); the module also keeps the
process-wide pool of part buffers. The filesystem (``_filesystem``) and the data path
(``_io``) both go through its public functions and methods; neither reaches into the
other.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import crc32c
import fsspec.asyn
import fsspec.utils
import s3fs

# Private s3fs instances (their retry loop is switched off), shared by the filesystem
# objects of one process that have the same options: a client costs ~0.1 s of CPU to
# build, which a 250 MB checkpoint would otherwise pay on every save and load.
_SHARED: dict[tuple[int, str], s3fs.S3FileSystem] = {}
_SHARED_LOCK = threading.Lock()


def shared_s3fs(options: dict[str, Any]) -> s3fs.S3FileSystem:
    """An s3fs client for ``options`` with one retry layer (botocore's), one per
    process and set of options."""
    key = (os.getpid(), fsspec.utils.tokenize(sorted(options.items(), key=lambda kv: kv[0])))
    with _SHARED_LOCK:
        client = _SHARED.get(key)
        if client is None:
            client = s3fs.S3FileSystem(**options)
            client.retries = 1
            _SHARED[key] = client
        return client


# Idle part buffers kept for reuse by every filesystem of the process, up to this many
# bytes. Fresh memory costs page faults (~0.8 s of CPU per GiB on a small VM, more than
# the upload itself); kept buffers make a long-lived job's saves fault only once, as
# the CRT client's buffer pool does.
RETAINED_PART_BYTES = 256 << 20
_POOL: list[bytearray] = []
_POOL_LOCK = threading.Lock()


def take_buffer(size: int) -> bytearray:
    """A buffer of ``size`` bytes, contents undefined: a kept one when one fits."""
    with _POOL_LOCK:
        for i, buffer in enumerate(_POOL):
            if len(buffer) == size:
                return _POOL.pop(i)
    return bytearray(size)


def recycle(buffer: bytearray) -> None:
    """Give a buffer back; it is kept if the pool has room (buffers of other sizes make
    room first), else freed."""
    with _POOL_LOCK:
        other = [b for b in _POOL if len(b) != len(buffer)]
        same = [b for b in _POOL if len(b) == len(buffer)]
        while other and sum(map(len, other + same)) + len(buffer) > RETAINED_PART_BYTES:
            other.pop(0)
        if sum(map(len, other + same)) + len(buffer) <= RETAINED_PART_BYTES:
            same.append(buffer)
        _POOL[:] = other + same


def release_part_buffers() -> None:
    """Free every kept part buffer (for jobs that want the memory back)."""
    with _POOL_LOCK:
        _POOL.clear()


def split_path(path: str) -> tuple[str, str]:
    """``bucket/key`` -> ``(bucket, key)``."""
    bucket, _, key = path.partition("/")
    return bucket, key


def error_code(exc: BaseException) -> str:
    """The S3 error code of a botocore error (or of its cause), else ``""``."""
    for err in (exc, exc.__cause__):
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            return str(response.get("Error", {}).get("Code", ""))
    return ""


def crc32c_header(data: Any) -> str:
    """The ``x-amz-checksum-crc32c`` value of ``data`` (base64 of the big-endian CRC)."""
    return base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()


class S3Client:
    """Requests, error translation and upload slots for one filesystem.

    ``translate`` needs the filesystem's error vocabulary (URLs, attempts, what to
    check), so the filesystem hands it over as ``translate``; ``checksum`` sends a
    CRC32C of every uploaded body, which the store verifies (S3, SeaweedFS)."""

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
    ) -> None:
        self.s3 = s3
        self.translate = translate
        self.url = url
        self.max_attempts = max_attempts
        self.part_size = part_size
        self.checksum = checksum
        self.slots = threading.BoundedSemaphore(max_concurrency)

    # --- requests ------------------------------------------------------------------

    def run(self, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any, **kwargs: Any) -> Any:
        """Run ``func(*args, **kwargs)`` on the client's event loop and wait for it."""
        return fsspec.asyn.sync(self.s3.loop, func, *args, **kwargs)

    def call(self, method: str, path: str, action: str, **kwargs: Any) -> Any:
        """One request; errors come back translated."""
        try:
            return self.run(self.s3._call_s3, method, **kwargs)
        except Exception as exc:
            raise self.translate(exc, path, action) from exc

    def submit(
        self, method: str, tasks: list[asyncio.Task[Any]], **kwargs: Any
    ) -> concurrent.futures.Future[Any]:
        """Start a request without waiting; its task is added to ``tasks`` (to cancel)."""

        async def tracked() -> Any:
            task = asyncio.current_task()
            if task is not None:
                tasks.append(task)
            return await self.s3._call_s3(method, **kwargs)

        return asyncio.run_coroutine_threadsafe(tracked(), self.s3.loop)

    def close_soon(self, body: Any) -> None:
        """Close a response body from any thread (bodies belong to the loop)."""
        self.s3.loop.call_soon_threadsafe(body.close)

    def checksum_args(self, data: Any) -> dict[str, str]:
        return {"ChecksumCRC32C": crc32c_header(data)} if self.checksum else {}
