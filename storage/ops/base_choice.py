"""The one rule for the base of an incremental save, for the root and a local tier alike.

A save of step ``N`` with ``incremental=True`` references the newest committed step
below ``N``, unless that step cannot serve as a base (its ``problem``: a symbolic link,
unreadable metadata, a missing data file, nodes holding different saves of it) or
``full_every=K`` asks for a full save: one whose chain would reach ``K`` (the base's
chain plus one), so every K-th save is a full one. A save is a full one too when
nothing below ``N`` is committed, or ``incremental`` is off.

A pure function of what the tier knows: its committed steps and, for the one candidate,
its :class:`Candidate` facts. Both are asked for only when needed (nothing when
``incremental`` is off, so a full save lists nothing; a local tier gathers them
collectively, and every rank asks or none does, as every rank decides alike).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable


@dataclasses.dataclass(frozen=True)
class Candidate:
    """What a tier knows of the step a save would reference: why it cannot be a base
    (``None``: it can), and its chain (``CommittedCheckpoint.chain``: 0 for a full save,
    else its base's chain plus one)."""

    problem: str | None = None
    chain: int = 0


@dataclasses.dataclass(frozen=True)
class BaseChoice:
    """The base chosen (``None``: a full save) and, when a candidate was refused for a
    problem, the line that says why (the tier logs it)."""

    base: int | None
    note: str | None = None


def choose_base(
    step: int,
    committed: Callable[[], Iterable[int]],
    facts: Callable[[int], Candidate],
    *,
    incremental: bool,
    full_every: int | None,
) -> BaseChoice:
    """The base of an incremental save of ``step`` (see the module docstring)."""
    if not incremental:
        return BaseChoice(None)
    below = [s for s in committed() if s < step]
    if not below:
        return BaseChoice(None)
    candidate = max(below)
    known = facts(candidate)
    if known.problem is not None:
        return BaseChoice(
            None, f"step {step} is saved in full: step {candidate} is no base ({known.problem})"
        )
    if full_every is not None and known.chain + 1 >= full_every:
        return BaseChoice(None)
    return BaseChoice(candidate)
