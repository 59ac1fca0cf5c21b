"""Room for a save in a node's local tier (:func:`make_room`): ``keep_local`` bounds the
committed steps a tier holds besides the one being written, and a save waits for a
drain only where some node's tier is over that bound."""

from __future__ import annotations

import logging

from extensions.errors import TierFullError
from storage.checkpoint import persist
from storage.ops._peers import Group
from storage.ops.drain import Drains
from storage.ops.local_retention import LocalRetention
from storage.ops.steps import StepRoot

log = logging.getLogger("storage.ops.tiers")  # one logger for everything tiers say


def make_room(
    group: Group, retention: LocalRetention, drains: Drains, root: StepRoot, step: int
) -> None:
    """Keep at most ``keep_local`` committed steps besides the one being written: the
    oldest go once durable. While some node's tier is over that bound (its drain is
    behind or failing), queue a drain pass and wait for it (the one case where a
    save waits for a drain), then raise :class:`TierFullError` if the tier is still
    over. It waits for the oldest steps' drains only (those beyond ``keep_local``), not
    for the steps queued after them. Collective: every rank takes the same path."""
    keep_local = retention.keep_local
    if keep_local is None:
        return
    retention.prune(exclude=step)
    held = _fullest(group, retention, step)
    if held is None:
        return
    log.warning(
        "local tier %s holds more than keep_local=%d steps not yet durable; "
        "draining before saving step %d",
        retention.local.url,
        keep_local,
        step,
    )
    drains.schedule()
    persist.hurry()  # this save waits for the drain: no pace holds it back
    drains.wait_durable(set(held[: len(held) - keep_local]))  # the oldest
    retention.prune(exclude=step)
    held = _fullest(group, retention, step)
    if held is None:
        return
    failed = drains.take_error()  # reported here, as the cause
    kept = [s for s in held if retention.durable_quietly(s)]
    waiting = [s for s in held if s not in kept]
    why = " and ".join(
        ([f"steps {waiting} are not durable yet"] if waiting else [])
        + ([f"steps {kept} are durable but could not be deleted (see the log)"] if kept else [])
    )
    raise TierFullError(
        f"the local tier {retention.local.url} holds steps {held}, more than "
        f"keep_local={keep_local}: {why} (last drain error: "
        f"{drains.last_error or 'none'}); nothing was deleted. Fix the root "
        f"{root.url} and save again, or delete_local() what you can lose"
    ) from failed


def _fullest(group: Group, retention: LocalRetention, step: int) -> list[int] | None:
    """The committed local steps besides ``step`` of the fullest node's tier, if it
    holds more than ``keep_local`` (collective; node leaders report, after pruning).
    A durable step kept only because a step there references it does not count."""
    mine = retention.restorable(exclude=step) if group.leader else []
    fullest: list[int] = max(group.all_gather(mine), key=len)
    keep_local = retention.keep_local
    return fullest if keep_local is not None and len(fullest) > keep_local else None
