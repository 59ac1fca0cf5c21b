"""Side-by-side benchmark: stock DCP vs dcp-storage in one process.

    python benchmarks/bench.py                      # every case, ~1.08 GB state dict
    python benchmarks/bench.py --cases local-none,local-zstd --repeat 3 --size-mb 1080

Protocol: build the state dict once (seeded); for each case run stock then ours once as
a warm-up, then alternate stock/ours (A B A B ...) ``--repeat`` times and report the
median time, MB/s (logical bytes) and peak RSS above the level before the call, plus
the ratio stock/ours for time (> 1 means we are faster). The page cache stays warm.
This is the long-lived-process protocol; benchmarks/restart.py runs every save and
load in a fresh process (a restarted job) with the physical limit beside it.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import ZStandard as TorchZStandard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import storage  # noqa: E402
from extensions import ZStandard  # noqa: E402

MB = 1e6


def build_state_dict(
    total_mb: float, n_tensors: int = 40, seed: int = 0, *, zeros: bool = False
) -> dict[str, Any]:
    """``n_tensors`` mixed-size tensors (mostly bf16, some fp32) plus plain values.

    Values are weight-like: normal with a per-tensor scale, so zstd finds what it finds
    on real bf16 weights (the exponent byte compresses, the mantissa does not). With
    ``zeros`` the same tensors are zero-filled (allocated and touched: a load target),
    without drawing the values first."""
    gen = torch.Generator().manual_seed(seed)
    weights = [1 + (i % 7) for i in range(n_tensors)]
    scale = total_mb * MB / sum(weights)
    state: dict[str, Any] = {}
    for i, w in enumerate(weights):
        dtype = torch.float32 if i % 5 == 4 else torch.bfloat16
        numel = max(1, int(w * scale) // torch.finfo(dtype).bits * 8)
        cols = 1024
        rows = max(1, numel // cols)
        if zeros:
            state[f"layer{i:02d}.weight"] = torch.zeros(rows, cols, dtype=dtype)
            continue
        t = torch.randn(rows, cols, generator=gen) * (0.02 * (1 + i % 3))
        state[f"layer{i:02d}.weight"] = t.to(dtype)
    state["step"] = 1000
    state["config"] = {"lr": 3e-4, "name": "bench"}
    return state


def logical_bytes(state: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        out[k] = torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
    return out


class PeakRSS:
    """Samples this process's RSS every 2 ms; ``peak`` is the max above the start."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def __enter__(self) -> PeakRSS:
        self._base = self._rss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss() - self._base)
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss() - self._base)


@dataclass
class Sample:
    seconds: float
    rss: int


def measure(fn: Callable[[], Any], reset: Callable[[], None] | None = None) -> Sample:
    if reset is not None:
        reset()  # untimed
    gc.collect()
    os.sync()  # start every run with no dirty pages from the previous one
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
    return Sample(dt, rss.peak)


@dataclass
class Case:
    name: str
    stock: Callable[[], Any] | None
    ours: Callable[[], Any]
    setup: Callable[[], None] = lambda: None
    logical: int = 0
    # Before each run of a side, untimed: empties the directory that side saves into.
    reset_stock: Callable[[], None] | None = None
    reset_ours: Callable[[], None] | None = None


def run_case(case: Case, repeat: int) -> dict[str, Any]:
    case.setup()
    runs: dict[str, list[Sample]] = {"stock": [], "ours": []}
    sides = [("stock", case.stock, case.reset_stock), ("ours", case.ours, case.reset_ours)]
    for _side, fn, reset in sides:  # warm-up
        if fn is not None:
            measure(fn, reset)
    for _ in range(repeat):
        for side, fn, reset in sides:
            if fn is not None:
                runs[side].append(measure(fn, reset))
    row: dict[str, Any] = {"case": case.name}
    for side in ("stock", "ours"):
        if runs[side]:
            row[f"{side}_s"] = statistics.median(s.seconds for s in runs[side])
            row[f"{side}_rss"] = max(s.rss for s in runs[side])
    if "stock_s" in row:
        row["speedup"] = row["stock_s"] / row["ours_s"]
    row["logical"] = case.logical
    return row


def dd_throughput(directory: str, mb: int) -> float:
    path = os.path.join(directory, "dd.bin")
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={mb // 4}", "conv=fdatasync"],
        check=True,
        capture_output=True,
    )
    dt = time.perf_counter() - t0
    os.unlink(path)
    return mb * 1024 * 1024 / MB / dt


