"""The one read path of the object stores: a slice of an object read straight into the
caller's buffer by ranged GETs, in windows, a large read split into GETs run in
parallel, a body that breaks off resumed where it stopped, every GET after the first
pinned to the version the first one answered.

A backend supplies only its :class:`Source`: one attempt at a ranged GET of a pinned
version (as fsspec's ``AbstractBufferedFile._fetch_range`` is a file's one hook), its
:class:`~storage.backends._retry.Retry` policy, and how its client errors read as the
contract's. S3 (``s3/_io.py``) and GCS (``gcs/_read.py``) are such sources.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from collections.abc import Callable
from typing import Any, Protocol

from extensions.streams import read_all
from storage.backends._connections import BodyBroken
from storage.backends._ranges import (
    RangeMismatchError,
    check_encoding,
    check_range,
    read_pieces,
)
from storage.backends._retry import Retry
from storage.backends.cancel import Cancel, StreamCancelled, current

#: ``errors(action)``: a context that turns client errors into the contract's, naming
#: the object and ``action``.
Errors = Callable[[str], contextlib.AbstractContextManager[None]]


class Body(Protocol):
    """A GET's response body, read into the caller's buffers."""

    def readinto(self, view: memoryview) -> int:
        """Up to ``len(view)`` bytes; 0 at the body's end; :class:`BodyBroken` when it
        breaks off before a byte of this call arrived (a break after some bytes is
        raised by the next call)."""
        ...

    def close(self) -> None:
        """Release the response (from any thread)."""
        ...


@dataclasses.dataclass
class Opened:
    """A GET's answer: ``status`` and ``content_range`` (checked against the range
    asked for before a byte is read), the ``version`` it served (an ETag, a
    generation; ``None``: not said), the ``body``, and the ``encoding`` its body still
    has (a ``Content-Encoding`` the client did not undo; only ``None`` or
    ``"identity"`` is read)."""

    status: int
    content_range: str | None
    version: str | None
    body: Body
    encoding: str | None = None


class VersionGone(Exception):
    """Raised by :meth:`Source.get`: the pinned version is no longer the object's."""


class Source(Protocol):
    """One object on one store, as :class:`ObjectReader` fetches it."""

    #: The object's URL, for messages.
    url: str
    #: The name of the process's pool of ranged GETs (``_ranges.parallel_gets``).
    backend: str
    #: Attempts and waits of opening a GET (``retryable`` says which errors of
    #: :meth:`get` are tried again) and, with :meth:`Retry.resuming`, of resuming a body.
    retry: Retry

    def errors(self, action: str) -> contextlib.AbstractContextManager[None]:
        """A context that turns client errors into the contract's (an :data:`Errors`)."""
        ...

    def get(
        self, first: int | None, last: int | None, version: str | None, cancel: Cancel
    ) -> Opened | None:
        """One attempt at a GET of bytes ``first`` to ``last`` (both included;
        ``first=None``: the whole object, ``last=None``: to its end) of ``version``
        (``None``: the current one), interrupted by ``cancel``. ``None`` when the range
        starts past the object's end; :class:`VersionGone` when ``version`` was
        replaced or deleted."""
        ...


