"""Parallel decoding of items whose transform splits into frames: the reader's threads
read (and checksum) stored bytes while a pool of decoders, one per core, turns them into
the target tensors.

Which items qualify is the transform contract's to say (``extensions.base``: the
``frame_decoder`` / ``frames`` capability, answered for a recorded chain by
``ExtensionRegistry.framing``; zstd offers it from its seek table). An item qualifies
when its chain is one such transform, it decodes straight into its target
(``decode.direct_offset``) and it is on local disk or in memory (where finding its frame
list costs no request). An item with a frame list is cut into its frames, each decoded
into its own slice of the target, so one large tensor keeps every core busy; an item
without one but small enough for a buffer is decoded whole by one decoder while the
reader goes on to the next. Anything else keeps the reader's sequential path.

The reader still owns integrity: it reads every stored byte through the item's CRC-32C
and checks length and checksum once the last frame is read; each frame must decode to
exactly the size its list gives, and the frames' sizes must add up to the archive the
metadata describes. The planner gets the tensor only once every frame is decoded and
the checksum matched. At most ``slots`` buffers (the reader asks for cores + 2) of
:data:`MAX_BUFFER` bytes are in flight, so a load holds at most (cores + 2) x ~4 MiB of
stored bytes beside its targets (16 MiB on 2 cores, 264 MiB on 64), whatever the
checkpoint's size.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable, Sequence
from typing import IO

from extensions.base import MAX_FRAME_BYTES, Frame, FrameDecoder
from extensions.errors import IntegrityError, UnsafeCheckpointError, printable
from extensions.registry import Framing
from extensions.streams import pump, readinto_exact, skip
from storage.checkpoint.items import StoredItemReader

#: A frame or whole item decoded from one buffer is at most this many stored bytes.
MAX_BUFFER = MAX_FRAME_BYTES


def decoder_count() -> int:
    """One decoder per core this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


class Decoders:
    """A pool of decoder threads with at most ``slots`` buffers in flight; the first
    error any decode raised is raised by :meth:`close` (and stops nothing already
    running: each decode is bounded CPU work)."""

    def __init__(self, workers: int, slots: int) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix="dcp-storage-decoding"
        )
        self._slots = threading.Semaphore(slots)
        self._free: list[bytearray] = []
        self._lock = threading.Lock()
        self._futures: list[concurrent.futures.Future[None]] = []

    def buffer(self, size: int) -> memoryview:
        """A buffer of ``size`` bytes (waits while ``slots`` are in flight); buffers are
        reused, so a load touches new memory only for its first few frames."""
        self._slots.acquire()
        with self._lock:
            buffer = self._free.pop() if self._free else bytearray(MAX_BUFFER)
        return memoryview(buffer)[:size]

    def submit(self, work: Callable[[], None], buffer: memoryview) -> None:
        """Run ``work`` on a decoder, then give ``buffer`` back."""

        def run() -> None:
            try:
                work()
            finally:
                with self._lock:
                    self._free.append(buffer.obj)  # type: ignore[arg-type]
                self._slots.release()

        future = self._pool.submit(run)
        with self._lock:
            self._futures.append(future)

    def close(self) -> None:
        """Wait for every decode; raise the first error (in submission order)."""
        self._pool.shutdown(wait=True)
        for future in self._futures:
            error = future.exception()
            if error is not None:
                raise error


class _Countdown:
    """Runs ``done`` once ``count`` parts have finished, unless one of them failed."""

    def __init__(self, count: int, done: Callable[[], None]) -> None:
        self._left = count
        self._failed = False
        self._done = done
        self._lock = threading.Lock()

    def finished(self, ok: bool = True) -> None:
        with self._lock:
            self._left -= 1
            self._failed |= not ok
            last = self._left == 0 and not self._failed
        if last:
            self._done()


def frame_list(framing: Framing, stream: IO[bytes], length: int) -> Sequence[Frame] | None:
    """The frames of the item of ``length`` stored bytes that starts at the current
    position of ``stream`` (seekable), as its transform lists them, or ``None``; the
    position is restored."""
    start = stream.tell()

    def read_at(offset: int, size: int) -> bytes:
        if offset < 0 or size < 0 or offset + size > length:
            raise ValueError(f"read of {size} bytes at {offset} outside an item of {length}")
        stream.seek(start + offset)
        return stream.read(size)

    try:
        return framing.frames(read_at, length)
    finally:
        stream.seek(start)


