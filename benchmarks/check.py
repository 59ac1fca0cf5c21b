"""Every headline ratio in one run, against its goal and its record in docs/benchmarks.md.

    python benchmarks/check.py                  # every part: ~10 min on a quiet 2-core VM
    python benchmarks/check.py --only local     # or s3, loop, codec; repeat --only for several
    python benchmarks/check.py --quick          # smoke run: small sizes, seconds to a minute each
    python benchmarks/check.py --plots docs/img # also draw the pictures docs/benchmarks.md shows
    python benchmarks/check.py --wide           # also the earlier goals' parts: ~7-9 min more
    python benchmarks/check.py --only gcs       # one of them (gcs, small, replicated,
                                                # safetensors, incremental, node_loss)

Four parts by default, each driven by the benchmark that owns its protocol (nothing is
re-implemented here):

- ``local``: ``benchmarks/restart.py`` (every save and load in a fresh process; a load's
  target allocated and touched in that process before the clock; stock
  ``FileSystemWriter``/``FileSystemReader`` beside ours), no transform and zstd;
- ``s3``: ``benchmarks/s3_peers.py`` on one SeaweedFS on loopback: ours, stock fsspec and
  s3torchconnector; saves in this process, loads in fresh ones; client CPU per GB;
- ``loop``: ``benchmarks/training_loop.py`` on the capped bucket (100 MB/s, 5 ms per
  request), one rank, a checkpoint every 10 steps: ours async, ours tiered (a local tier
  drained to the bucket), stock async, s3torchconnector async, each ``--loop-rounds``
  times (2) against its round's run without checkpoints, medians over rounds; and the
  staging floor, once;
- ``codec``: ``benchmarks/compression.py``: ``WeightCodec`` against ZipNN, one core each,
  on an initialised bf16 layer and AdamW's fp32 second moment; the worse tensor's ratio
  of each kind (stored size, compression and decompression speed).

``--wide`` adds the side-by-side runs of earlier goals (GCS, many small tensors,
replicated loads, safetensors, incremental checkpoints, node loss): see
``benchmarks/check_wide.py``. A part whose peer is not installed says so and is skipped.

The recorded ratios and goals live in ONE place, the table between the ``recorded ratios``
markers of docs/benchmarks.md; this script reads it, and refuses to run if a measure here
has no row there (or the other way round). Every ratio keeps the docs' notation: times as
the peer's over ours (> 1: ours faster), CPU and slowdowns and stalls as ours over the
peer's (< 1: ours cheaper). A verdict fails when a ratio misses its goal, or is more than
10% worse than the recorded one. Exit status: 0 when every verdict passes; 1 when the only
failures are goals the recorded ratio misses too (known, not a slip); 2 when something
slipped. With ``--quick`` the sizes are not the recorded runs' sizes: the verdicts are
printed but do not set the exit status.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import check_wide  # noqa: E402
from benchmarks.check_types import Figure, Measure  # noqa: E402

DOCS = os.path.join(ROOT, "docs", "benchmarks.md")
BEGIN = "<!-- recorded ratios: begin"
END = "<!-- recorded ratios: end -->"
TOLERANCE = 0.10  # how much worse than the recorded ratio a run may read before it fails
# A time within this factor of its physical limit (plain write+fsync, readinto, the raw
# S3 ceiling) cannot have slipped: a ratio below the record then means the peer ran
# faster than in the recorded run, not that ours got slower.
AT_LIMIT = 1.25
PARTS = ("local", "s3", "loop", "codec")
BUCKET = "bench"  # the bucket both s3_peers.py and training_loop.py use


MEASURES = [
    Measure("local.save", "local", True),
    Measure("local.load", "local", True),
    Measure("local.overwrite", "local", True),
    Measure("local.zstd_save", "local", True),
    Measure("local.zstd_load", "local", True),
    Measure("local.zstd_overwrite", "local", True),
    Measure("s3.save_vs_s3tc", "s3", True),
    Measure("s3.load_vs_s3tc", "s3", True),
    Measure("s3.save_cpu_vs_s3tc", "s3", False),
    Measure("s3.load_cpu_vs_s3tc", "s3", False),
    Measure("s3.save_vs_fsspec", "s3", True),
    Measure("s3.load_vs_fsspec", "s3", True),
    Measure("s3.save_cpu_vs_fsspec", "s3", False),
    Measure("s3.load_cpu_vs_fsspec", "s3", False),
    Measure("s3.save_vs_ceiling", "s3", True),
    Measure("s3.load_vs_ceiling", "s3", True),
    Measure("loop.slowdown_vs_stock", "loop", False),
    Measure("loop.slowdown_vs_s3tc", "loop", False),
    Measure("loop.stall_median_vs_floor", "loop", False),
    Measure("loop.stall_max_vs_floor", "loop", False),
    Measure("loop.cpu_per_gb_vs_s3tc", "loop", False),
    Measure("loop.tiered_slowdown_vs_stock", "loop", False),
    Measure("loop.tiered_stall_median_vs_floor", "loop", False),
    Measure("codec.ratio_vs_zipnn", "codec", True),
    Measure("codec.compress_vs_zipnn", "codec", True),
    Measure("codec.decompress_vs_zipnn", "codec", True),
    *check_wide.MEASURES,
]


@dataclass(frozen=True)
class Recorded:
    label: str
    ratio: float | None  # None: a measure with no recorded run yet ("-")
    goal: float | None
    source: str


# --- the recorded table -----------------------------------------------------------------


def _number(cell: str) -> float:
    return float(cell.replace("*", "").strip().rstrip("x%"))


def read_recorded(path: str = DOCS) -> dict[str, Recorded]:
    """The rows of the table between the markers of ``path``: key, measure, recorded
    ratio, goal (``>= N`` for a ratio that should be high, ``<= N`` for one that should
    be low, ``-`` for none), and the run it comes from."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{path}: no table between '{BEGIN} ...' and '{END}'")
    direction = {m.key: m.higher_is_better for m in MEASURES}
    rows: dict[str, Recorded] = {}
    for line in text[start:end].splitlines()[1:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or cells[0] in ("key", "") or set(cells[0]) <= set("-:"):
            continue
        key, label, ratio, goal_cell, source = cells
        key = key.strip("`")
        goal = None
        if goal_cell != "-":
            match = re.fullmatch(r"([<>]=)\s*(.+)", goal_cell)
            if not match:
                raise SystemExit(f"{path}: row {key}: goal {goal_cell!r} is not '>= N' or '<= N'")
            if key in direction and (match.group(1) == ">=") != direction[key]:
                want = ">=" if direction[key] else "<="
                raise SystemExit(f"{path}: row {key}: its goal must read '{want} N'")
            goal = _number(match.group(2))
        rows[key] = Recorded(label, None if ratio == "-" else _number(ratio), goal, source)
    missing = [m.key for m in MEASURES if m.key not in rows]
    unknown = [k for k in rows if k not in direction]
    if missing or unknown:
        raise SystemExit(
            f"{path}: the recorded table and benchmarks/check.py disagree: no row for "
            f"{missing or 'none'}; rows check.py does not measure: {unknown or 'none'}"
        )
    return rows


def verdict(
    measure: Measure, recorded: Recorded, ratio: float | None, over_limit: float | None = None
) -> tuple[str, int]:
    """(what to print, severity): 0 passes; 1 misses a goal the recorded ratio misses too;
    2 slipped (more than 10% worse than recorded, or below a goal the record met).

    ``over_limit`` is ours' time over its physical limit's in this run: within
    :data:`AT_LIMIT` of it, a ratio more than 10% under the record is the peer's
    speed-up (stock's local save has read 0.42 s to 1.71 s on this VM), not a slip; a
    goal still judges it."""
    if ratio is None:
        return "n/a", 0

    def worse(a: float, b: float) -> bool:
        return a < b if measure.higher_is_better else a > b

    if recorded.ratio is None:  # nothing recorded yet: only the goal judges
        if recorded.goal is not None and worse(ratio, recorded.goal):
            return "BELOW GOAL", 2
        return "ok (first record)", 0
    floor = recorded.ratio * (1 - TOLERANCE if measure.higher_is_better else 1 + TOLERANCE)
    fell = worse(ratio, floor)
    if fell and (over_limit is None or over_limit > AT_LIMIT):
        return f"FELL: >{TOLERANCE:.0%} worse than recorded", 2
    if recorded.goal is not None and worse(ratio, recorded.goal):
        if worse(recorded.ratio, recorded.goal):
            return "below goal (as recorded)", 1
        return "BELOW GOAL", 2
    if fell:
        return f"ok: ours at {over_limit:.2f}x the limit (the peer ran faster than recorded)", 0
    best = recorded.ratio * (1 + TOLERANCE if measure.higher_is_better else 1 - TOLERANCE)
    return ("ok, better than recorded" if worse(best, ratio) else "ok"), 0


# --- the parts -----------------------------------------------------------------------------


def run_local(size_mb: float, repeat: int, work_dir: str | None) -> tuple[list[Figure], str]:
    from benchmarks import restart

    work = tempfile.mkdtemp(prefix="dcp-check-local-", dir=work_dir)
    try:
        rows = {
            (r["case"], r["op"]): r
            for case in ("none", "zstd")
            for r in restart.run_case(case, work, size_mb, repeat, restart.THREADS)
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    keys = {
        ("none", "save"): "local.save",
        ("none", "load"): "local.load",
        ("none", "save-over"): "local.overwrite",
        ("zstd", "save"): "local.zstd_save",
        ("zstd", "load"): "local.zstd_load",
        ("zstd", "save-over"): "local.zstd_overwrite",
    }
    figures = []
    for (case, op), key in keys.items():
        r = rows[(case, op)]
        if op == "save":
            limit = f"write+fsync of new files {r['limit_s']:.3f} s"
        elif op == "save-over":
            limit = f"new files {r['limit_s']:.3f} s, in place {r['in_place_s']:.3f} s"
        elif case == "zstd":
            limit = f"decoding floor {r['limit_s']:.3f} s"
        else:
            limit = f"plain readinto {r['limit_s']:.3f} s"
        ours, stock = f"{r['ours_s']:.3f} s", f"{r['stock_s']:.3f} s"
        over = r["ours_s"] / r["limit_s"]
        figures.append(Figure(key, ours, stock, r["ratio"], limit, over))
    protocol = (
        f"local ({size_mb:.0f} MB, mostly bf16, 40 tensors; benchmarks/restart.py): every "
        "save and load in a fresh process (imports and thread pools inside it; the state "
        "dict, and for a load its zeroed target, built and touched before the clock), an "
        f"untimed sync first; a warm-up round, then stock/ours alternate, median of {repeat}; "
        f"peer = stock FileSystemWriter/Reader (torch's ZStandard for zstd); limits in "
        f"{restart.THREADS} threads. ratio = stock s / ours s."
    )
    return figures, protocol


def run_s3(
    endpoint: str, size_mb: float, repeat: int, plots: str | None
) -> tuple[list[Figure], str]:
    from benchmarks import s3_peers as peers

    names = ["ours", "stock fsspec", "s3torchconnector"]
    samples, logical = peers.side_by_side(
        {name: peers.make_client(name, endpoint) for name in names},
        size_mb,
        repeat,
        url=lambda prefix: f"s3://{BUCKET}/{prefix}",
        load=lambda name, url, mb: peers.load_in_fresh_process(name, endpoint, url, mb),
        delete=lambda prefix: peers.delete_prefix(endpoint, prefix),
        ceiling=lambda: peers.raw_ceiling(endpoint),
    )
    med = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()}
    gb = logical / 1e9
    if plots:
        peers.plot_throughput(med, logical, os.path.join(plots, "s3-throughput.png"))
    ours, ceiling = med["ours"], med["raw ceiling"]
    limit = {
        op: f"raw {'PUT' if op == 'save' else 'GET'} ceiling {ceiling[op]:.2f} s"
        for op in ("save", "load")
    }
    figures = []
    for peer, short in (("s3torchconnector", "s3tc"), ("stock fsspec", "fsspec")):
        other = med[peer]
        for op in ("save", "load"):
            figures.append(
                Figure(
                    f"s3.{op}_vs_{short}",
                    f"{ours[op]:.2f} s",
                    f"{other[op]:.2f} s",
                    other[op] / ours[op],
                    limit[op],
                    ours[op] / ceiling[op],
                )
            )
            figures.append(
                Figure(
                    f"s3.{op}_cpu_vs_{short}",
                    f"{ours[op + '_cpu'] / gb:.2f} s/GB",
                    f"{other[op + '_cpu'] / gb:.2f} s/GB",
                    ours[op + "_cpu"] / other[op + "_cpu"],
                    f"ceiling {ceiling[op + '_cpu'] / gb:.2f} s/GB",
                )
            )
    for op in ("save", "load"):
        figures.append(
            Figure(
                f"s3.{op}_vs_ceiling",
                f"{ours[op]:.2f} s",
                f"{ceiling[op]:.2f} s",
                ceiling[op] / ours[op],
                "the ceiling is the limit",
            )
        )
    protocol = (
        f"s3 ({logical / 1e6:.0f} MB of 2048x2048 tensors; benchmarks/s3_peers.py): one "
        "SeaweedFS on loopback (it shares the 2 cores); a warm-up save and load per client, "
        f"then {repeat} round(s), the order rotating; saves in this process, each load in a "
        "fresh one (imports and target untimed, checked bit-exact); CPU = the client's "
        "user+sys per GB. Peers: s3torchconnector (CRT) and stock FsspecWriter/Reader, "
        "thread_count=8. Ceiling: boto3, 8 x 32 MiB PUT then GET in 8 threads, scaled to the "
        "same bytes. Times: peer / ours; CPU: ours / peer."
    )
    return figures, protocol


def run_loop(server: Any, quick: bool, plots: str | None, rounds: int) -> tuple[list[Figure], str]:
    from benchmarks import training_loop as loop
    from tests.support.capped_proxy import CappedProxy

    size, interval, steps = ("quick", 5, 15) if quick else ("full", 10, 40)
    # The floor is a copy into memory, the same every round: run once. The others run
    # every round, the order rotating, each against its own round's run without checkpoints.
    timed = ["none", "stock async", "s3tc async", "ours async", "ours tiered"]
    args = argparse.Namespace(ranks=1, size=size, threads=1, profile=None)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in ["floor", *timed]}
    with CappedProxy(server.url, rate=100e6, latency=0.005) as proxy:
        bench = loop.Bench(args, server, proxy)
        try:
            loop.ceiling(bench)
            order = [("floor", 0)] + [
                (timed[(i + r) % len(timed)], r) for r in range(rounds) for i in range(len(timed))
            ]
            for name, round_ in order:
                run = bench.run(name, interval, steps, round_)
                runs[name].append(run)
                print(f"  loop {name}: {run['wall']:.1f} s", file=sys.stderr, flush=True)
        finally:
            shutil.rmtree(bench.work, ignore_errors=True)
    if plots:
        title = f"one rank, capped bucket, a checkpoint every {interval} steps"
        last = {n: r[-1] for n, r in runs.items()}
        loop.plot_steps(last, title, os.path.join(plots, "loop-steps.png"))

    def slowdown(name: str) -> float:
        """The median over rounds of the slowdown against that round's baseline."""
        walls = [r["wall"] for r in runs[name]]
        bases = [r["wall"] for r in runs["none"]]
        if name == "floor":
            return 100 * (walls[0] / statistics.median(bases) - 1)
        return statistics.median(100 * (w / b - 1) for w, b in zip(walls, bases))

    def stalls(name: str) -> tuple[float, float]:
        """Median of every stall, and the median over rounds of each round's largest, ms."""
        every = [s for r in runs[name] for s in r["stalls"]]
        return 1000 * statistics.median(every), 1000 * statistics.median(
            max(r["stalls"]) for r in runs[name]
        )

    ours = slowdown("ours async")
    floor = f"floor slowdown {slowdown('floor'):.1f}%"
    figures = []
    for peer, short in (("stock async", "stock"), ("s3tc async", "s3tc")):
        theirs = slowdown(peer)
        figures.append(
            Figure(
                f"loop.slowdown_vs_{short}",
                f"{ours:.1f}%",
                f"{theirs:.1f}%",
                ours / theirs if theirs > 0 else None,
                floor,
            )
        )
    cold = runs["floor"][0].get("cold_copy")
    for i, which in enumerate(("median", "max")):
        mine, copy = stalls("ours async")[i], stalls("floor")[i]
        limit = "the floor (a copy into staging buffers) is the limit"
        if which == "max" and cold:  # the first checkpoint's own limit
            limit += f"; the first copy, into untouched memory, {1000 * cold:.0f} ms"
        figures.append(
            Figure(
                f"loop.stall_{which}_vs_floor",
                f"{mine:.0f} ms",
                f"{copy:.0f} ms",
                mine / copy if copy > 0 else None,
                limit,
            )
        )
    tiered, stock = slowdown("ours tiered"), slowdown("stock async")
    figures.append(
        Figure(
            "loop.tiered_slowdown_vs_stock",
            f"{tiered:.1f}%",
            f"{stock:.1f}%",
            tiered / stock if stock > 0 else None,
            floor,
        )
    )
    tiered_stall, copy = stalls("ours tiered")[0], stalls("floor")[0]
    figures.append(
        Figure(
            "loop.tiered_stall_median_vs_floor",
            f"{tiered_stall:.0f} ms",
            f"{copy:.0f} ms",
            tiered_stall / copy if copy > 0 else None,
            "the floor (a copy into staging buffers) is the limit",
        )
    )
    base_cpu = statistics.median(r["job_cpu"] for r in runs["none"])
    cpu = {n: loop.checkpoint_cpu(runs[n], base_cpu) for n in runs if n != "none"}
    ours_cpu, s3tc_cpu = cpu["ours async"], cpu["s3tc async"]
    figures.append(
        Figure(
            "loop.cpu_per_gb_vs_s3tc",
            f"{ours_cpu:.2f} s/GB" if ours_cpu is not None else "-",
            f"{s3tc_cpu:.2f} s/GB" if s3tc_cpu is not None else "-",
            ours_cpu / s3tc_cpu if ours_cpu and s3tc_cpu and s3tc_cpu > 0 else None,
            f"stock async {cpu['stock async'] or 0:.2f} s/GB, floor {cpu['floor'] or 0:.2f} s/GB",
        )
    )
    model = "the small model" if quick else "a 6-layer LM, 277 MB of state"
    protocol = (
        f"loop (benchmarks/training_loop.py --capped, {model}): 1 rank, 1 torch thread, "
        f"{steps} steps, a checkpoint every {interval}, {rounds} round(s) of every variant "
        "in fresh processes, the order rotating (the floor once), to SeaweedFS through the "
        "capped proxy (100 MB/s both ways, 5 ms per request). Slowdown = training wall time "
        "over the same round's run without checkpoints, median over rounds; stall = time in "
        "save (state dict built inside): the median of every stall, and the median over "
        "rounds of each round's largest (the first checkpoint's); floor = the state's tensors "
        "copied into staging buffers allocated once (its first copy, into untouched memory, "
        "timed apart: the limit of a job's first checkpoint). Ours tiered: local= a directory on "
        "this disk, keep_local=2, each step drained to the bucket. Peers: stock "
        "dcp.async_save + "
        "FsspecWriter, s3torchconnector's S3StorageWriter with dcp.async_save. Ratios: ours / "
        "peer. CPU per checkpointed GB: the job's CPU (trainer and its children: the persist "
        "worker with its start-up, torch's checkpoint process) over the run without "
        "checkpoints, per GB saved, medians over rounds."
    )
    return figures, protocol


