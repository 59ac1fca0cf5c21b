"""The S3 data path: streamed ranged GETs with resume, concurrent multipart uploads.

Everything here talks to S3 through :class:`S3Client`'s public methods."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import io
import logging
import random
from typing import Any

import aiohttp
import botocore.exceptions as botoexc
import crc32c

from extensions.streams import read_all
from storage.backends._connections import BodyBroken
from storage.backends._ranges import RangeMismatchError, check_range, read_pieces
from storage.backends._upload import FilledUpload
from storage.backends.cancel import Cancel, current
from storage.backends.s3._client import (
    PART_BUFFERS,
    S3Client,
    error_code,
    split_path,
)

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


def _backoff(attempt: int) -> float:
    # Full jitter, as botocore's standard mode does for requests.
    return random.random() * min(5.0, 0.2 * 2 ** (attempt - 1))


class RangeReader(io.RawIOBase):
    """Ranged GETs of ``[offset, offset + length)`` (``length=None``: one GET to the end).

    A bounded range is fetched in windows of ``client.part_size`` bytes, one streamed
    GET each; a read that starts at a window boundary and asks for two windows or more
    (a large tensor) is fetched with several ranged GETs in parallel (``_ranges.PARALLEL_GETS``
    in the process at a time), straight into the caller's buffer. Every byte of the
    range is fetched once. A body that breaks off is resumed with a ranged GET from
    the next byte, pinned to the object's ETag; a range starting past the end reads as
    empty (short read). Cancelling the calling thread's ``Cancel`` (or ``cancel``)
    interrupts its requests and reads."""

    def __init__(
        self,
        client: S3Client,
        path: str,
        offset: int,
        length: int | None,
        *,
        etag: str | None = None,
        window: int | None = None,
        cancel: Cancel | None = None,
    ) -> None:
        super().__init__()
        self._cancel = cancel or Cancel(current())
        self._client = client
        self._path = path
        self._pos = offset
        self._end = None if length is None else offset + length
        self._window = window or client.part_size
        self._stop = offset  # end of the current window's GET
        self._body: Any = None
        self._etag = etag
        self._eof = length == 0

    def readable(self) -> bool:
        return True

    def start(self) -> None:
        """Open the GET of the next window (or resume the current one)."""
        if self._end is not None and self._pos >= self._stop:
            self._stop = min(self._end, self._pos + self._window)
        kwargs: dict[str, Any] = {}
        last = None if self._end is None else self._stop - 1
        if self._end is not None or self._pos:
            kwargs["Range"] = f"bytes={self._pos}-{'' if last is None else last}"
        if self._etag:
            kwargs["IfMatch"] = self._etag
        try:
            resp = self._client.get_object(self._path, "reading", cancel=self._cancel, **kwargs)
        except OSError as exc:
            if error_code(exc.__cause__ or exc) in ("InvalidRange", "416"):
                self._eof = True
                return
            raise
        self._body = resp["Body"]
        if "Range" in kwargs:
            status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 206))
            try:
                check_range(
                    status, resp.get("ContentRange"), self._pos, last, self._client.url(self._path)
                )
            except RangeMismatchError:
                self._drop_body()
                raise
        self._etag = resp.get("ETag")

    def _drop_body(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            self._client.close_body(body)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if self._end is not None:
            view = view[: max(0, self._end - self._pos)]
            if self._body is not None and self._pos >= self._stop:
                self._drop_body()  # its window is consumed
            at_boundary = self._body is None and self._pos >= self._stop and not self._eof
            if at_boundary and len(view) >= 2 * self._window:
                return self._read_parallel(view)
        failures = 0
        while view and not self._eof:
            if self._body is None:
                self.start()
                continue
            progress = [0]
            try:
                self._client.fill(self._body, view, progress, self._cancel)
            except _BODY_ERRORS as exc:
                self._drop_body()
                if not progress[0]:
                    failures += 1
                    if failures >= self._client.max_attempts:
                        raise OSError(
                            f"{self._client.url(self._path)}: reading from byte {self._pos} "
                            f"failed {failures} times: {exc!r}"
                        ) from exc
                    self._cancel.wait(_backoff(failures))
                    continue
            n = progress[0]
            if n == 0:
                self._eof = True
            self._pos += n
            return n
        return 0

    def _read_parallel(self, view: memoryview) -> int:
        pieces = [
            (self._pos + start, view[start : start + self._window])
            for start in range(0, len(view), self._window)
        ]
        counts = read_pieces("s3", self._read_piece, pieces, self._cancel)
        done = 0
        for count, (_, piece) in zip(counts, pieces):
            done += count
            if count < len(piece):  # the object is shorter than the range
                self._eof = True
                break
        self._pos += done
        self._stop = self._pos
        return done

    def _read_piece(self, offset: int, piece: memoryview, group: Cancel) -> int:
        reader = RangeReader(
            self._client,
            self._path,
            offset,
            len(piece),
            etag=self._etag,
            window=len(piece),
            cancel=group,
        )
        with contextlib.closing(reader):
            got = 0
            while got < len(piece):
                n = reader.readinto(piece[got:])
                if not n:
                    break
                got += n
            return got

    def readall(self) -> bytes:
        return read_all(self, chunk=8 << 20)

    def close(self) -> None:
        self._drop_body()
        super().close()


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
