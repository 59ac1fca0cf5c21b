"""GCS uploads: an object filled into reused buffers, sent as one request when it fits
(``uploadType=media``), else as a resumable upload whose chunks are the buffers. The
requests go through gcsfs's session (``_session.request``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import urllib.parse
from typing import Any

import fsspec.asyn
import gcsfs

from storage.backends._buffers import BufferPool
from storage.backends._object_read import Errors
from storage.backends._secrets import BY_FORM
from storage.backends._upload import FilledUpload
from storage.backends.cancel import Cancel, current
from storage.backends.gcs import _compat as compat
from storage.backends.gcs._session import (
    UploadBody,
    policy,
    request,
    split,
)

log = logging.getLogger("storage.backends.gcs")

#: Upload buffers of every GCS filesystem of the process (see ``BufferPool``).
BUFFERS = BufferPool(256 << 20)


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
            f"{compat.location(self._gcs)}/upload/storage/v1/b/{_quote(bucket)}/o",
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
                f"{compat.location(gcs)}/upload/storage/v1/b/{_quote(bucket)}/o",
                params={"uploadType": "resumable", "name": key},
                json={"name": key},
                headers={"X-Upload-Content-Type": "application/octet-stream"},
            )
            self._location = str(headers["Location"])
        start, size = self._sent, len(data)
        retry, stalls = policy(gcs), 0
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
            if end < start:  # the rest of the chunk would go out as the bytes at `end`
                raise OSError(
                    f"gs://{self._path}: the server says it kept {end} bytes of the upload, "
                    f"fewer than the {start} it had confirmed; the upload cannot go on"
                )
            # The rest goes again: tries in a row that it kept nothing of count as attempts.
            stalls = stalls + 1 if end == start else 0
            if stalls >= retry.attempts:
                raise OSError(
                    f"gs://{self._path}: the server kept no byte of a chunk {stalls} times in a row"
                )
            if stalls:
                await asyncio.sleep(retry.delay(stalls))
            data, start = data[end - start :], end
        self._sent += size


def _quote(bucket: str) -> str:
    return urllib.parse.quote(bucket, safe="")