def stored_ratio(path: str, logical: int) -> float:
    stored = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    return logical / stored


def local_cases(state: dict[str, Any], work: str) -> list[Case]:
    n = logical_bytes(state)
    paths = {k: os.path.join(work, k) for k in ("stock", "ours", "stock-z", "ours-z")}
    target = zeros_like(state)

    def save_stock(p: str, ext: Any = None) -> Callable[[], None]:
        return lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(p, _extensions=ext))

    def save_ours(p: str, tr: Any = None) -> Callable[[], None]:
        return lambda: storage.save(state, p, transforms=tr)

    def load_stock(p: str) -> Callable[[], None]:
        return lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(p))

    def load_ours(p: str) -> Callable[[], None]:
        return lambda: storage.load(target, p)

    def fresh(name: str) -> Callable[[], None]:
        # Saves go to an empty directory, as a new training step would.
        return lambda: _rm(paths[name])

    one_key = next(k for k in state if isinstance(state[k], torch.Tensor))
    partial = {one_key: torch.zeros_like(state[one_key])}

    def seed_all() -> None:
        save_stock(paths["stock"])()
        save_ours(paths["ours"])()
        save_stock(paths["stock-z"], [TorchZStandard()])()
        save_ours(paths["ours-z"], [ZStandard()])()

    return [
        Case(
            "local save, none",
            save_stock(paths["stock"]),
            save_ours(paths["ours"]),
            logical=n,
            reset_stock=fresh("stock"),
            reset_ours=fresh("ours"),
        ),
        Case(
            "local load, none",
            load_stock(paths["stock"]),
            load_ours(paths["ours"]),
            setup=seed_all,
            logical=n,
        ),
        Case(
            "local save, zstd",
            save_stock(paths["stock-z"], [TorchZStandard()]),
            save_ours(paths["ours-z"], [ZStandard()]),
            logical=n,
            reset_stock=fresh("stock-z"),
            reset_ours=fresh("ours-z"),
        ),
        Case(
            "local load, zstd", load_stock(paths["stock-z"]), load_ours(paths["ours-z"]), logical=n
        ),
        Case(
            "local load 1 of 40, none",
            lambda: dcp.load(partial, storage_reader=dcp.FileSystemReader(paths["stock"])),
            lambda: storage.load(partial, paths["ours"]),
            logical=partial[one_key].numel() * partial[one_key].element_size(),
        ),
    ]


def _rm(*paths: str) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def extra_cases(state: dict[str, Any], work: str) -> list[Case]:
    """zstd+AES and shuffle+zstd: no stock peer, ours against our zstd-only run."""
    from extensions import AES256GCM, ByteShuffle

    n = logical_bytes(state)
    key = bytes(range(32))
    target = zeros_like(state)
    z, za, sz = (os.path.join(work, k) for k in ("x-z", "x-za", "x-sz"))
    return [
        Case(
            "save zstd+AES (vs zstd)",
            lambda: storage.save(state, z, transforms=[ZStandard()]),
            lambda: storage.save(
                state, za, transforms=[ZStandard(), AES256GCM(key=key, key_id="k")]
            ),
            logical=n,
            reset_stock=lambda: _rm(z),
            reset_ours=lambda: _rm(za),
        ),
        Case(
            "load zstd+AES (vs zstd)",
            lambda: storage.load(target, z),
            lambda: storage.load(target, za, keys={"k": key}),
            logical=n,
        ),
        Case(
            "save shuffle+zstd (vs zstd)",
            lambda: storage.save(state, z, transforms=[ZStandard()]),
            lambda: storage.save(state, sz, transforms=[ByteShuffle(), ZStandard()]),
            logical=n,
            reset_stock=lambda: _rm(z),
            reset_ours=lambda: _rm(sz),
        ),
        Case(
            "load shuffle+zstd (vs zstd)",
            lambda: storage.load(target, z),
            lambda: storage.load(target, sz),
            logical=n,
        ),
    ]


def small_cases(work: str, count: int = 4000) -> list[Case]:
    """Optimizer-state-like: many small tensors; per-item overhead dominates."""
    gen = torch.Generator().manual_seed(1)
    state = {f"opt.{i}.exp_avg": torch.randn(256 + i % 512, generator=gen) for i in range(count)}
    n = logical_bytes(state)
    target = zeros_like(state)
    a, b = os.path.join(work, "small-stock"), os.path.join(work, "small-ours")
    return [
        Case(
            f"save {count} small tensors",
            lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(a)),
            lambda: storage.save(state, b),
            logical=n,
            reset_stock=lambda: _rm(a),
            reset_ours=lambda: _rm(b),
        ),
        Case(
            f"load {count} small tensors",
            lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(a)),
            lambda: storage.load(target, b),
            logical=n,
        ),
    ]


