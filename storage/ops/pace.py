"""A manager's paced uploads: each save's upload to the durable root, when the persist
worker writes it, spread over ``pace`` of the time since the previous save began
instead of taking the cores and the link in one burst (docs/operations.md, "Paced
uploads"). For a manager without a local tier the upload is the asynchronous save
itself; for a tiered one, each step's drain.

:class:`UploadPace` sets the deadline when a save begins (``persist.pace_next``, for
that step's root URL only); the worker turns it into a schedule for that upload's bytes
when its call goes out (``Worker.call(pace_bytes=...)``). Whoever waits for the upload
lifts the pace (``persist.hurry``).

A pace only helps where an upload is short beside the interval. Where the caller says
how long the previous upload took (:meth:`UploadPace.ended`) and it took the whole new
window at full speed, or overran the window it was paced to by over a tenth, the link
or the cores are the limit: the next upload goes at full speed. A schedule then spreads
nothing, and beside a busy trainer a paced upload ended later than a full-speed one,
so that the next save waited for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from storage.checkpoint import persist

#: The longest a paced upload is spread over, seconds (a rare checkpoint stays durable soon).
MAX_PACED_SECONDS = 60.0
#: A paced upload that took longer than its window by this factor overran it.
OVERRUN = 1.1


class UploadPace:
    """The pace of one manager's uploads: ``share`` of the interval between saves, or
    ``None`` (full speed). :meth:`ended` tells it how long an upload took, where the
    caller knows (see the module docstring)."""

    def __init__(self, share: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.share = share
        self._clock = clock
        self._last: float | None = None  # when the previous paced kind of save began
        self._window: float | None = None  # the window the latest upload was paced to
        self._took: float | None = None  # how long the previous upload took, if told

    def begin(self, url: str, *, in_worker: bool) -> float:
        """A save whose upload goes to ``url`` begins now: give that upload (and no
        other) ``share`` of the time since the previous one began, at most
        :data:`MAX_PACED_SECONDS`. The first save, an upload after one that the link
        or the cores limited, and uploads not written by the persist worker
        (``in_worker`` false: threads of this process) go at full speed. Returns when
        it began (what :meth:`ended` takes)."""
        now = self._clock()
        last, self._last = self._last, now
        window, self._window = self._window, None
        took, self._took = self._took, None
        if self.share is None or last is None or not in_worker:
            return now
        new = min(self.share * (now - last), MAX_PACED_SECONDS)
        if took is not None and (took > OVERRUN * window if window else took >= new):
            return now  # the previous upload filled its window, or overran it
        self._window = new
        persist.pace_next(now + new, url)
        return now

    def ended(self, began: float) -> None:
        """The upload of the save that began at ``began`` (:meth:`begin`'s return) is done."""
        if began == self._last:  # not an older save's
            self._took = self._clock() - began
