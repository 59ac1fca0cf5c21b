"""``Tier``: what a :class:`~storage.ops.manager.CheckpointManager` asks of where its
saves go, the one protocol its two tiers implement: ``RootTier`` (saves straight to the
durable root) and ``LocalTier`` (a fast local tier that drains to the root). The manager
holds one of them and calls nothing else for its saves, loads, listings and waits.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Protocol

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

    def wait(self) -> None:
        """Wait for the work in flight: the asynchronous save, and a local tier's
        drains (raising a failed drain's error)."""
        ...
