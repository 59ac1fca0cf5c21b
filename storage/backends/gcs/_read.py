"""GCS reads: ranged GETs read straight into the caller's buffer, in windows, a large
read split into parallel GETs, resumed where a body breaks off.

GETs go through the direct path (``_direct``) where the client's configuration allows
it, else through gcsfs's session (``_session.StreamedGet``); the reader does not care
which."""

from __future__ import annotations

import contextlib
import io
import random
from typing import Any

import gcsfs
from gcsfs.retry import validate_response

from extensions.streams import read_all
from storage.backends._connections import BodyBroken
from storage.backends._ranges import RangeMismatchError, check_range, read_pieces
from storage.backends.cancel import Cancel, StreamCancelled, current
from storage.backends.gcs._session import (
    Answer,
    Errors,
    Get,
    backoff,
    retriable,
)

# Breaks of a response body in a row (no byte received in between) before a read fails.
_BODY_RETRIES = 5


class RangeReader(io.RawIOBase):
    """``[offset, offset + length)`` of an object (``length=None``: one GET to its
    end), read straight into the caller's buffer.

    A bounded range is fetched in windows of ``window`` bytes, one GET each; a read
    that reaches a window or more past the current GET (a large tensor) fetches that
    part as window-sized GETs in parallel (``_ranges.PARALLEL_GETS`` in the process at a time)
    while the current GET is read. Every byte of the range is fetched once. Every
    ranged answer must be the range asked for (``_ranges.check_range``).

    Opening a GET is retried as gcsfs retries requests; a body that breaks off is
    resumed with a ranged GET from the next byte, up to ``_BODY_RETRIES`` breaks in a
    row. Every GET after the first is pinned to the generation the first one answered:
    an object replaced or deleted meanwhile fails the read (an ``OSError`` that says
    so), it is never stitched together from two versions. A range that starts past
    the end reads as empty (a short read). Cancelling the calling thread's ``Cancel``
    (or ``cancel``) interrupts its requests."""

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
        if answer.status == 404 and self._generation is not None:
            answer.close()  # pinned: the bytes read so far belong to a version now gone
            raise OSError(
                f"gs://{self._path}: the object was replaced or deleted while it was read "
                f"(its generation {self._generation} is gone); read it again"
            )
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

        def current_get() -> int:
            got = 0
            while got < ahead and not self._eof:
                n = self._read(view[got:ahead])
                if not n:
                    break
                got += n
            return got

        counts = read_pieces("gcs", self._read_piece, pieces, self._cancel, current_get)
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
