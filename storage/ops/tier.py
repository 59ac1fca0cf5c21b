"""``Tier``: what a :class:`~storage.ops.manager.CheckpointManager` asks of where its
saves go, the one protocol its two tiers implement: ``RootTier`` (saves straight to the
durable root) and ``LocalTier`` (a fast local tier that drains to the root). The manager
holds one of them and calls nothing else for its saves, loads, listings and waits.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Protocol

from storage.checkpoint.deadline import DeadlineExceededError, distributed_rank, rank_error
from storage.checkpoint.layout import StepInfo
from storage.ops.steps import StepRoot


class Tier(Protocol):
    """Where a manager's saves land and its loads read from."""

    @property
    def saves_to(self) -> StepRoot:
        """The steps a save writes: the root, or the local tier."""
        ...

    def steps(self) -> list[int]:
        """Committed steps in any tier, ascending."""
        ...

    def durable_steps(self) -> list[int]:
        """Steps committed under the root (the durable tier), ascending."""
        ...

    def entries(self) -> list[StepInfo]:
        """Every ``step-<N>`` directory with the tiers holding a committed copy."""
        ...

    def save(
        self, step: int, state_dict: dict[str, Any], *, blocking: bool
    ) -> concurrent.futures.Future[None] | None:
        """Save and commit ``step`` (``blocking=False``: staged, then a future); the
        previous save in flight is waited for first. See
        :meth:`CheckpointManager.save`."""
        ...

    def load(self, state_dict: dict[str, Any], step: int | None) -> int:
        """Load ``step`` (default: the newest committed) in place once this tier's save
        in flight is done; returns the step loaded."""
        ...

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the work in flight: the asynchronous save, and a local tier's
        drains (raising a failed drain's error); at most ``timeout`` seconds, then
        raise :func:`overdue`'s error (the work goes on)."""
        ...


def overdue(timeout: float, step: int | None, url: str, fate: str) -> DeadlineExceededError:
    """The error of a :meth:`Tier.wait` whose ``timeout`` ended before ``step`` (at
    ``url``; ``None``: work on no step in particular) was done; ``fate`` says what
    becomes of it."""
    rank = distributed_rank()
    who = f"rank {rank}" if rank is not None else "this process"
    what = "the work in flight" if step is None else f"step {step}"
    return rank_error(
        DeadlineExceededError,
        f"{who}: waited {timeout:g} s (wait(timeout=)) and {what} is not done at {url}; {fate}",
        rank=rank,
        item=what,
        url=url,
    )
