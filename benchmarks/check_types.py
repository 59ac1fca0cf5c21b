"""What benchmarks/check.py and benchmarks/check_wide.py share: a measure and one
measured figure of it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Measure:
    key: str
    part: str
    higher_is_better: bool


@dataclass(frozen=True)
class Figure:
    """One measured ratio: ours and the peer as printed, the ratio, and the limit."""

    key: str
    ours: str
    peer: str
    ratio: float | None
    limit: str = ""
    over_limit: float | None = None  # ours over the limit's time, where the limit is a time
