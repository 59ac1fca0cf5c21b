"""benchmarks/check.py's judgement, without measuring anything: the recorded ratios it reads
from docs/benchmarks.md and the verdicts it gives a run's ratios."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import check

HIGHER = check.Measure("local.load", "local", True)
LOWER = check.Measure("s3.save_cpu_vs_s3tc", "s3", False)


def test_the_docs_record_every_measure_the_check_takes() -> None:
    """Guards the one place the recorded ratios live: every measure check.py takes has a
    row in docs/benchmarks.md's table, every row is a measure it takes, and each goal's
    comparator agrees with which way the measure improves."""
    recorded = check.read_recorded()
    assert set(recorded) == {m.key for m in check.MEASURES}
    assert recorded["local.load"].goal == 1.5
    assert recorded["s3.save_cpu_vs_s3tc"].goal == 0.8
    assert recorded["local.save"].goal is None


def _docs(tmp_path: Path, row: str) -> str:
    rows = [f"| `{m.key}` | m | 1.00x | - | run |" for m in check.MEASURES if m.key != "local.load"]
    head = [check.BEGIN + " -->", "| key | measure | recorded | goal | from |", "|---" * 5 + "|"]
    text = "\n".join(head + rows + [row, check.END])
    path = tmp_path / "benchmarks.md"
    path.write_text(text)
    return str(path)


def test_a_goal_pointing_the_wrong_way_is_refused(tmp_path: Path) -> None:
    """A load ratio (higher is better) with an upper-bound goal would pass every slip."""
    with pytest.raises(SystemExit, match=r"local.load: its goal must read '>= N'"):
        check.read_recorded(_docs(tmp_path, "| `local.load` | load | 1.52x | <= 1.50x | run |"))


def test_a_measure_without_a_row_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"no row for \['local.load'\]"):
        check.read_recorded(_docs(tmp_path, "| `local.unknown` | x | 1.00x | - | run |"))


@pytest.mark.parametrize(
    ("measure", "recorded", "goal", "ratio", "severity"),
    [
        (HIGHER, 1.52, 1.5, 1.55, 0),  # met
        (HIGHER, 1.52, 1.5, 1.40, 2),  # within 10% of the record, but under the goal it met
        (HIGHER, 1.52, None, 1.30, 2),  # more than 10% under the record
        (HIGHER, 2.10, 2.5, 2.05, 1),  # under a goal the record misses too: known
        (HIGHER, 2.10, 2.5, 1.80, 2),  # ... and fell more than 10%: slipped
        (LOWER, 0.60, 0.8, 0.65, 0),  # CPU: within 10% and under the goal
        (LOWER, 0.60, 0.8, 0.70, 2),  # CPU more than 10% above the record
        (LOWER, 0.60, 0.8, 0.85, 2),  # CPU above the goal
        (LOWER, 0.75, 0.33, 0.70, 1),  # a goal not met as recorded, no worse
        (HIGHER, 1.52, 1.5, None, 0),  # nothing to judge (a peer's slowdown <= 0)
    ],
)
def test_verdicts(
    measure: check.Measure, recorded: float, goal: float | None, ratio: float | None, severity: int
) -> None:
    rec = check.Recorded("m", recorded, goal, "run")
    assert check.verdict(measure, rec, ratio)[1] == severity


@pytest.mark.parametrize(
    ("recorded", "goal", "ratio", "over_limit", "severity"),
    [
        (4.26, None, 1.50, 1.16, 0),  # ours at its limit: the peer ran faster than recorded
        (4.26, None, 1.50, 1.60, 2),  # ours off its limit: a slip
        (4.26, None, 1.50, None, 2),  # no limit to judge by: a slip
        (3.83, 3.5, 3.20, 1.10, 2),  # at the limit, but under a goal the record met
        (1.52, 1.5, 1.55, 1.60, 0),  # within the record: the limit does not matter
    ],
)
def test_a_ratio_that_fell_with_ours_at_the_limit_is_the_peers_speed_up(
    recorded: float, goal: float | None, ratio: float, over_limit: float | None, severity: int
) -> None:
    rec = check.Recorded("m", recorded, goal, "run")
    assert check.verdict(HIGHER, rec, ratio, over_limit)[1] == severity
