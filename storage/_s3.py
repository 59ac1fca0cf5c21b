"""``S3FileSystem``: S3 (and S3-compatible stores) through s3fs's botocore client.

s3fs supplies the client, credentials, configuration and ``s3_additional_kwargs``; the
data path is ours: one exact ranged GET streamed per slice (resumed where a body breaks
off), concurrent multipart uploads with bounded memory, conditional creates.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import io
import logging
import os
import random
import threading
import time
from collections.abc import Iterator
from typing import IO, Any, ClassVar

from extensions.errors import CheckpointNotFoundError, MissingDependencyError
from storage._fsspec import FsspecFileSystem

try:
    import aiohttp
    import botocore.exceptions as botoexc
    import fsspec.asyn
    import s3fs
except ImportError as _exc:  # pragma: no cover - exercised without the extra installed
    raise MissingDependencyError(
        f"s3:// URLs need s3fs ({_exc.name or _exc}); install it with: "
        "pip install 'dcp-storage[s3]'"
    ) from _exc

log = logging.getLogger(__name__)

DEFAULT_PART_SIZE = 16 << 20
MIN_PART_SIZE = 5 << 20
DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_CONNECT_TIMEOUT = 10
DEFAULT_READ_TIMEOUT = 60
_MAX_PARTS = 10_000

# Errors of a response body that broke off: the read resumes from where it stopped.
_BODY_ERRORS = (
    aiohttp.ClientError,
    asyncio.TimeoutError,
    ConnectionError,
    botoexc.HTTPClientError,
    botoexc.IncompleteReadError,
    botoexc.ResponseStreamingError,
)


def _error_code(exc: BaseException) -> str:
    for err in (exc, exc.__cause__):
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            return str(response.get("Error", {}).get("Code", ""))
    return ""


def _backoff(attempt: int) -> float:
    # Full jitter, as botocore's standard mode does for requests.
    return random.random() * min(5.0, 0.2 * 2 ** (attempt - 1))


class S3FileSystem(FsspecFileSystem):
    """Checkpoints in S3 or an S3-compatible store (``s3://bucket/prefix``).

    ``storage_options`` go to ``s3fs.S3FileSystem`` (``endpoint_url``, ``key``,
    ``secret``, ``token``, ``client_kwargs``, ``config_kwargs``,
    ``s3_additional_kwargs``, ``requester_pays``, ...). Retries belong to botocore
    alone: unless ``config_kwargs`` says otherwise, ``{"retries": {"mode": "standard",
    "total_max_attempts": 5}, "connect_timeout": 10, "read_timeout": 60}``, and s3fs's
    own retry loop is switched off, so a permanent failure costs 5 attempts, never
    5 x 5. A response body that breaks off mid-stream is resumed with a ranged GET
    from the last byte received (the same number of attempts without progress).

    Writes buffer ``part_size`` bytes (default 16 MiB, or s3fs's ``default_block_size``)
    and upload parts concurrently: at most ``max_concurrency`` parts (default 16, or
    s3fs's ``max_concurrency``) are in flight across all streams of this filesystem, so
    client memory peaks near ``part_size x (max_concurrency + open streams)``. Objects
    under one part go up in a single PUT. A failed write aborts its multipart upload.
    """

    protocol: ClassVar[str | None] = "s3"
    io_concurrency: int = 16

    def __init__(
        self,
        *,
        storage_options: dict[str, Any] | None = None,
        part_size: int | None = None,
        max_concurrency: int | None = None,
        io_concurrency: int | None = None,
    ) -> None:
        super().__init__(storage_options=storage_options)
        opts = self.storage_options
        self.part_size = int(part_size or opts.get("default_block_size") or DEFAULT_PART_SIZE)
        if self.part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size must be at least 5 MiB (S3's minimum), got {part_size}")
        self.max_concurrency = int(max_concurrency or opts.get("max_concurrency") or 16)
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if io_concurrency is not None:
            self.io_concurrency = int(io_concurrency)
        self._slots: threading.BoundedSemaphore | None = None

    # --- client --------------------------------------------------------------------

    def _client_options(self) -> dict[str, Any]:
        opts = dict(self.storage_options)
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault(
            "retries", {"mode": "standard", "total_max_attempts": DEFAULT_MAX_ATTEMPTS}
        )
        config.setdefault("connect_timeout", DEFAULT_CONNECT_TIMEOUT)
        config.setdefault("read_timeout", DEFAULT_READ_TIMEOUT)
        config.setdefault(
            "max_pool_connections", max(64, 2 * (self.io_concurrency + self.max_concurrency))
        )
        opts["config_kwargs"] = config
        # A private instance: we switch its retry loop off without touching the user's.
        opts.setdefault("skip_instance_cache", True)
        opts.setdefault("use_listings_cache", False)
        return opts

    def _make_client(self, protocol: str, options: dict[str, Any]) -> Any:
        client = s3fs.S3FileSystem(**options)
        client.retries = 1  # one retry layer: botocore's (see the class docstring)
        return client

    @property
    def max_attempts(self) -> int:
        retries = dict(self._client_options()["config_kwargs"].get("retries") or {})
        if "total_max_attempts" in retries:
            return max(1, int(retries["total_max_attempts"]))
        return max(1, int(retries.get("max_attempts", DEFAULT_MAX_ATTEMPTS - 1)) + 1)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_slots"] = None
        return state

    def _upload_slots(self) -> threading.BoundedSemaphore:
        if self._slots is None:
            self._slots = threading.BoundedSemaphore(self.max_concurrency)
        return self._slots

    def _split(self, path: str) -> tuple[str, str]:
        bucket, _, key = path.partition("/")
        return bucket, key

    def _submit(
        self, method: str, tasks: list[asyncio.Task[Any]], **kwargs: Any
    ) -> concurrent.futures.Future[Any]:
        """Run a request on the client's event loop; its task is added to ``tasks``."""

        async def tracked() -> Any:
            task = asyncio.current_task()
            if task is not None:
                tasks.append(task)
            return await self.fs._call_s3(method, **kwargs)

        return asyncio.run_coroutine_threadsafe(tracked(), self.fs.loop)

    def _call(self, method: str, path: str, action: str, **kwargs: Any) -> Any:
        try:
            return fsspec.asyn.sync(self.fs.loop, self.fs._call_s3, method, **kwargs)
        except Exception as exc:
            raise self._translate(exc, path, action) from exc

    def _translate(self, exc: BaseException, path: str, action: str) -> BaseException:
        url = self.url(path)
        bucket = self._split(path)[0]
        code = _error_code(exc)
        if code == "NoSuchBucket":
            return FileNotFoundError(
                f"{url}: bucket {bucket!r} does not exist ({action}); create it or fix the URL"
            )
        if isinstance(exc, FileNotFoundError) or code in ("NoSuchKey", "404", "NotFound"):
            return FileNotFoundError(f"{url}: no such object ({action})")
        if isinstance(exc, PermissionError) or code in ("AccessDenied", "403"):
            return PermissionError(
                f"{url}: access denied while {action} ({exc}); check the credentials "
                "(key/secret/token in storage_options, or AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY / AWS_PROFILE) and the bucket policy"
            )
        if isinstance(exc, FileExistsError):
            return FileExistsError(f"{url} already exists ({action})")
        attempts = self.max_attempts
        return OSError(f"{url}: {action} failed (after up to {attempts} attempts): {exc}")

    # --- streams -------------------------------------------------------------------

    @contextlib.contextmanager
    def create_stream(self, path: str, mode: str, *, sync: bool = False) -> Iterator[IO[bytes]]:
        if mode == "rb":
            reader = _RangeReader(self, path, 0, None)
            reader.start()
            with contextlib.closing(reader):
                yield reader  # type: ignore[misc]
            return
        if mode != "wb":
            raise ValueError(f"unsupported mode {mode!r}: use 'rb' or 'wb'")
        writer = _MultipartWriter(self, path)
        try:
            yield writer  # type: ignore[misc]
        except BaseException:
            writer.abort()
            raise
        writer.finish()  # sync=True needs nothing more: the upload is complete here

    def open_slice(
        self, path: str, offset: int, length: int
    ) -> contextlib.AbstractContextManager[IO[bytes]]:
        if offset < 0 or length < 0:
            raise ValueError(f"invalid slice offset={offset} length={length}")
        if length == 0:
            self.size(path)  # a missing object still raises FileNotFoundError
            return contextlib.nullcontext(io.BytesIO())
        reader = _RangeReader(self, path, offset, length)
        reader.start()
        return contextlib.closing(reader)  # type: ignore[return-value,arg-type]

    def read_bytes(self, path: str) -> bytes:
        reader = _RangeReader(self, path, 0, None)
        reader.start()
        with contextlib.closing(reader):
            return reader.readall()

    def write_atomic(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        bucket, key = self._split(path)
        payload = bytes(data)
        condition = {"IfNoneMatch": "*"} if exclusive else {}
        try:
            self._call(
                "put_object", path, "publishing", Bucket=bucket, Key=key, Body=payload, **condition
            )
        except OSError as exc:
            code = _error_code(exc.__cause__ or exc)
            conflict = code in ("PreconditionFailed", "412", "ConditionalRequestConflict")
            if not exclusive or not (conflict or isinstance(exc, FileExistsError)):
                raise
            # A retried PUT whose first attempt landed also gets 412: that object is ours.
            with contextlib.suppress(OSError):
                if self.read_bytes(path) == payload:
                    return
            raise FileExistsError(f"{self.url(path)} already exists") from exc

    # --- namespace -----------------------------------------------------------------

    def _head(self, path: str, action: str) -> dict[str, Any]:
        bucket, key = self._split(path)
        if not key:
            raise IsADirectoryError(f"{self.url(path)} is a bucket, not an object")
        result: dict[str, Any] = self._call("head_object", path, action, Bucket=bucket, Key=key)
        return result

    def size(self, path: str) -> int:
        return int(self._head(path, "reading the size")["ContentLength"])

    def modified(self, path: str) -> float | None:
        stamp = self._head(path, "reading the modification time").get("LastModified")
        return float(stamp.timestamp()) if stamp is not None else None

    def exists(self, path: str) -> bool:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            self._head(path, "checking existence")
            return True
        return bool(self._list(path, limit=1))

    def rm_file(self, path: str) -> None:
        self._head(path, "deleting")  # S3 deletes missing keys silently; the contract does not
        bucket, key = self._split(path)
        self._call("delete_object", path, "deleting", Bucket=bucket, Key=key)

    def _list(self, path: str, limit: int | None = None) -> list[str]:
        bucket, key = self._split(path)
        prefix = key.rstrip("/") + "/" if key else ""
        names: set[str] = set()
        token: dict[str, str] = {}
        while True:
            page = self._call(
                "list_objects_v2",
                path,
                "listing",
                Bucket=bucket,
                Prefix=prefix,
                Delimiter="/",
                **({"MaxKeys": limit} if limit else {}),
                **token,
            )
            names.update(o["Key"][len(prefix) :] for o in page.get("Contents", []))
            names.update(
                p["Prefix"][len(prefix) :].rstrip("/") for p in page.get("CommonPrefixes", [])
            )
            if limit and names or not page.get("IsTruncated"):
                return sorted(n for n in names if n)
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def ls(self, path: str) -> list[str]:
        names = self._list(path)
        if not names:
            raise FileNotFoundError(f"{self.url(path)}: nothing under this prefix")
        return names

    def mkdir(self, path: str) -> None:
        # No directories on S3; but a missing bucket is worth saying before any upload.
        bucket = self._split(path)[0]
        try:
            self._call("head_bucket", path, "checking the bucket", Bucket=bucket)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"{self.url(path)}: bucket {bucket!r} does not exist; create it first, "
                "or fix the URL"
            ) from None
        except OSError:
            pass  # HeadBucket may be forbidden to writers that may still PUT objects

    def rm_dir(self, path: str) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return os.fspath(checkpoint_id).startswith(("s3://", "s3a://"))


class _RangeReader(io.RawIOBase):
    """One streamed GET of ``[offset, offset + length)`` (``length=None``: to the end).

    A body that breaks off is resumed with a ranged GET from the next byte, pinned to
    the object's ETag; a range starting past the end reads as empty (short read)."""

    def __init__(self, owner: S3FileSystem, path: str, offset: int, length: int | None) -> None:
        super().__init__()
        self._owner = owner
        self._path = path
        self._pos = offset
        self._end = None if length is None else offset + length
        self._body: Any = None
        self._etag: str | None = None
        self._eof = length == 0

    def readable(self) -> bool:
        return True

    def start(self) -> None:
        bucket, key = self._owner._split(self._path)
        kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if self._end is not None:
            kwargs["Range"] = f"bytes={self._pos}-{self._end - 1}"
        elif self._pos:
            kwargs["Range"] = f"bytes={self._pos}-"
        if self._etag:
            kwargs["IfMatch"] = self._etag
        try:
            resp = self._owner._call("get_object", self._path, "reading", **kwargs)
        except OSError as exc:
            if _error_code(exc.__cause__ or exc) in ("InvalidRange", "416"):
                self._eof = True
                return
            raise
        self._etag = resp.get("ETag")
        self._body = resp["Body"]

    def _drop_body(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            self._owner.fs.loop.call_soon_threadsafe(body.close)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if self._end is not None:
            view = view[: max(0, self._end - self._pos)]
        failures = 0
        while view and not self._eof:
            if self._body is None:
                self.start()
                continue
            progress = [0]
            try:
                fsspec.asyn.sync(self._owner.fs.loop, _fill, self._body, view, progress)
            except _BODY_ERRORS as exc:
                self._drop_body()
                if not progress[0]:
                    failures += 1
                    if failures >= self._owner.max_attempts:
                        raise OSError(
                            f"{self._owner.url(self._path)}: reading from byte {self._pos} "
                            f"failed {failures} times: {exc!r}"
                        ) from exc
                    time.sleep(_backoff(failures))
                    continue
            n = progress[0]
            if n == 0:
                self._eof = True
            self._pos += n
            return n
        return 0

    def readall(self) -> bytes:
        chunks: list[bytes] = []
        while True:
            chunk = bytearray(8 << 20)
            n = self.readinto(chunk)
            if not n:
                return b"".join(chunks)
            chunks.append(bytes(memoryview(chunk)[:n]))

    def close(self) -> None:
        self._drop_body()
        super().close()


async def _fill(body: Any, view: memoryview, progress: list[int]) -> None:
    while progress[0] < len(view):
        chunk = await body.read(len(view) - progress[0])
        if not chunk:
            return
        view[progress[0] : progress[0] + len(chunk)] = chunk
        progress[0] += len(chunk)


async def _settle(tasks: list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class _PartBody(io.RawIOBase):
    """A part's bytes as a seekable stream. botocore turns a bytes body into a BytesIO
    and aiohttp then copies that whole; a stream is sent in small reads instead, so
    an in-flight part costs its buffer and nothing more (and retries seek back)."""

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self._data = data
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: len(self._data)}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        chunk = self._data[self._pos : self._pos + len(view)]
        view[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)

    def read(self, size: int | None = -1) -> bytes:
        # aiohttp asks for everything that is left: short reads keep its copies small.
        end = len(self._data) if size is None or size < 0 else self._pos + min(size, 1 << 18)
        chunk = bytes(self._data[self._pos : end])
        self._pos += len(chunk)
        return chunk

    def close(self) -> None:
        pass  # aiohttp closes bodies it sent; a retry may need this one again

    def release(self) -> None:
        # Clients keep requests alive in reference cycles; the part's memory goes now.
        self._data = memoryview(b"")


class _MultipartWriter(io.RawIOBase):
    """Buffers one part, uploads full parts concurrently, completes or aborts."""

    def __init__(self, owner: S3FileSystem, path: str) -> None:
        super().__init__()
        self._owner = owner
        self._path = path
        self._bucket, self._key = owner._split(path)
        self._part_size = owner.part_size
        self._buf = bytearray(self._part_size)
        self._fill = 0
        self._upload_id: str | None = None
        self._parts: list[tuple[int, concurrent.futures.Future[Any]]] = []
        self._tasks: list[asyncio.Task[Any]] = []
        self._finished = False

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
                self._ship_part()
        return total

    def _where(self) -> str:
        return f"uploading part {len(self._parts) + 1}"

    def _ship_part(self) -> None:
        owner = self._owner
        if self._upload_id is None:
            resp = owner._call(
                "create_multipart_upload",
                self._path,
                "starting a multipart upload",
                Bucket=self._bucket,
                Key=self._key,
            )
            self._upload_id = resp["UploadId"]
        self._raise_failed()
        number = len(self._parts) + 1
        if number > _MAX_PARTS:
            raise ValueError(f"{owner.url(self._path)}: more than {_MAX_PARTS} parts")
        body = _PartBody(memoryview(self._buf)[: self._fill])
        slots = owner._upload_slots()
        slots.acquire()
        try:
            fut = owner._submit(
                "upload_part",
                self._tasks,
                Bucket=self._bucket,
                Key=self._key,
                UploadId=self._upload_id,
                PartNumber=number,
                Body=body,
            )
        except BaseException:
            slots.release()
            raise

        def done(_: object) -> None:
            body.release()
            slots.release()

        fut.add_done_callback(done)
        self._parts.append((number, fut))
        # Parts may grow (S3 allows it), so objects past 10,000 x part_size still fit.
        if number % 1000 == 0:
            self._part_size *= 2
        self._buf = bytearray(self._part_size)
        self._fill = 0

    def _raise_failed(self) -> None:
        for number, fut in self._parts:
            if fut.done() and fut.exception() is not None:
                exc = fut.exception()
                assert exc is not None
                raise self._owner._translate(exc, self._path, f"uploading part {number}") from exc

    def finish(self) -> None:
        owner = self._owner
        try:
            if self._upload_id is None:
                owner._call(
                    "put_object",
                    self._path,
                    "uploading",
                    Bucket=self._bucket,
                    Key=self._key,
                    Body=bytes(self._buf[: self._fill]),
                )
            else:
                if self._fill:
                    self._ship_part()
                parts = []
                for number, fut in self._parts:
                    try:
                        resp = fut.result()
                    except Exception as exc:
                        raise owner._translate(exc, self._path, f"uploading part {number}") from exc
                    parts.append({"PartNumber": number, "ETag": resp["ETag"]})
                owner._call(
                    "complete_multipart_upload",
                    self._path,
                    "completing the multipart upload",
                    Bucket=self._bucket,
                    Key=self._key,
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": parts},
                )
        except BaseException:
            self.abort()
            raise
        self._finished = True
        self._buf = bytearray()

    def abort(self) -> None:
        if self._finished:
            return
        self._finished = True
        self._buf = bytearray()
        # Parts not started never start; started ones are cancelled and awaited, so no
        # part can land after the abort and leave the upload half alive.
        for _, fut in self._parts:
            fut.cancel()
        with contextlib.suppress(Exception):
            fsspec.asyn.sync(self._owner.fs.loop, _settle, self._tasks)
        if self._upload_id is None:
            return
        try:
            self._owner._call(
                "abort_multipart_upload",
                self._path,
                "aborting the multipart upload",
                Bucket=self._bucket,
                Key=self._key,
                UploadId=self._upload_id,
            )
        except Exception as exc:  # the caller's error is the one to report
            log.warning(
                "could not abort multipart upload %s of %s: %s (a bucket lifecycle "
                "rule AbortIncompleteMultipartUpload cleans these up)",
                self._upload_id,
                self._owner.url(self._path),
                exc,
            )

    def close(self) -> None:
        # DCP transforms may close what they wrap; the upload ends in finish() or abort().
        if not self.closed:
            super().close()
