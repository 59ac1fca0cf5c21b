"""The GCS data path: uploads from reused buffers; ranged GETs read straight into the
caller's buffer, in windows, a large read split into parallel GETs, resumed where a
body breaks off.

GETs go through the direct path (``_direct``) where the client's configuration allows
it, else through gcsfs's session (``_session.StreamedGet``); the reader below does not
care which. Uploads go through gcsfs's session (``_session.request``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import io
import logging
import os
import random
import threading
import urllib.parse
from typing import Any

import fsspec.asyn
import gcsfs
from gcsfs.retry import validate_response

from extensions.streams import read_all
from storage.backends._buffers import BufferPool
from storage.backends._ranges import RangeMismatchError, check_range
from storage.backends._secrets import BY_FORM
from storage.backends._upload import FilledUpload
from storage.backends.cancel import Cancel, StreamCancelled, current
from storage.backends.gcs._session import (
    Answer,
    BodyBroken,
    Errors,
    Get,
    UploadBody,
    backoff,
    request,
    retriable,
    split,
)

log = logging.getLogger("storage.backends.gcs")

#: Upload buffers of every GCS filesystem of the process (see ``BufferPool``).
BUFFERS = BufferPool(256 << 20)

# Breaks of a response body in a row (no byte received in between) before a read fails.
_BODY_RETRIES = 5

#: Ranged GETs of large reads in flight at once, across the process.
PARALLEL_GETS = 8
_GETTERS: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
_GETTERS_LOCK = threading.Lock()


def _getters() -> concurrent.futures.ThreadPoolExecutor:
    with _GETTERS_LOCK:  # one pool per process: a forked child makes its own
        pool = _GETTERS.get(os.getpid())
        if pool is None:
            pool = _GETTERS[os.getpid()] = concurrent.futures.ThreadPoolExecutor(
                PARALLEL_GETS, thread_name_prefix="dcp-storage-gcs-get"
            )
        return pool


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


class Upload(FilledUpload):
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
        super().__init__(BUFFERS, part_size)
        self._gcs = gcs
        self._path = path
        self._errors = errors
        self._single = single_request_size
        self._held: list[bytearray] = []
        self._sent = 0
        self._location: str | None = None
        self._done = False
        self._cancel = Cancel(current())

    def _part_full(self) -> None:
        if self._location is None and self._hold():
            return
        with self._errors("uploading"):
            for buffer in [*self._held, self._buf]:
                self._cancel.run(self._gcs.loop, self._send_chunk, memoryview(buffer))
                self._drop_held()
        self._fill = 0  # sent: the buffer is filled again

    def finish(self) -> None:
        """Publish the object (the only request, or the last chunk)."""
        data = self._filled()
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

            cancelling = request(self._gcs, "DELETE", location)
            asyncio.run_coroutine_threadsafe(cancelling, self._gcs.loop).add_done_callback(done)
            return
        try:
            fsspec.asyn.sync(self._gcs.loop, request, self._gcs, "DELETE", location)
        except Exception as exc:  # the caller's error is the one to report
            self._abort_failed(exc)

    def _abort_failed(self, exc: BaseException) -> None:
        log.warning(
            "could not cancel the resumable upload of gs://%s: %s (GCS drops "
            "sessions unused for a week)",
            self._path,
            BY_FORM.redact(str(exc)),  # the session URL is a credential (upload_id=)
        )

    def _hold(self) -> bool:
        """Keep the full buffer for a single request, if the object may still fit."""
        if (len(self._held) + 2) * self._part_size > self._single:
            return False
        if not HELD.take(self._part_size):
            return False
        self._held.append(self._swap())
        return True

    def _drop_held(self) -> None:
        if self._held:
            BUFFERS.give(self._held.pop(0))
            HELD.give(self._part_size)

    def _release(self) -> None:
        self._done = True
        while self._held:
            self._drop_held()
        self._release_buffer()

    async def _upload_whole(self, data: memoryview) -> None:
        bucket, key = split(self._path)
        body = UploadBody(*(memoryview(b) for b in self._held), data)
        await request(
            self._gcs,
            "POST",
            f"{self._gcs._location}/upload/storage/v1/b/{_quote(bucket)}/o",
            params={"uploadType": "media", "name": key},
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(body.size)},
            data=body,
        )

    async def _send_chunk(self, data: memoryview, *, final: bool = False) -> None:
        gcs = self._gcs
        if self._location is None:
            bucket, key = split(self._path)
            headers, _ = await request(
                gcs,
                "POST",
                f"{gcs._location}/upload/storage/v1/b/{_quote(bucket)}/o",
                params={"uploadType": "resumable", "name": key},
                json={"name": key},
                headers={"X-Upload-Content-Type": "application/octet-stream"},
            )
            self._location = str(headers["Location"])
        start, size = self._sent, len(data)
        while True:
            total = str(start + len(data)) if final else "*"
            first_last = f"{start}-{start + len(data) - 1}" if data else "*"
            headers, _ = await request(
                gcs,
                "PUT",
                self._location,
                headers={
                    "Content-Range": f"bytes {first_last}/{total}",
                    "Content-Length": str(len(data)),
                },
                data=UploadBody(data),
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


def _quote(bucket: str) -> str:
    return urllib.parse.quote(bucket, safe="")


class RangeReader(io.RawIOBase):
    """``[offset, offset + length)`` of an object (``length=None``: one GET to its
    end), read straight into the caller's buffer.

    A bounded range is fetched in windows of ``window`` bytes, one GET each; a read
    that reaches a window or more past the current GET (a large tensor) fetches that
    part as window-sized GETs in parallel (``PARALLEL_GETS`` in the process at a time)
    while the current GET is read. Every byte of the range is fetched once. Every
    ranged answer must be the range asked for (``_ranges.check_range``).

    Opening a GET is retried as gcsfs retries requests; a body that breaks off is
    resumed with a ranged GET from the next byte, pinned to the object's generation (a
    replaced object is never stitched together), up to ``_BODY_RETRIES`` breaks in a
    row. A range that starts past the end reads as empty (a short read). Cancelling
    the calling thread's ``Cancel`` (or ``cancel``) interrupts its requests."""

    def __init__(
        self,
        gcs: gcsfs.GCSFileSystem,
        get: Get,
        path: str,
        offset: int,
        length: int | None,
        errors: Errors,
        *,
        window: int,
        generation: str | None = None,
        cancel: Cancel | None = None,
    ) -> None:
        super().__init__()
        self._gcs = gcs
        self._get = get
        self._path = path
        self._errors = errors
        self._pos = offset
        self._end = None if length is None else offset + length
        self._window = window
        self._stop = offset  # end of the current window's GET
        self._answer: Answer | None = None
        self._generation = generation
        self._eof = length == 0
        self._cancel = cancel or Cancel(current())

    def readable(self) -> bool:
        return True

    def open(self) -> None:
        """Send the first GET now (errors such as a missing object surface here)."""
        if not self._eof and self._answer is None:
            with self._errors("reading"):
                self._start()

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        with self._errors("reading"):
            return self._read(view)

    def readall(self) -> bytes:
        return read_all(self, chunk=8 << 20)

    def close(self) -> None:
        if not self.closed:
            self._drop()
            super().close()

    # --- internals --------------------------------------------------------------------

    def _read(self, view: memoryview) -> int:
        if self._end is not None:
            view = view[: max(0, self._end - self._pos)]
            ahead = max(0, self._stop - self._pos)  # what the current GET still brings
            rest = len(view) - ahead
            if rest >= self._window and (ahead or rest > self._window) and not self._eof:
                return self._read_split(view, ahead)
        failures = 0
        while view and not self._eof:
            if self._answer is not None and self._end is not None and self._pos >= self._stop:
                self._drop()  # its window is consumed
            if self._answer is None:
                if self._end is not None and self._pos >= self._end:
                    self._eof = True
                    break
                self._start()
                continue
            room = view if self._end is None else view[: self._stop - self._pos]
            try:
                n = self._answer.readinto(room)
            except BodyBroken as exc:
                self._drop()
                failures += 1
                if failures > _BODY_RETRIES:
                    raise OSError(
                        f"gs://{self._path}: the response body broke off {failures} times "
                        f"in a row at byte {self._pos}: {exc}"
                    ) from exc
                self._cancel.wait(random.random() * min(5.0, 0.2 * 2 ** (failures - 1)))
                continue
            if not n:  # the body ended: the object is shorter than the range
                self._drop()
                self._eof = True
                break
            self._pos += n
            return n
        return 0

    def _start(self) -> None:
        """Open the GET of the next window (or of the current one's rest), with gcsfs's
        retries."""
        if self._end is not None and self._pos >= self._stop:
            self._stop = min(self._end, self._pos + self._window)
        last = None if self._end is None else self._stop - 1
        first = self._pos if last is not None or self._pos else None
        retries = int(getattr(self._gcs, "retries", 6))
        for attempt in range(retries):
            if attempt:
                self._cancel.wait(backoff(attempt))
            self._cancel.check()
            try:
                self._answer = self._open(first, last)
                return
            except (StreamCancelled, RangeMismatchError):
                raise
            except Exception as exc:
                self._cancel.check()  # a connection shut by the cancel: say so
                if attempt == retries - 1 or not retriable(exc):
                    raise
        raise AssertionError("unreachable")

    def _open(self, first: int | None, last: int | None) -> Answer | None:
        answer = self._get(self._path, first, last, self._generation, self._cancel)
        if answer.status == 416:  # the range starts past the end
            answer.close()
            self._eof = True
            return None
        if answer.status >= 400:
            validate_response(answer.status, answer.error_body(), self._path)
        try:
            if first is not None:
                check_range(
                    answer.status,
                    answer.header("Content-Range"),
                    first,
                    last,
                    f"gs://{self._path}",
                )
            elif answer.status != 200:
                raise OSError(f"gs://{self._path}: unexpected answer {answer.status}")
        except BaseException:
            answer.close()
            raise
        self._generation = answer.header("X-Goog-Generation") or self._generation
        return answer

    def _drop(self) -> None:
        answer, self._answer = self._answer, None
        if answer is not None:
            answer.close()

    def _read_split(self, view: memoryview, ahead: int) -> int:
        """``view`` filled by the current GET (its first ``ahead`` bytes) and by
        window-sized GETs in parallel (the rest); stops at the first short piece."""
        start = self._pos
        pieces = [
            (start + at, view[at : at + self._window])
            for at in range(ahead, len(view), self._window)
        ]
        group = Cancel(self._cancel)
        futures = [_getters().submit(self._read_piece, at, p, group) for at, p in pieces]
        try:
            got = 0
            while got < ahead and not self._eof:
                n = self._read(view[got:ahead])
                if not n:
                    break
                got += n
            counts = [got, *(fut.result() for fut in futures)]
        except BaseException:
            group.cancel()  # the pieces write into the caller's buffer: stop them first
            concurrent.futures.wait(futures)
            raise
        done = 0
        for count, size in zip(counts, [ahead, *(len(p) for _, p in pieces)]):
            done += count
            if count < size:  # the object is shorter than the range
                self._eof = True
                break
        self._drop()
        self._pos = self._stop = start + done
        return done

    def _read_piece(self, offset: int, piece: memoryview, group: Cancel) -> int:
        reader = RangeReader(
            self._gcs,
            self._get,
            self._path,
            offset,
            len(piece),
            self._errors,
            window=len(piece),
            generation=self._generation,
            cancel=group,
        )
        with contextlib.closing(reader):
            got = 0
            while got < len(piece):
                n = reader._read(piece[got:])
                if not n:
                    break
                got += n
            return got
