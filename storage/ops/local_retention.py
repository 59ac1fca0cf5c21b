"""``keep_local``: what a node's local tier deletes, and when (:class:`LocalRetention`);
the deleting itself is :class:`~storage.ops.retention.Retention`'s, on the tier's root."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from extensions.errors import CheckpointInUseError
from storage.checkpoint.layout import parse_step
from storage.ops.retention import Retention
from storage.ops.steps import StepRoot

tier_log = logging.getLogger("storage.ops.tiers")  # one logger for everything tiers say


class LocalRetention:
    """``keep_local``: which committed steps a node's local tier deletes, and when.

    Only the node's leader (``leader``) deletes. A local step goes only once durable
    (``durable(step)``: the root holds its copy, read back once: ``Drains.durable``),
    never while it waits for its drain (``pending()``), is being written or is the base
    of the save in flight (``local.in_flight``), never while a step kept here
    references it, and never through a symbolic link (linked steps are someone else's:
    not counted either). ``lock`` is held by a save from choosing its base until it
    marks it in flight, so no pruning runs in between.

    The leader also removes what killed saves left in the tier (:meth:`Retention.cleanup`
    with a grace of :data:`LEFTOVER_GRACE`, at most every :data:`SWEEP_EVERY` seconds,
    from :meth:`prune`): nothing else looks at a local tier, and a save killed after its
    data files were written left a copy of its state there (on tmpfs, memory) for good."""

    #: Seconds after which the leftovers of a killed save in the local tier are removed.
    LEFTOVER_GRACE = 3600.0
    #: Seconds between two sweeps of the local tier's leftovers.
    SWEEP_EVERY = 600.0

    def __init__(
        self,
        local: StepRoot,
        keep_local: int | None,
        *,
        leader: bool,
        durable: Callable[[int], bool],
        pending: Callable[[], set[int]],
    ) -> None:
        self.local = local
        self.keep_local = keep_local
        self.leader = leader
        self.durable = durable
        self.pending = pending
        self.deleting = Retention(local, coordinator=leader)  # deletes, prunes nothing itself
        self.lock = threading.Lock()
        self.swept: float | None = None  # time.monotonic() of the last sweep

    def references(self, step: int) -> set[int]:
        """The local steps whose bytes local ``step`` references (incremental saves), as
        far as its metadata can be read (deleting a local step is refused while one
        beside it cannot be read: ``siblings.Siblings``)."""
        names = self.local.model(step).references()
        return {b for b in map(parse_step, names) if b is not None}

    def restorable(self, exclude: int) -> list[int]:
        """The committed local steps besides ``exclude`` that count against
        ``keep_local``: not linked, and not a durable step kept only because a step
        here references it."""
        linked = set(self.local.linked_steps())
        steps = [s for s in self.local.steps() if s != exclude and s not in linked]
        based = {b for s in steps for b in self.references(s)}
        return [s for s in steps if s not in based or not self.durable_quietly(s)]

    def durable_quietly(self, step: int) -> bool:
        try:
            return self.durable(step)
        except Exception:  # the root cannot say: not durable as far as we know
            return False

    def prune(self, exclude: int | None = None) -> None:
        """Delete the oldest local steps beyond ``keep_local`` that may go (see the
        class), besides ``exclude``, then sweep leftovers when due (see the class).
        Leaders only; never raises: a step that cannot be deleted is logged and kept."""
        if not self.leader:
            return
        self._sweep_when_due()
        if self.keep_local is None:
            return
        with self.lock:
            try:
                for s in self._doomed(exclude):
                    try:
                        self.deleting.delete(s)
                    except CheckpointInUseError as exc:
                        tier_log.info("local step %d kept: %s", s, exc)
                    except Exception as exc:  # the next one may still go
                        tier_log.warning("local step %d could not be deleted: %s", s, exc)
            except Exception as exc:
                tier_log.warning("local retention under %s failed: %s", self.local.url, exc)

    def _sweep_when_due(self) -> None:
        now = time.monotonic()
        if self.swept is not None and now - self.swept < self.SWEEP_EVERY:
            return
        self.swept = now
        with self.lock:
            try:
                removed = self.deleting.cleanup(self.LEFTOVER_GRACE)
            except Exception as exc:
                tier_log.warning("sweeping %s for killed saves failed: %s", self.local.url, exc)
            else:
                if removed:
                    tier_log.info(
                        "removed what killed saves left in %s: steps %s", self.local.url, removed
                    )

    def _doomed(self, exclude: int | None) -> list[int]:
        """What :meth:`prune` deletes, newest first (a step before the bases it uses)."""
        assert self.keep_local is not None
        in_flight = self.local.in_flight
        busy = in_flight.held() | ({exclude} if exclude is not None else set())
        skip = {in_flight.step, exclude} | set(self.local.linked_steps())
        ordered = [s for s in self.local.steps() if s not in skip]
        keep = set(ordered[-self.keep_local :]) | busy | self.pending()
        for s in ordered:
            if s not in keep and not self.durable(s):
                tier_log.info("local step %d is not durable yet: kept", s)
                keep.add(s)
        frontier = sorted(keep)
        while frontier:  # bases of bases: references are one hop, but be sure
            for b in self.references(frontier.pop()):
                if b not in keep:
                    keep.add(b)
                    frontier.append(b)
        return [s for s in reversed(ordered) if s not in keep]
