"""A manager's paced uploads: each save's upload to the durable root, when the persist
worker writes it, spread over ``pace`` of the time since the previous save began
instead of taking the cores and the link in one burst (docs/operations.md, "Paced
uploads"). For a manager without a local tier the upload is the asynchronous save
itself; for a tiered one, each step's drain.

:class:`UploadPace` sets the deadline when a save begins (``persist.pace_next``, for
that step's root URL only); the worker turns it into a schedule for that upload's bytes
when its call goes out (``Worker.call(pace_bytes=...)``). Whoever waits for the upload
lifts the pace (``persist.hurry``).
"""

from __future__ import annotations

import time

from storage.checkpoint import persist

#: The longest a paced upload is spread over, seconds (a rare checkpoint stays durable soon).
MAX_PACED_SECONDS = 60.0


class UploadPace:
    """The pace of one manager's uploads: ``share`` of the interval between saves, or
    ``None`` (full speed)."""

    def __init__(self, share: float | None) -> None:
        self.share = share
        self._last: float | None = None  # when the previous paced kind of save began

    def begin(self, url: str, *, in_worker: bool) -> None:
        """A save whose upload goes to ``url`` begins now: give that upload (and no
        other) ``share`` of the time since the previous one began, at most
        :data:`MAX_PACED_SECONDS`. The first save, and uploads not written by the
        persist worker (``in_worker`` false: threads of this process), go at full speed."""
        now = time.monotonic()
        last, self._last = self._last, now
        if self.share is None or last is None or not in_worker:
            return
        persist.pace_next(now + min(self.share * (now - last), MAX_PACED_SECONDS), url)
