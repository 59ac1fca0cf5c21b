"""benchmarks/check.py's judgement, without measuring anything: the recorded ratios it reads
from docs/benchmarks.md and the verdicts it gives a run's ratios."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from benchmarks import check, check_wide

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


# --- the wide parts: what they parse from the benchmarks that own their protocols --------


def test_the_wide_measures_have_rows_and_goals_in_the_docs() -> None:
    """Guards the --wide rows of the one recorded table: each earlier goal is there."""
    recorded = check.read_recorded()
    assert {m.key for m in check_wide.MEASURES} <= set(recorded)
    assert recorded["replicated.vs_stock"].goal == 6.8
    assert recorded["gcs.load_vs_ceiling"].goal == 0.8
    assert recorded["incremental.bytes_vs_changed"].ratio == 1.002
    assert recorded["node_loss.peer_vs_bucket"].goal == 13.0
    assert {m.part for m in check_wide.MEASURES} == set(check_wide.PARTS)
    assert set(check_wide.SIZES) == set(check_wide.QUICK) == set(check_wide.PARTS)


def test_raw_line_takes_the_last_line_of_its_own_prefix() -> None:
    out = 'raw: [1]\nraw samples: {"a": 2}\ntext\nraw: [3]\n'
    assert check_wide.raw_line(out, "raw:") == [3]
    assert check_wide.raw_line(out, "raw samples:") == {"a": 2}
    with pytest.raises(ValueError, match="raw sizes:"):
        check_wide.raw_line(out, "raw sizes:")


def test_a_part_whose_peer_is_not_installed_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(check_wide.NEEDS, "gcs", ("no_such_module_here",))
    assert "no_such_module_here is not installed" in str(check_wide.missing("gcs"))
    assert check_wide.missing("small") is None  # nothing beyond the project itself


def _keys(figures: list[check.Figure], part: str) -> None:
    assert [f.key for f in figures] == [m.key for m in check_wide.MEASURES if m.part == part]


def test_replicated_figures_from_what_replicated_load_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The check parses replicated_load.py's own report: its raw lines carry the medians'
    samples and the stored bytes."""
    from benchmarks import replicated_load

    results = {
        "ours": [{"s": 1.5, "fetched": 134e6}, {"s": 1.7, "fetched": 134e6}],
        "ours, read_once=False": [{"s": 10.8, "fetched": 1072e6}] * 2,
        "stock fsspec": [{"s": 12.0, "fetched": 1206e6}, {"s": 12.8, "fetched": 1206e6}],
        "s3torchconnector": [{"s": 11.2, "fetched": 1072e6}] * 2,
    }
    args = argparse.Namespace(ranks=8, rate=100e6, latency=0.005, repeat=2)
    replicated_load.report(args, results, 134_000_000, 134_000_000, 1.0)
    out = capsys.readouterr().out
    figures = check_wide.replicated_figures(
        check_wide.raw_line(out, "raw samples:"), check_wide.raw_line(out, "raw sizes:")
    )
    _keys(figures, "replicated")
    by_key = {f.key: f for f in figures}
    assert by_key["replicated.vs_stock"].ratio == pytest.approx(12.4 / 1.6)
    assert by_key["replicated.vs_s3tc"].ratio == pytest.approx(11.2 / 1.6)
    assert by_key["replicated.vs_stock"].over_limit == pytest.approx(1.6 / 1.34)
    assert by_key["replicated.fetched_vs_stored"].ratio == pytest.approx(1.0)


def test_node_loss_figures_from_what_node_loss_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """The slowest rank of each round, medians over rounds: the bucket's over the peer's."""
    from benchmarks import node_loss

    def rank(i: int, peer: list[float], bucket: list[float]) -> dict[str, Any]:
        rounds = [
            {"intact": 0.25, "peer": p, "bucket": b, "sent": 256e6, "peer_tier": "local"}
            | {"bucket_tier": "root"}
            for p, b in zip(peer, bucket)
        ]
        return {"rank": i, "own": 256e6, "save": 0.9, "durable": 11.0, "raw": 0.1, "rounds": rounds}

    results = [
        rank(0, [0.5, 0.6, 0.4], [10.0, 10.4, 10.2]),
        rank(1, [0.7, 0.5, 0.5], [10.3, 10.1, 10.6]),
    ]
    results += [rank(2, [0.1] * 3, [1.0] * 3), rank(3, [0.1] * 3, [1.0] * 3)]
    node_loss.report(argparse.Namespace(size_mb=1024, rounds=3, rate=100e6, latency=0.005), results)
    figures = check_wide.node_loss_figures(
        check_wide.raw_line(capsys.readouterr().out, "raw:"), 100e6
    )
    _keys(figures, "node_loss")
    # slowest per round: peer 0.7, 0.6, 0.5 -> 0.6; bucket 10.3, 10.4, 10.6 -> 10.4
    assert figures[0].ratio == pytest.approx(10.4 / 0.6)
    assert figures[0].over_limit == pytest.approx(0.6 / (0.1 + 0.25))


