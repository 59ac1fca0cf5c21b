"""What holds the persist worker's writes back (:mod:`._child` runs the calls).

Every write stream of a filesystem a call brings (:func:`limit_writes`) takes from one
bucket before it writes: the ``max_bandwidth`` cap of the calls in flight, and the
schedule of a manager's paced save for that save's own writes (lifted when the training
process says ``hurry``). The call a thread runs is in :data:`current_call` (its ``owner``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

from storage.backends.base import FileSystemBase


class Bucket:
    """What holds the worker's writes back: ``take(n)`` returns once ``n`` more bytes
    fit under both limits, or at once when neither is set.

    - ``rate``, the ``max_bandwidth`` cap: a token bucket carrying at most ``burst``
      seconds of unused allowance, so a pause never buys a burst above the cap.
    - ``pace``, a manager's paced save (:meth:`set_pace`, lifted by :meth:`hurry`): a
      schedule, the save's bytes spread evenly from the moment the pace was set to its
      deadline. Writes that fell behind it (the link or the cores were busy) go at full
      speed until they are back on it, so the save does not overrun the deadline by
      every slow stretch; and no write waits past the deadline (bytes beyond those the
      rate was made for, a heartbeat, go at once then).

    The pace holds only the writes of the call it was set for (``owner``, the call's
    id; ``take(n, owner)``): a save the worker runs beside a paced one, another
    manager's or a ``storage.async_save`` elsewhere, goes at full speed (under the cap)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate: float | None = None
        self.pace: float | None = None
        self._clock = clock
        self._caps: list[float] = []  # the cap of each call in flight that has one
        self._changed = threading.Condition()
        self._next = 0.0  # when the cap allows the next byte
        self._paced_to = 0.0  # where the pace's schedule stands: when it allows the next byte
        self._pace_end = 0.0  # the paced save's deadline: no write waits past it
        self._pace_owner: object = None  # the call whose writes the pace holds
        self._burst = 0.05

    def set_pace(self, pace: float, until: float, owner: object = None) -> None:
        """Spread the writes of call ``owner`` at ``pace`` bytes/s, on a schedule
        starting now and ending at ``until`` (this host's ``time.monotonic``)."""
        with self._changed:
            self.pace, self._paced_to, self._pace_end = pace, self._clock(), until
            self._pace_owner = owner
            self._changed.notify_all()  # writes held by an earlier pace: not any more

    def _paced(self, owner: object) -> bool:
        return self.pace is not None and self._pace_owner == owner

    def take(self, n: int, owner: object = None) -> None:
        """Wait until ``n`` more bytes written by call ``owner`` fit under the limits."""
        if self.rate is None and self.pace is None:
            # Nothing limits writes (read without the lock: a limit set meanwhile holds
            # from the next write on): a save of many small items makes ~3 writes each.
            return
        with self._changed:
            if n <= 0 or (self.rate is None and not self._paced(owner)):
                return
            now = self._clock()
            capped = None
            if self.rate is not None:
                self._next = max(self._next, now - self._burst) + n / self.rate
                capped = self._next
            paced = None
            if self.pace is not None and self._pace_owner == owner:
                self._paced_to += n / self.pace
                paced = min(self._paced_to, self._pace_end)
            while True:
                # Re-read each time: a hurry lifts the pace, a call's end lifts its cap.
                if not self._paced(owner):
                    paced = None
                if self.rate is None:
                    capped = None
                until = max((t for t in (capped, paced) if t is not None), default=None)
                if until is None or (left := until - self._clock()) <= 0:
                    return
                self._changed.wait(min(left, 60.0))  # in steps: a wait has a longest timeout

    @contextlib.contextmanager
    def capped(self, cap: float | None) -> Iterator[None]:
        """Hold ``cap`` (bytes/s; ``None``: none) while one call runs: the rate is the
        lowest cap of the calls in flight, so a call with no cap, or a higher one, never
        lifts the cap of another that is still writing."""
        if cap is None:
            yield
            return
        with self._changed:
            self._caps.append(cap)
            self.rate = min(self._caps)
        try:
            yield
        finally:
            with self._changed:
                self._caps.remove(cap)
                self.rate = min(self._caps) if self._caps else None
                self._changed.notify_all()

    def hurry(self, owner: object = None) -> None:
        """Lift the pace: the training process waits for this save now. With ``owner``
        (a paced call that ended), only if the pace is that call's."""
        with self._changed:
            if owner is None or self._pace_owner == owner:
                self.pace = None
            self._changed.notify_all()


bucket = Bucket()


class _Throttled:
    """A write stream of call ``owner`` whose writes wait for the bucket."""

    def __init__(self, stream: IO[bytes], owner: object) -> None:
        self._stream = stream
        self._owner = owner

    def write(self, data: Any) -> int:
        view = memoryview(data)
        bucket.take(view.nbytes, self._owner)
        return self._stream.write(view)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


#: The call the current thread runs (``_child._Server._run``): whose pace its writes take.
current_call = threading.local()


def limit_writes(fs: object) -> None:
    """Make every write stream of this process's copy of ``fs`` (``create_stream`` and
    ``create_stream_in``, each kept as the backend writes it) take from the bucket,
    as writes of the call this thread runs (the streams may be written by its threads)."""
    if not isinstance(fs, FileSystemBase) or "create_stream" in vars(fs):
        return
    create = fs.create_stream
    owner = getattr(current_call, "owner", None)

    @contextlib.contextmanager
    def create_stream(path: str, mode: str, *, sync: bool = False) -> Iterator[IO[bytes]]:
        with create(path, mode, sync=sync) as stream:
            yield stream if "w" not in mode else _Throttled(stream, owner)  # type: ignore[misc]

    create_in = fs.create_stream_in

    @contextlib.contextmanager
    def create_stream_in(
        directory: str, name: str, mode: str = "wb", *, sync: bool = False
    ) -> Iterator[IO[bytes]]:
        with create_in(directory, name, mode, sync=sync) as stream:
            paced = "w" not in mode or isinstance(stream, _Throttled)  # by create_stream
            yield stream if paced else _Throttled(stream, owner)  # type: ignore[misc]

    fs.create_stream = create_stream  # type: ignore[method-assign]
    fs.create_stream_in = create_stream_in  # type: ignore[method-assign]
