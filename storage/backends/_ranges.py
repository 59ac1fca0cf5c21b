"""Ranged GETs, for every backend that sends them: the one check of an answer, the
threads that fetch a large read's pieces in parallel (:func:`read_pieces`), and the
windowed slice reader of backends that fetch a range per call (:class:`WindowReader`).

A server or proxy may ignore ``Range`` (HTTP allows it: ``200`` and the whole object)
or answer another range than the one asked for (a ``206`` whose ``Content-Range`` says
so). Read as the range asked for, either hands one item's bytes to another: a checkpoint
without checksums (written by stock DCP) then loads the wrong tensor values silently.
So every ranged answer is checked before its body is read:

* ``206``: ``Content-Range`` must start at the first byte asked for and end at the last
  one, or earlier only where the object ends (a range past the end is cut short there).
* ``200``: the whole object. Accepted only for a range that starts at byte 0, whose body
  then starts with the bytes asked for (the reader takes what it asked for and drops the
  rest). For any other start it is refused rather than skipped through: a store that
  ignores ranges would make every item of a load download its file from the start.
"""

from __future__ import annotations

import concurrent.futures
import io
import os
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

from extensions.errors import printable
from storage.backends.cancel import Cancel, StreamCancelled

# ASCII digits, at most 20 (any object size): a header is the server's, not to be trusted.
_CONTENT_RANGE = re.compile(
    r"\s*bytes\s+(\d{1,20})-(\d{1,20})/(\d{1,20}|\*)\s*", re.IGNORECASE | re.ASCII
)


#: Ranged GETs of large reads in flight at once, per backend, across the process.
PARALLEL_GETS = 8
_POOLS: dict[tuple[int, str], concurrent.futures.ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def parallel_gets(backend: str) -> concurrent.futures.ThreadPoolExecutor:
    """The process's pool of :data:`PARALLEL_GETS` threads for ``backend``'s ranged GETs
    (one per process: a forked child makes its own); reads go through :func:`read_pieces`."""
    key = (os.getpid(), backend)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = concurrent.futures.ThreadPoolExecutor(
                PARALLEL_GETS, thread_name_prefix=f"dcp-storage-{backend}-get"
            )
        return pool


def read_pieces(
    backend: str,
    read_piece: Callable[[int, memoryview, Cancel], int],
    pieces: Sequence[tuple[int, memoryview]],
    cancel: Cancel,
    meanwhile: Callable[[], int] | None = None,
) -> list[int]:
    """Fill the ``pieces`` (object offset, the slice of the caller's buffer it goes to)
    on ``backend``'s pool: ``read_piece(offset, piece, group)`` returns the bytes it put
    into ``piece``, making its requests under ``group`` (a child of ``cancel``). The
    calling thread runs ``meanwhile`` (if given) while they are fetched. Returns the
    counts, ``meanwhile``'s first, then the pieces' in order.

    The pieces write into the caller's buffer, so none may still run once this returns
    or raises: when any piece or ``meanwhile`` fails (or the wait is interrupted), the
    pieces not started are dropped, the running ones are cancelled through ``group``,
    and all are waited for before the error is raised (a piece's own failure rather than
    the interruptions it caused in its siblings)."""
    group = Cancel(cancel)
    pool = parallel_gets(backend)
    futures = [pool.submit(read_piece, at, piece, group) for at, piece in pieces]
    try:
        first = [meanwhile()] if meanwhile is not None else []
        concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        failed = [e for f in futures if f.done() and (e := f.exception()) is not None]
        if failed:
            raise next((e for e in failed if not isinstance(e, StreamCancelled)), failed[0])
        return first + [f.result() for f in futures]
    except BaseException:
        for future in futures:
            future.cancel()
        group.cancel()
        concurrent.futures.wait(futures)
        raise


class RangeMismatchError(OSError):
    """A ranged GET was answered with bytes other than those asked for."""


def check_range(
    status: int, content_range: str | None, first: int, last: int | None, url: str
) -> int | None:
    """Raise :class:`RangeMismatchError` unless a GET of ``url`` for bytes ``first`` to
    ``last`` (inclusive; ``None``: to the end of the object) answered with ``status`` and
    ``content_range`` (the header, if any) delivers a body that starts at ``first`` and
    holds nothing past ``last`` (see the module docstring). Returns the offset past
    the last byte a ``206`` says it holds (a body that ends before it broke off), else
    ``None``."""
    asked = f"bytes={first}-{'' if last is None else last}"
    if status == 200:
        if first == 0:
            return None
        raise RangeMismatchError(
            f"{url}: the server ignored the range of a GET ({asked}) and sent the whole "
            "object (200, not 206); reading it as the range would load other bytes. The "
            "store (or a proxy in front of it) must support HTTP range requests"
        )
    found = _CONTENT_RANGE.fullmatch(content_range or "")
    if status == 206 and found is not None:
        start, end = int(found.group(1)), int(found.group(2))
        total = None if found.group(3) == "*" else int(found.group(3))
        # The end asked for, or earlier where the object ends (unknown: trust it).
        ends_well = end == last or (end == total - 1 if total is not None else last is None)
        if start == first and start <= end and (last is None or end <= last) and ends_well:
            return end + 1
    raise RangeMismatchError(
        f"{url}: a GET for {asked} was answered with {status} and Content-Range "
        f"{printable(repr(content_range), 120)}, not the bytes asked for; reading them "
        "would load other bytes. A proxy or the store mangles range requests"
    )


def check_encoding(encoding: str | None, url: str) -> None:
    """Raise :class:`RangeMismatchError` unless a GET of ``url`` answered with
    ``Content-Encoding: encoding`` (``None``: no such header) carries the stored bytes
    as they are. A ``gzip`` (or any other) encoding the client does not undo would be
    read as the object's bytes: the CRC-32C of an item written here fails (as damage),
    an item of stock DCP loads as whatever its decoder makes of the compressed bytes."""
    if encoding is None or encoding.strip().lower() in ("", "identity"):
        return
    raise RangeMismatchError(
        f"{url}: a GET was answered with Content-Encoding {printable(repr(encoding), 60)}: "
        "its body is not the object's bytes as stored, and reading it as them would load "
        "other bytes. A proxy compresses answers, or the object was uploaded with a "
        "Content-Encoding; read it through a path that leaves bodies as stored"
    )


#: A windowed slice is fetched this many bytes at a time.
WINDOW = 16 << 20


class WindowReader(io.RawIOBase):
    """Forward-only reader of ``[offset, offset + length)`` of ``path``, fetched with
    ``fetch(path, start, end)`` in exact windows of :data:`WINDOW` bytes (bounded memory,
    no read past the slice). Short at the end of the object (the caller reports
    truncation)."""

    def __init__(self, fetch: Any, path: str, offset: int, length: int) -> None:
        super().__init__()
        self._fetch = fetch
        self._path = path
        self._pos = offset
        self._end = offset + length
        self._buf = memoryview(b"")
        self._short = False

    def readable(self) -> bool:
        return True

    def prefetch(self) -> None:
        if self._buf or self._short or self._pos >= self._end:
            return
        start, end = self._pos, min(self._end, self._pos + WINDOW)
        data = self._fetch(self._path, start, end)
        self._pos += len(data)
        self._short = len(data) < end - start
        self._buf = memoryview(data)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        self.prefetch()
        n = min(len(view), len(self._buf))
        view[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    def readall(self) -> bytes:
        parts: list[bytes] = []
        while True:
            self.prefetch()
            if not self._buf:
                return b"".join(parts)
            parts.append(bytes(self._buf))
            self._buf = memoryview(b"")