def _rank_save(rank: int, store: str, size_mb: float, work: str, repeat: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    full = build_state_dict(size_mb, seed=rank)
    state = {f"rank{rank}.{k}": v for k, v in full.items() if isinstance(v, torch.Tensor)}
    times: dict[str, list[float]] = {"stock": [], "ours": []}
    for i in range(repeat + 1):  # the first round is the warm-up
        for side in ("stock", "ours"):
            path = os.path.join(work, f"mr-{side}")
            if rank == 0:
                _rm(path)
            os.sync()
            dist.barrier()
            t0 = time.perf_counter()
            if side == "stock":
                dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
            else:
                storage.save(state, path)
            dist.barrier()
            if i:
                times[side].append(time.perf_counter() - t0)
    if rank == 0:
        with open(out, "w") as f:
            f.write(f"{statistics.median(times['stock'])} {statistics.median(times['ours'])}")
    dist.barrier()  # no rank tears gloo down while the other still uses it
    dist.destroy_process_group()


def multirank_row(size_mb: float, work: str, repeat: int) -> dict[str, Any]:
    """Two gloo ranks on this machine, each saving half of ``size_mb`` to local disk."""
    import torch.multiprocessing as mp

    out = os.path.join(work, "mr-result")
    args = (os.path.join(work, "mr-store"), size_mb / 2, work, repeat, out)
    mp.spawn(_rank_save, args=args, nprocs=2, join=True)
    with open(out) as f:
        stock_s, ours_s = (float(x) for x in f.read().split())
    logical = 2 * logical_bytes(build_state_dict(size_mb / 2))
    return {
        "case": "2-rank gloo save, none",
        "stock_s": stock_s,
        "ours_s": ours_s,
        "speedup": stock_s / ours_s,
        "logical": logical,
        "stock_rss": 0,
        "ours_rss": 0,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'case':<28} {'stock s':>8} {'ours s':>8} {'stock MB/s':>10} {'ours MB/s':>10} "
        f"{'speedup':>8} {'stock +RSS MB':>13} {'ours +RSS MB':>12}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        mbs = r["logical"] / MB
        stock_s = r.get("stock_s")
        print(
            f"{r['case']:<28} {stock_s if stock_s is not None else float('nan'):>8.3f} "
            f"{r['ours_s']:>8.3f} {mbs / stock_s if stock_s else float('nan'):>10.0f} "
            f"{mbs / r['ours_s']:>10.0f} {r.get('speedup', float('nan')):>8.2f} "
            f"{r.get('stock_rss', 0) / MB:>13.0f} {r['ours_rss'] / MB:>12.0f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=1080)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    parser.add_argument(
        "--cases",
        default="local,transforms,small,multirank",
        help="comma list of: local, transforms, small, multirank (RSS not sampled there)",
    )
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="dcp-bench-", dir=args.dir)
    try:
        state = build_state_dict(args.size_mb)
        n = logical_bytes(state)
        print(
            f"state dict: {len(state) - 2} tensors, {n / MB:.0f} MB logical; "
            f"torch {torch.__version__}; {os.cpu_count()} CPUs; work dir {work}"
        )
        print(f"dd if=/dev/zero bs=4M conv=fdatasync: {dd_throughput(work, 1024):.0f} MB/s")
        wanted = set(args.cases.split(","))
        cases: list[Case] = []
        if "local" in wanted:
            cases += local_cases(state, work)
        if "transforms" in wanted:
            cases += extra_cases(state, work)
        if "small" in wanted:
            cases += small_cases(work)
        rows = []
        for case in cases:
            rows.append(run_case(case, args.repeat))
            print(f"  done: {case.name}", file=sys.stderr)
        if "multirank" in wanted:
            rows.append(multirank_row(args.size_mb, work, args.repeat))
        print_table(rows)
        for name in ("stock-z", "ours-z", "x-z", "x-sz"):
            path = os.path.join(work, name)
            if os.path.isdir(path):
                print(f"zstd ratio {name}: {stored_ratio(path, n):.3f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
