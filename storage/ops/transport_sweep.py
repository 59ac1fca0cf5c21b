"""What sends killed before their commit leave in a replica's directory, removed by a
later send of the same transport: nothing else looks there (retention keeps uncommitted
steps, ``forget_sent`` deletes committed ones only).

:class:`Sweeper` runs after a committed send, apart from it (its caller waits with a
timeout, and a store slow to answer the sweep would fail a committed send), at most
every :data:`EVERY` seconds: ``cleanup`` removes the files of interrupted steps older
than :data:`GRACE` with no live heartbeat, and their open uploads (S3's multipart:
billed, and in no listing) are aborted by the same rule."""

from __future__ import annotations

import concurrent.futures
import logging
import time

from storage.ops.manager import CheckpointManager

log = logging.getLogger("storage.ops.transport")

#: Seconds after which what a killed send left is removed.
GRACE = 3600.0
#: The fewest seconds between two sweeps of one transport.
EVERY = 600.0


class Sweeper:
    """The sweeps of one replica's directory (``manager``'s root)."""

    def __init__(self, manager: CheckpointManager) -> None:
        self._manager = manager
        self._swept: float | None = None  # time.monotonic() of the last sweep

    def after(self, sent: concurrent.futures.Future[None]) -> None:
        """Sweep when due, once ``sent`` (a send, done before this runs) committed; a
        failed sweep is logged, never raised: the send is committed."""
        if sent.cancelled() or sent.exception() is not None:
            return
        now = time.monotonic()
        if self._swept is not None and now - self._swept < EVERY:
            return
        self._swept = now
        manager = self._manager
        try:
            if removed := manager.cleanup(GRACE):
                log.info("removed killed sends in %s: %s", manager.url, removed)
            for upload in manager.stale_uploads(GRACE, abort=True):
                log.info("aborted the upload a killed send left: %s", manager.fs.url(upload.path))
        except Exception as exc:
            log.warning("sweeping %s for killed sends failed: %s", manager.url, exc)