def test_safetensors_figures_from_what_safetensors_load_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from benchmarks import safetensors_load

    samples = {
        "ours": {"wall": [2.0], "cpu": [0.7]},
        "runai-model-streamer": {"wall": [9.6], "cpu": [7.0]},
        "download + load_file": {
            "wall": [5.6],
            "cpu": [4.6],
            "download": [5.1],
            "load_file": [0.5],
        },
        "raw GET ceiling": {"wall": [2.5], "cpu": [1.3]},
    }
    args = argparse.Namespace(max_shard_size_mb=256, repeat=1)
    safetensors_load.report(samples, 1_000_000_000, 4, args, None)
    parsed = check_wide.raw_line(capsys.readouterr().out, "raw samples:")
    figures = check_wide.safetensors_figures(parsed, 1_000_000_000)
    _keys(figures, "safetensors")
    assert figures[0].ratio == pytest.approx(9.6 / 2.0)
    assert figures[1].ratio == pytest.approx(0.1)
    assert figures[1].ours == "0.70 s/GB"


def test_incremental_figures_judge_the_worst_incremental_step_not_the_full_one() -> None:
    """Step 1 is a full save (its bytes are the whole state): only steps 2-5 are judged,
    each by the medians over runs."""

    def run(full_s: float, seconds: list[float]) -> dict[str, Any]:
        written = [1124e6, 50.44e6, 50.44e6, 51.0e6, 50.44e6]
        rows = [
            (i + 1, s, w, 50.37e6, 0.05, 0.04) for i, (s, w) in enumerate(zip(seconds, written))
        ]
        return {"full_s": full_s, "rows": rows, "steps": [1, 4, 5], "logical": 1e9}

    runs = [run(1.8, [2.8, 0.19, 0.18, 0.12, 0.25]), run(1.7, [2.7, 0.18, 0.17, 0.11, 0.30])]
    runs.append(run(1.9, [2.9, 0.20, 0.16, 0.13, 0.20]))
    figures = check_wide.incremental_figures(runs)
    _keys(figures, "incremental")
    assert figures[0].ratio == pytest.approx(51.0 / 50.37)  # step 4's bytes, not step 1's
    assert figures[0].ours.endswith("(step 4)")
    assert figures[1].ratio == pytest.approx(0.25 / 1.8)  # step 5's median time
    assert figures[1].over_limit == pytest.approx(0.25 / 0.09)  # changed items + fingerprint
    assert figures[1].ours.endswith("(step 5)")


def test_gcs_and_small_figures() -> None:
    samples = {
        "ours": {
            "save": [0.8, 0.9, 1.0],
            "load": [0.09] * 3,
            "save_cpu": [0.2] * 3,
            "load_cpu": [0.1] * 3,
        },
        "stock fsspec": {
            "save": [1.8] * 3,
            "load": [0.6] * 3,
            "save_cpu": [0.3] * 3,
            "load_cpu": [0.7] * 3,
        },
        "raw ceiling": {
            "save": [0.75] * 3,
            "load": [0.06] * 3,
            "save_cpu": [0.05] * 3,
            "load_cpu": [0.05] * 3,
        },
    }
    figures = check_wide.gcs_figures(samples, 268_000_000)
    _keys(figures, "gcs")
    by_key = {f.key: f for f in figures}
    assert by_key["gcs.save_vs_stock"].ratio == pytest.approx(1.8 / 0.9)
    assert by_key["gcs.load_vs_stock"].over_limit == pytest.approx(0.09 / 0.06)
    assert by_key["gcs.load_cpu_vs_stock"].ratio == pytest.approx(1 / 7)
    assert by_key["gcs.load_vs_ceiling"].ratio == pytest.approx(0.06 / 0.09)
    times = {("stock", "save"): [4.3, 4.5, 4.1], ("ours", "save"): [2.8, 3.0, 2.6]}
    times |= {("stock", "load"): [5.0] * 3, ("ours", "load"): [2.0, 2.5, 2.2]}
    small = check_wide.small_figures(times)
    _keys(small, "small")
    assert [f.ratio for f in small] == pytest.approx([4.3 / 2.8, 5.0 / 2.2])


def test_a_run_of_some_parts_reports_only_those(capsys: pytest.CaptureFixture[str]) -> None:
    """Parts not run are not reported missing: the table holds the figures measured."""
    figures = [
        check.Figure("small.save", "2.8 s", "4.3 s", 1.54),
        check.Figure("small.load", "2 s", "5 s", 2.5),
    ]
    assert check.table(figures, check.read_recorded()) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(rows) == 3  # the header and the two measured rows