def decode_framed(
    decoders: Decoders,
    stored: StoredItemReader,
    frames: Sequence[Frame] | None,
    decode: FrameDecoder,
    target: memoryview,
    data_offset: int,
    done: Callable[[], None],
) -> None:
    """Read ``stored`` (an item of ``frames``, or of one buffer when ``None``) and have
    its plain bytes ``[data_offset, data_offset + len(target))`` decoded into ``target``
    by ``decoders``, each frame with ``decode``; ``done`` runs once every part is
    decoded and the checksum matched. Raises :class:`IntegrityError` (naming the item)
    for damage the reader sees."""
    end = data_offset + len(target)
    parts: list[tuple[int, int, int, int | None]]  # stored offset, length; plain offset, length
    if frames is not None:
        _check_frames(frames, stored, end)
        parts = [
            (f.stored_offset, f.stored_length, f.decoded_offset, f.decoded_length) for f in frames
        ]
    else:
        parts = [(0, stored.length, 0, None)]
    countdown = _Countdown(len(parts) + 1, done)
    read = 0
    for stored_offset, stored_size, start, plain_size in parts:
        buffer = decoders.buffer(stored_size)
        gap = stored_offset - read
        if (gap and skip(stored.raw, gap) != gap) or readinto_exact(
            stored.raw, buffer
        ) != stored_size:
            decoders.submit(lambda: None, buffer)
            countdown.finished(ok=False)
            stored.finish()  # reports the truncation
            raise IntegrityError(f"{stored.where}: item is truncated")
        read = stored_offset + stored_size

        def work(
            buffer: memoryview = buffer, start: int = start, size: int | None = plain_size
        ) -> None:
            ok = False
            try:
                _decode_part(buffer, start, size, target, data_offset, stored.where, decode)
                ok = True
            finally:
                countdown.finished(ok)

        decoders.submit(work, buffer)
    try:
        stored.finish()  # the bytes after the frames too: length and checksum of all of it
    except BaseException:
        countdown.finished(ok=False)
        raise
    countdown.finished()


def _check_frames(frames: Sequence[Frame], stored: StoredItemReader, end: int) -> None:
    """Refuse a frame list that does not describe the archive of ``end`` plain bytes
    in frames of at most :data:`MAX_BUFFER` stored bytes, in order, inside the item."""
    plain = sum(f.decoded_length for f in frames)
    largest = max((f.stored_length for f in frames), default=0)
    if plain < end or plain > end + (64 << 10) or largest > MAX_BUFFER:
        raise UnsafeCheckpointError(
            f"{stored.where}: its seek table lists {plain} plain bytes in frames of up "
            f"to {largest} bytes, not the archive of {end} bytes the "
            "metadata describes; the checkpoint is damaged or hostile"
        )
    stored_end = decoded_end = 0
    for frame in frames:
        if (
            frame.stored_offset < stored_end
            or frame.stored_length < 0
            or frame.decoded_length < 0
            or frame.decoded_offset != decoded_end
        ):
            break
        stored_end = frame.stored_offset + frame.stored_length
        decoded_end += frame.decoded_length
    else:
        if stored_end <= stored.length:
            return
    raise UnsafeCheckpointError(
        f"{stored.where}: its seek table does not list frames in order, inside the item's "
        f"{stored.length} stored bytes, decoding to consecutive plain bytes; the "
        "checkpoint is damaged or hostile"
    )


def _decode_part(
    source: memoryview,
    start: int,
    size: int | None,
    target: memoryview,
    data_offset: int,
    where: str,
    decode: FrameDecoder,
) -> None:
    """Decode one frame (``size`` plain bytes from plain offset ``start``) or, with
    ``size=None``, a whole item, with ``decode``, putting what falls in the tensor's
    bytes into ``target``; checks the frame's size, or bounds what follows the tensor."""
    try:
        reader = decode(source, size is None)
        end = data_offset + len(target)
        position = start
        if position < data_offset:  # the archive's header
            want = data_offset - position if size is None else min(size, data_offset - position)
            position += skip(reader, want)
        if data_offset <= position < end and (size is None or position < start + size):
            stop = end if size is None else min(end, start + size)
            position += readinto_exact(reader, target[position - data_offset : stop - data_offset])
        if size is None:
            if position != end:
                raise IntegrityError(f"{where}: item is truncated")
            trailer = pump(reader, None, limit=(64 << 10) + 1)
            if trailer > 64 << 10:
                raise UnsafeCheckpointError(
                    f"{where}: the item decodes to more than its tensor and archive; refusing it"
                )
            return
        position += skip(reader, start + size - position)
        if position != start + size or reader.read(1):
            raise IntegrityError(
                f"{where}: a frame does not decode to the {size} bytes its seek table lists; "
                "the stored bytes are damaged"
            )
    except (IntegrityError, UnsafeCheckpointError):
        raise
    except Exception as exc:
        raise IntegrityError(f"{where}: cannot decode: {printable(str(exc), 200)}") from exc