# --- the run -------------------------------------------------------------------------------


def run_codec(repeat: int) -> tuple[list[Figure], str]:
    import torch

    from benchmarks import compression
    from extensions import ItemInfo, WeightCodec

    torch.set_num_threads(1)
    worst: dict[str, tuple[float, str, str]] = {}  # measure: (ratio, ours, peer)
    for name, tensor in compression.tensors(["randn-bf16", "adam-v-fp32"]).items():
        raw = tensor.view(torch.uint8).numpy().tobytes()
        dtype = str(tensor.dtype).removeprefix("torch.")
        item = ItemInfo(checkpoint="bench", item=name, dtype=dtype, element_size=tensor.itemsize)
        # The sides alternate run by run (this VM's speed moves between minutes: blocks of
        # one side's runs, then the other's, read 0.8x and 1.1x in consecutive checks).
        sides = {
            "zipnn": (compression.zipnn(dtype), True),
            "ours": (compression.ours([WeightCodec()], item), False),
        }
        runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
        for round_ in range(repeat):
            for side in sorted(sides, reverse=bool(round_ % 2)):
                codec, copy_input = sides[side]
                runs[side].append(compression.measure(codec, raw, 1, copy_input))
        zipnn, ours = (
            {f: statistics.median(r[f] for r in runs[side]) for f in runs[side][0]}
            for side in ("zipnn", "ours")
        )
        for key, field, unit in (
            ("codec.ratio_vs_zipnn", "ratio", ""),
            ("codec.compress_vs_zipnn", "compress", " MB/s"),
            ("codec.decompress_vs_zipnn", "decompress", " MB/s"),
        ):
            ratio = ours[field] / zipnn[field]
            if key not in worst or ratio < worst[key][0]:
                digits = 4 if field == "ratio" else 0
                worst[key] = (
                    ratio,
                    f"{ours[field]:.{digits}f}{unit} ({name})",
                    f"{zipnn[field]:.{digits}f}{unit}",
                )
    figures = [Figure(key, o, p, r, "-") for key, (r, o, p) in worst.items()]
    protocol = (
        "codec (benchmarks/compression.py): [WeightCodec()] through the framework against "
        "ZipNN 0.5.4 (threads=1) on randn-bf16 (17 MB) and adam-v-fp32 (21 MB), one core "
        f"each, the sides alternating, {repeat} rounds of a warm-up and a timed run, medians, "
        "every decode checked; ratio = ours / "
        "ZipNN (stored size inverted, MB/s), the worse tensor's."
    )
    return figures, protocol


