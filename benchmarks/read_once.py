"""Read once, share over the process group: bytes fetched and load time on 8 gloo ranks.

    python benchmarks/read_once.py                   # 8 ranks, 64 MB replicated, local disk
    python benchmarks/read_once.py --size-mb 64 --ranks 8 --repeat 3 [--zstd]

Every rank holds the same (fully replicated) state dict of ``--size-mb`` MB in 16
tensors; it is saved once, then loaded on every rank with ``read_once=False`` (stock
DCP's behaviour: every rank fetches every byte) and ``read_once=True``, alternated
``--repeat`` times. Bytes fetched are counted per rank by our own backend
(tests/support/scale_fs.py: the length of every ranged read of a data file); the ratio is their
sum over all ranks / the stored bytes the plans need. Time is the slowest rank's
``storage.load`` (after a barrier), median over the repeats. The page cache is warm.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import storage  # noqa: E402
from extensions import ZStandard  # noqa: E402
from tests.support.scale_fs import ProbeFileSystem  # noqa: E402


def _state(size_mb: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    n = int(size_mb * 1e6 / 4 / 16)
    return {f"w{i:02d}": torch.randn(n, generator=gen) for i in range(16)}


def _worker(rank: int, world: int, store: str, path: str, args: Any, out: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    state = _state(args.size_mb)
    fs = ProbeFileSystem()
    storage.save(state, path, filesystem=fs, transforms=[ZStandard()] if args.zstd else [])
    results: dict[bool, list[tuple[float, int]]] = {False: [], True: []}
    for _ in range(args.repeat):
        for once in (False, True):
            target = {k: torch.empty_like(v) for k, v in state.items()}
            fs.reset()
            dist.barrier()
            start = time.perf_counter()
            storage.load(target, path, filesystem=fs, read_once=once)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            fetched = torch.tensor([fs.data_bytes])
            dist.all_reduce(fetched)
            results[once].append((float(elapsed), int(fetched)))
            assert all(torch.equal(target[k], v) for k, v in state.items())
    if rank == 0:
        out.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--size-mb", type=float, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--zstd", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        ctx = mp.get_context("spawn")
        out = ctx.SimpleQueue()
        mp.start_processes(
            _worker,
            args=(args.ranks, os.path.join(tmp, "store"), path, args, out),
            nprocs=args.ranks,
            join=True,
            start_method="spawn",
        )
        results = out.get()
        reader = storage.CheckpointReader(path)
        md = reader.read_metadata()
        stored = sum(i.length for i in md.storage_data.values())
    print(f"{args.ranks} ranks, {args.size_mb:g} MB replicated, stored {stored / 1e6:.1f} MB")
    print("| read_once | load s (median, slowest rank) | bytes fetched / needed |")
    print("|---|---|---|")
    for once in (False, True):
        times = [t for t, _ in results[once]]
        ratio = results[once][-1][1] / stored
        print(f"| {once} | {statistics.median(times):.2f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