class ObjectReader(io.RawIOBase):
    """``[offset, offset + length)`` of an object (``length=None``: one GET to its
    end), read straight into the caller's buffer.

    A bounded range is fetched in windows of ``window`` bytes, one GET each; a read
    that reaches a window or more past the current GET (a large tensor) fetches that
    part as window-sized GETs in parallel (``_ranges.PARALLEL_GETS`` in the process at
    a time) while the current GET is read; when a piece fails, the others are
    cancelled and awaited before the error is raised, so none writes into the buffer
    afterwards. Every byte of the range is fetched once, and every ranged answer must
    be the range asked for (``_ranges.check_range``), its body the bytes as stored (no
    ``Content-Encoding``: ``_ranges.check_encoding``).

    Opening a GET is retried by the source's policy; a body that breaks off (or ends
    before the end its ``Content-Range`` names) is resumed with a ranged GET from the
    next byte, up to the policy's attempts in a row without a byte received. Every GET
    after the first is pinned to the version the first one answered: an object replaced
    or deleted meanwhile fails the read (an ``OSError`` that says so), as does an answer
    that says it served another version (a store or proxy that ignored the pin); it is
    never stitched together from two versions. A range that starts past the end reads
    as empty (a short read). Cancelling the calling thread's
    ``Cancel`` (or ``cancel``) interrupts its requests and reads."""

    def __init__(
        self,
        source: Source,
        offset: int,
        length: int | None,
        *,
        window: int,
        version: str | None = None,
        cancel: Cancel | None = None,
    ) -> None:
        super().__init__()
        self._source = source
        self._pos = offset
        self._end = None if length is None else offset + length
        self._window = window
        self._stop = offset  # end of the current window's GET
        self._body: Body | None = None
        self._promised = 0  # where the current GET's body ends, as its Content-Range says
        self._version = version
        self._eof = length == 0
        self._cancel = cancel or Cancel(current())

    @classmethod
    def opened(
        cls, source: Source, offset: int, length: int | None, *, window: int
    ) -> ObjectReader:
        """A reader of ``[offset, offset + length)`` of ``source`` (``length=None``: to its
        end), its first GET sent (a missing object fails here, the reader closed)."""
        reader = cls(source, offset, length, window=window)
        try:
            reader.open()
        except BaseException:
            reader.close()
            raise
        return reader

    def readable(self) -> bool:
        return True

    @property
    def version(self) -> str | None:
        """The version (ETag, generation) the GETs so far served; ``None`` before one."""
        return self._version

    def open(self) -> None:
        """Send the first GET now (errors such as a missing object surface here)."""
        if not self._eof and self._body is None:
            with self._source.errors("reading"):
                self._start()

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        with self._source.errors("reading"):
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
        breaks = 0
        while view and not self._eof:
            if self._body is not None and self._end is not None and self._pos >= self._stop:
                self._drop()  # its window is consumed
            if self._body is None:
                if self._end is not None and self._pos >= self._end:
                    self._eof = True
                    break
                self._start()
                continue
            room = view if self._end is None else view[: self._stop - self._pos]
            try:
                n = self._body.readinto(room)
                if not n and self._pos < self._promised:
                    # Its Content-Length said less than its Content-Range: what is
                    # missing is asked for again, never read as the object's end.
                    raise BodyBroken(
                        f"the body ended before byte {self._pos}, though its "
                        f"Content-Range runs to byte {self._promised - 1}"
                    )
            except BodyBroken as exc:
                self._drop()
                breaks += 1
                resume = self._source.retry.resuming()
                if breaks >= resume.attempts:
                    raise OSError(
                        f"{self._source.url}: the response body broke off {breaks} times "
                        f"in a row at byte {self._pos}: {exc}"
                    ) from exc
                resume.wait(breaks, self._cancel)
                continue
            if not n:  # the body ended: the object is shorter than the range
                self._drop()
                self._eof = True
                break
            self._pos += n
            return n
        return 0

    def _start(self) -> None:
        """Open the GET of the next window (or of the current one's rest)."""
        if self._end is not None and self._pos >= self._stop:
            self._stop = min(self._end, self._pos + self._window)
        last = None if self._end is None else self._stop - 1
        first = self._pos if last is not None or self._pos else None
        retry = self._source.retry
        attempt = 0
        while True:
            attempt += 1
            self._cancel.check()
            try:
                self._open(first, last)
                return
            except (StreamCancelled, RangeMismatchError):
                raise
            except VersionGone:  # the bytes read so far belong to a version now gone
                raise OSError(
                    f"{self._source.url}: the object was replaced or deleted while it was "
                    f"read (its version {self._version} is gone); read it again"
                ) from None
            except Exception as exc:
                self._cancel.check()  # a connection shut by the cancel: say so
                if attempt >= retry.attempts or not retry.retryable(exc):
                    raise
            retry.wait(attempt, self._cancel)

    def _open(self, first: int | None, last: int | None) -> None:
        source = self._source
        answer = source.get(first, last, self._version, self._cancel)
        if answer is None:  # the range starts past the end
            self._eof = True
            return
        promised = 0
        try:
            if first is not None:
                end = check_range(answer.status, answer.content_range, first, last, source.url)
                promised = end or 0
            elif answer.status != 200:
                raise OSError(f"{source.url}: unexpected answer {answer.status}")
            check_encoding(answer.encoding, source.url)
            # A store or proxy may ignore the pin: what it says it served must match.
            if None not in (self._version, answer.version) and answer.version != self._version:
                raise VersionGone
        except BaseException:
            answer.body.close()
            raise
        self._version = answer.version or self._version
        self._body = answer.body
        self._promised = promised

    def _drop(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            body.close()

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

        counts = read_pieces(
            self._source.backend, self._read_piece, pieces, self._cancel, current_get
        )
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
        reader = ObjectReader(
            self._source,
            offset,
            len(piece),
            window=len(piece),
            version=self._version,
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