def table(figures: list[Figure], recorded: dict[str, Recorded]) -> int:
    """Print the table; the worst severity of its verdicts."""
    by_key = {m.key: m for m in MEASURES}
    print(
        "\n| measure | ours | peer | ratio | goal | recorded | verdict | limit |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    worst = 0
    for fig in figures:
        measure, rec = by_key[fig.key], recorded[fig.key]
        text, severity = verdict(measure, rec, fig.ratio, fig.over_limit)
        worst = max(worst, severity)
        sign = ">=" if measure.higher_is_better else "<="
        goal = f"{sign} {rec.goal:.2f}x" if rec.goal is not None else "-"
        ratio = f"{fig.ratio:.2f}x" if fig.ratio is not None else "-"
        was = f"{rec.ratio:.2f}x" if rec.ratio is not None else "-"
        cells = [rec.label, fig.ours, fig.peer, ratio, goal, was, text, fig.limit]
        print("| " + " | ".join(cells) + " |")
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        action="append",
        choices=PARTS + check_wide.PARTS,
        help="this part (repeatable)",
    )
    parser.add_argument(
        "--wide", action="store_true", help="also every earlier goal's part (check_wide.py)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: small sizes")
    parser.add_argument("--local-mb", type=float, help="local state dict (default 512; quick 32)")
    parser.add_argument("--local-repeat", type=int, default=1, help="timed rounds (default 1)")
    parser.add_argument("--s3-mb", type=float, help="S3 state dict (default 268; quick 32)")
    parser.add_argument("--s3-repeat", type=int, help="rounds (default 3; quick 1)")
    parser.add_argument(
        "--dir", help="work directory for the local and incremental parts (default: a temp dir)"
    )
    parser.add_argument(
        "--loop-rounds", type=int, help="rounds of each loop variant (default 2; quick 1)"
    )
    parser.add_argument("--codec-repeat", type=int, help="codec rounds (default 7; quick 1)")
    parser.add_argument(
        "--plots", metavar="DIR", help="draw the loop's step times and the S3 throughputs here"
    )
    args = parser.parse_args()
    parts = args.only or list(PARTS + check_wide.PARTS if args.wide else PARTS)
    recorded = read_recorded()  # before anything runs: a table that disagrees stops here
    if "s3" in parts or "loop" in parts:
        try:
            import s3torchconnector  # noqa: F401 - the peer of both parts
        except ImportError:
            raise SystemExit(
                "the s3 and loop parts compare against s3torchconnector, which is not "
                "installed: pip install -e '.[bench]' (or run --only local)"
            ) from None
    if "codec" in parts:
        try:
            import zipnn  # noqa: F401 - the codec part's peer
        except ImportError:
            raise SystemExit(
                "the codec part compares against ZipNN, which is not installed: "
                "pip install -e '.[bench]' (or leave out --only codec)"
            ) from None
    local_mb = args.local_mb or (32 if args.quick else 512)
    s3_mb = args.s3_mb or (32 if args.quick else 268)
    s3_repeat = args.s3_repeat or (1 if args.quick else 3)
    loop_rounds = args.loop_rounds or (1 if args.quick else 2)
    codec_repeat = args.codec_repeat or (1 if args.quick else 7)

    figures: list[Figure] = []
    protocols: list[str] = []
    started = time.monotonic()
    if args.plots:
        os.makedirs(args.plots, exist_ok=True)  # before minutes of runs, not after

    def note(part: str, began: float) -> None:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"{part}: {time.monotonic() - began:.0f} s (load average {load})", file=sys.stderr)

    if "local" in parts:
        print(f"local: restart protocol, {local_mb:.0f} MB ...", file=sys.stderr, flush=True)
        began = time.monotonic()
        got, protocol = run_local(local_mb, args.local_repeat, args.dir)
        figures += got
        protocols.append(protocol)
        note("local", began)
    if "s3" in parts or "loop" in parts:
        from tests.support.servers import SeaweedFS

        with SeaweedFS(bucket=BUCKET) as server:
            if "s3" in parts:
                print(f"s3: peers on SeaweedFS, {s3_mb:.0f} MB ...", file=sys.stderr, flush=True)
                began = time.monotonic()
                got, protocol = run_s3(server.url, s3_mb, s3_repeat, args.plots)
                figures += got
                protocols.append(protocol)
                note("s3", began)
            if "loop" in parts:
                print("loop: the training loop ...", file=sys.stderr, flush=True)
                began = time.monotonic()
                got, protocol = run_loop(server, args.quick, args.plots, loop_rounds)
                figures += got
                protocols.append(protocol)
                note("loop", began)

    if "codec" in parts:
        print("codec: WeightCodec against ZipNN ...", file=sys.stderr, flush=True)
        began = time.monotonic()
        got, protocol = run_codec(codec_repeat)
        figures += got
        protocols.append(protocol)
        note("codec", began)

    for part in check_wide.PARTS:
        if part not in parts:
            continue
        why = check_wide.missing(part)
        if why:
            print(f"{part}: skipped: {why}", file=sys.stderr, flush=True)
            protocols.append(f"{part}: skipped: {why}.")
            continue
        print(
            f"{part}: {'smoke run' if args.quick else 'the recorded sizes'} ...",
            file=sys.stderr,
            flush=True,
        )
        began = time.monotonic()
        got, protocol = check_wide.run(part, args.quick, args.dir)
        figures += got
        protocols.append(protocol)
        note(part, began)

    print("\n" + "\n\n".join(protocols))
    worst = table(figures, recorded)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"\n{time.monotonic() - started:.0f} s in all; load average now {load}. Recorded ratios: "
        f"docs/benchmarks.md; a verdict fails below its goal or more than {TOLERANCE:.0%} "
        "worse than recorded."
    )
    if args.quick:
        print("--quick: sizes differ from the recorded runs; the verdicts do not set the status")
        return
    sys.exit(worst)


if __name__ == "__main__":
    main()
