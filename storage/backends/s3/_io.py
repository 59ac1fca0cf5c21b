"""The S3 data path: the source of the shared object reader (``_object_read``), and
concurrent multipart uploads.

Everything here talks to S3 through :class:`S3Client`'s public methods."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import aiohttp
import botocore.exceptions as botoexc
import crc32c

from storage.backends._connections import BodyBroken
from storage.backends._object_read import ObjectReader, Opened, VersionGone
from storage.backends._retry import never
from storage.backends._upload import FilledUpload
from storage.backends.cancel import Cancel, StreamCancelled, current
from storage.backends.s3._client import (
    PART_BUFFERS,
    S3Client,
    split_path,
)
from storage.backends.s3._http import error_code

log = logging.getLogger("storage.backends.s3._filesystem")

_MAX_PARTS = 10_000

# Errors of a response body that broke off: the read resumes from where it stopped.
_BODY_ERRORS = (
    BodyBroken,
    aiohttp.ClientError,
    asyncio.TimeoutError,
    ConnectionError,
    botoexc.HTTPClientError,
    botoexc.IncompleteReadError,
    botoexc.ResponseStreamingError,
)


class S3Object:
    """One S3 object as the source of the shared reader (``_object_read.Source``):
    ranged GETs pinned to the ETag with ``If-Match``, through :class:`S3Client` (the
    direct path or s3fs)."""

    backend = "s3"

    def __init__(self, client: S3Client, path: str) -> None:
        self._client = client
        self._path = path
        self.url = client.url(path)
        # Opening a GET was retried by botocore or the direct path already: only a body
        # that breaks off is tried again here.
        self.retry = dataclasses.replace(client.retry, retryable=never)

    @contextlib.contextmanager
    def errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except (OSError, StreamCancelled):
            raise  # the client's errors come translated
        except Exception as exc:
            error = self._client.translate(exc, self._path, action)
            raise error from error.__cause__

    def get(
        self, first: int | None, last: int | None, version: str | None, cancel: Cancel
    ) -> Opened | None:
        kwargs: dict[str, Any] = {}
        if first is not None:
            kwargs["Range"] = f"bytes={first}-{'' if last is None else last}"
        if version is not None:
            kwargs["IfMatch"] = version
        try:
            resp = self._client.get_object(self._path, "reading", cancel=cancel, **kwargs)
        except OSError as exc:
            code = error_code(exc.__cause__ or exc)
            if code in ("InvalidRange", "416"):
                return None
            gone = isinstance(exc, FileNotFoundError) or code in ("PreconditionFailed", "412")
            if version is not None and gone:
                raise VersionGone from exc
            raise
        status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return Opened(
            status=int(status or (200 if first is None else 206)),
            content_range=resp.get("ContentRange"),
            version=resp.get("ETag"),
            body=_Body(self._client, resp["Body"], cancel),
            encoding=resp.get("ContentEncoding"),  # botocore decodes none
        )


class _Body:
    """A GET's body through :meth:`S3Client.fill`, read as the shared reader reads."""

    def __init__(self, client: S3Client, body: Any, cancel: Cancel) -> None:
        self._client = client
        self._body: Any = body
        self._cancel = cancel
        self._broken: BaseException | None = None

    def readinto(self, view: memoryview) -> int:
        if self._broken is not None:
            raise BodyBroken(f"response body broke off: {self._broken!r}") from self._broken
        progress = [0]
        try:
            self._client.fill(self._body, view, progress, self._cancel)
        except _BODY_ERRORS as exc:
            if not progress[0]:
                raise BodyBroken(f"response body broke off: {exc!r}") from exc
            self._broken = exc
        return progress[0]

    def close(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            self._client.close_body(body)


def open_reader(
    client: S3Client, path: str, offset: int, length: int | None, *, window: int | None = None
) -> ObjectReader:
    """``[offset, offset + length)`` of ``path`` (``length=None``: to its end) in windows
    of ``window`` bytes (default ``client.part_size``), its first GET sent (a missing
    object fails here)."""
    size = window or client.part_size
    return ObjectReader.opened(S3Object(client, path), offset, length, window=size)


class MultipartWriter(FilledUpload):
    """Buffers one part, uploads full parts concurrently, completes or aborts.

    Part buffers come from the process's pool and go back to it once their upload is
    done, so saves reuse memory that is already mapped instead of faulting in fresh
    pages for every part. With ``client.checksum`` every part carries its CRC32C, which the store
    checks; the payload itself is not hashed for the signature (see ``S3FileSystem``).
    Cancelling the calling thread's ``Cancel`` interrupts every request of the upload
    (a write waiting for an upload slot too); the abort that follows is sent without
    waiting for the stalled store."""

    def __init__(self, client: S3Client, path: str) -> None:
        super().__init__(PART_BUFFERS, client.part_size)
        self._client = client
        self._path = path
        self._bucket, self._key = split_path(path)
        self._crc = 0  # of the part's bytes so far
        self._upload_id: str | None = None
        self._parts: list[tuple[int, concurrent.futures.Future[str], dict[str, str]]] = []
        self._group = Cancel(current())
        self._finished = False

    def _block_copied(self, block: memoryview) -> None:
        if self._client.checksum:  # the block was just copied: its bytes are in cache
            self._crc = crc32c.crc32c(block, self._crc)

    def _part_full(self) -> None:
        self._ship_part()

    def _ship_part(self) -> None:
        client = self._client
        if self._upload_id is None:
            resp = client.call(
                "create_multipart_upload",
                self._path,
                "starting a multipart upload",
                cancel=self._group,
                Bucket=self._bucket,
                Key=self._key,
                **({"ChecksumAlgorithm": "CRC32C"} if client.checksum else {}),
            )
            self._upload_id = resp["UploadId"]
        self._raise_failed()
        number = len(self._parts) + 1
        if number > _MAX_PARTS:
            raise ValueError(f"{client.url(self._path)}: more than {_MAX_PARTS} parts")
        self._group.acquire(client.slots)
        try:
            fut, checksum = client.upload_part(
                self._group, self._path, self._upload_id, number, self._filled(), self._crc
            )
        except BaseException:
            client.slots.release()
            raise
        # Parts may grow (S3 allows it), so objects past 10,000 x part_size still fit.
        buffer = self._swap(self._part_size * 2 if number % 1000 == 0 else None)
        self._crc = 0

        def done(_: object) -> None:
            client.slots.release()
            PART_BUFFERS.give(buffer)

        fut.add_done_callback(done)
        self._parts.append((number, fut, checksum))

    def _raise_failed(self) -> None:
        for number, fut, _ in self._parts:
            if fut.done() and fut.exception() is not None:
                exc = fut.exception()
                assert exc is not None
                error = self._client.translate(exc, self._path, f"uploading part {number}")
                raise error from error.__cause__

    def finish(self) -> None:
        client = self._client
        try:
            if self._upload_id is None:
                body = bytes(self._filled())
                client.call(
                    "put_object",
                    self._path,
                    "uploading",
                    cancel=self._group,
                    Bucket=self._bucket,
                    Key=self._key,
                    Body=body,
                    **client.checksum_args(body),
                )
            else:
                if self._fill:
                    self._ship_part()
                parts = []
                for number, fut, checksum in self._parts:
                    try:
                        etag = fut.result()
                    except Exception as exc:
                        error = client.translate(exc, self._path, f"uploading part {number}")
                        raise error from error.__cause__
                    parts.append({"PartNumber": number, "ETag": etag, **checksum})
                client.call(
                    "complete_multipart_upload",
                    self._path,
                    "completing the multipart upload",
                    cancel=self._group,
                    Bucket=self._bucket,
                    Key=self._key,
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": parts},
                )
        except BaseException:
            self.abort()
            raise
        self._done()

    def _done(self) -> None:
        self._finished = True
        self._release_buffer()

    def abort(self) -> None:
        if self._finished:
            return
        interrupted = self._group.cancelled.is_set()
        self._done()
        # Parts not started never start; started ones are interrupted and awaited, so
        # no part can land after the abort and leave the upload half alive.
        self._client.settle(self._group, [fut for _, fut, _ in self._parts])
        if self._upload_id is None:
            return
        request: dict[str, Any] = {
            "Bucket": self._bucket,
            "Key": self._key,
            "UploadId": self._upload_id,
        }
        if interrupted:
            # Past a deadline the store is stalled: nothing may wait on it now.
            self._client.send("abort_multipart_upload", self._abort_failed, **request)
            return
        try:
            self._client.call(
                "abort_multipart_upload", self._path, "aborting the multipart upload", **request
            )
        except Exception as exc:  # the caller's error is the one to report
            self._abort_failed(exc)

    def _abort_failed(self, exc: BaseException) -> None:
        log.warning(
            "could not abort multipart upload %s of %s: %s (a bucket lifecycle "
            "rule AbortIncompleteMultipartUpload cleans these up)",
            self._upload_id,
            self._client.url(self._path),
            exc,
        )
