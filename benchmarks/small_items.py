"""A state dict of many small tensors: save and load, stock DCP against ours, each call in
a fresh process.

    python benchmarks/small_items.py                      # 20,000 x 4 KB + 64 MB, 3 rounds
    python benchmarks/small_items.py --count 2000 --size 16384

Models with many small parameters (norms, biases, per-expert scales) make a save mostly
per-item work: DCP's planning, torch.save's archive per tensor, the records. This runs
``dcp.save`` / ``dcp.load`` (no process group) with stock ``FileSystemWriter`` /
``FileSystemReader`` and ours (``CheckpointWriter`` / ``CheckpointReader``, defaults) on
``--count`` float32 tensors of ``--size`` bytes plus four 16 MiB ones, to a local
directory. Each timed call runs in a new interpreter; the state (and for a load its
zeroed target) is built before the clock starts. A warm-up round, then ``--rounds``
rounds alternating the sides; medians, ratio = stock s / ours s (> 1: we are faster).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child(op: str, side: str, path: str, count: int, size: int) -> None:
    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed.checkpoint as dcp

    import storage

    torch.manual_seed(0)
    state = {f"layers.{i}.scale": torch.randn(size // 4) for i in range(count)}
    state.update({f"big.{i}": torch.randn(4 << 20) for i in range(4)})
    if op == "load":
        state = {k: torch.zeros_like(v) for k, v in state.items()}
    start = time.perf_counter()
    if op == "save":
        writer = dcp.FileSystemWriter(path) if side == "stock" else storage.CheckpointWriter(path)
        dcp.save(state, storage_writer=writer, no_dist=True)
    else:
        reader = dcp.FileSystemReader(path) if side == "stock" else storage.CheckpointReader(path)
        dcp.load(state, storage_reader=reader, no_dist=True)
    print(json.dumps(time.perf_counter() - start))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=20000)
    parser.add_argument("--size", type=int, default=4096, help="bytes per small tensor")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="dcp-small-items-")
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for round_ in range(args.rounds + 1):  # the first warms up
            for side in ("stock", "ours"):
                path = os.path.join(work, f"{side}-{round_}")
                for op in ("save", "load"):
                    argv = [sys.executable, __file__, "--child", op, side, path]
                    argv += [str(args.count), str(args.size)]
                    subprocess.run(["sync"], check=False)
                    done = subprocess.run(argv, capture_output=True, text=True, check=False)
                    if done.returncode:
                        raise SystemExit(f"{side} {op} failed:\n{done.stderr[-3000:]}")
                    if round_:
                        times.setdefault((side, op), []).append(float(done.stdout.split()[-1]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mb = (args.count * args.size + 4 * (16 << 20)) / 1e6
    print(f"{args.count} tensors of {args.size} B + 4 x 16 MiB ({mb:.0f} MB), ", end="")
    print(f"medians of {args.rounds}")
    print("| op | stock s | ours s | stock / ours |")
    print("|---|---|---|---|")
    for op in ("save", "load"):
        stock = statistics.median(times[("stock", op)])
        ours = statistics.median(times[("ours", op)])
        print(f"| {op} | {stock:.2f} | {ours:.2f} | {stock / ours:.2f}x |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    else:
        main()
