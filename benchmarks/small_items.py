"""A state dict of many small tensors: save and load, stock DCP against ours, each call in
a fresh process.

    python benchmarks/small_items.py                      # 20,000 x 4 KB + 64 MB, 3 rounds
    python benchmarks/small_items.py --count 2000 --size 16384
    python benchmarks/small_items.py --async-saves 4      # asynchronous saves instead

Models with many small parameters (norms, biases, per-expert scales) make a save mostly
per-item work: DCP's planning, torch.save's archive per tensor, the records. This runs
``dcp.save`` / ``dcp.load`` (no process group) with stock ``FileSystemWriter`` /
``FileSystemReader`` and ours (``CheckpointWriter`` / ``CheckpointReader``, defaults) on
``--count`` float32 tensors of ``--size`` bytes plus four 16 MiB ones, to a local
directory. Each timed call runs in a new interpreter; the state (and for a load its
zeroed target) is built before the clock starts. A warm-up round, then ``--rounds``
rounds alternating the sides; medians, ratio = stock s / ours s (> 1: we are faster).

``--async-saves N``: instead, each side makes N asynchronous saves of the state in one
process, as a training loop would (stock ``dcp.async_save`` with ``FileSystemWriter``,
ours a ``CheckpointManager`` with ``save(blocking=False)``, defaults), each waited for
before the next; the stall (the call's time) and the time to durable (its future
resolved) of the saves after the first, medians; the first save's stall apart.
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


def _async_child(side: str, path: str, count: int, size: int, saves: int) -> None:
    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed.checkpoint as dcp

    import storage

    torch.manual_seed(0)
    state = {f"layers.{i}.scale": torch.randn(size // 4) for i in range(count)}
    state.update({f"big.{i}": torch.randn(4 << 20) for i in range(4)})
    manager = storage.CheckpointManager(path, keep_last=2) if side == "ours" else None
    stalls, durable = [], []
    for step in range(saves):
        start = time.perf_counter()
        if manager is not None:
            future = manager.save(step, state, blocking=False)
        else:
            writer = dcp.FileSystemWriter(os.path.join(path, f"step-{step}"))
            future = dcp.async_save(state, storage_writer=writer)
        stalls.append(time.perf_counter() - start)
        assert future is not None
        future.result()
        durable.append(time.perf_counter() - start)
        if manager is None and step >= 2:  # stock keeps the last two, as ours does
            shutil.rmtree(os.path.join(path, f"step-{step - 2}"), ignore_errors=True)
    print(json.dumps({"stalls": stalls, "durable": durable}))


def _async_main(args: argparse.Namespace) -> None:
    work = tempfile.mkdtemp(prefix="dcp-small-items-")
    found: dict[str, dict[str, list[float]]] = {}
    try:
        for side in ("stock", "ours"):
            argv = [sys.executable, __file__, "--async-child", side, os.path.join(work, side)]
            argv += [str(args.count), str(args.size), str(args.async_saves)]
            done = subprocess.run(argv, capture_output=True, text=True, check=False)
            if done.returncode:
                raise SystemExit(f"{side} failed:\n{done.stderr[-3000:]}")
            found[side] = json.loads(done.stdout.split("\n")[-2])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.count} tensors of {args.size} B + 4 x 16 MiB, {args.async_saves} saves")
    print("| side | first stall s | stall s (median) | durable s (median) |")
    print("|---|---|---|---|")
    for side, got in found.items():
        stalls, durable = got["stalls"], got["durable"]
        later = stalls[1:] or stalls
        print(
            f"| {side} | {stalls[0]:.2f} | {statistics.median(later):.2f} | "
            f"{statistics.median(durable[1:] or durable):.2f} |"
        )


def measure(count: int, size: int, rounds: int) -> dict[tuple[str, str], list[float]]:
    """Seconds of each (side, op) over ``rounds`` timed rounds after a warm-up, every call
    in a fresh interpreter, the sides alternating; benchmarks/check.py --wide calls this."""
    work = tempfile.mkdtemp(prefix="dcp-small-items-")
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for round_ in range(rounds + 1):  # the first warms up
            for side in ("stock", "ours"):
                path = os.path.join(work, f"{side}-{round_}")
                for op in ("save", "load"):
                    argv = [sys.executable, __file__, "--child", op, side, path]
                    argv += [str(count), str(size)]
                    subprocess.run(["sync"], check=False)
                    done = subprocess.run(argv, capture_output=True, text=True, check=False)
                    if done.returncode:
                        raise SystemExit(f"{side} {op} failed:\n{done.stderr[-3000:]}")
                    if round_:
                        times.setdefault((side, op), []).append(float(done.stdout.split()[-1]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=20000)
    parser.add_argument("--size", type=int, default=4096, help="bytes per small tensor")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--async-saves", type=int, default=0, help="see the module docstring")
    args = parser.parse_args()
    if args.async_saves:
        _async_main(args)
        return
    times = measure(args.count, args.size, args.rounds)
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
    if len(sys.argv) > 1 and sys.argv[1] == "--async-child":
        _async_child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    else:
        main()
