"""Asynchronous saves of a CUDA state dict: the training loop's stall and time-to-durable.

    python benchmarks/gpu_staging.py                 # ~1.5 GB: bf16 params + fp32 moments
    python benchmarks/gpu_staging.py --gb 0.2 --saves 2 --every 3   # a quick run

A loop of steps (a matmul standing in for forward/backward, then an optimizer-like
in-place update) saves every ``--every`` steps with

- stock: ``dcp.async_save`` + ``DefaultStager(StagingOptions())`` (pinned, shared,
  async staging, non-blocking copies) and a ``FileSystemWriter``;
- ours: ``dcp.async_save`` with a ``CheckpointWriter`` (default persist mode, the persist
  worker) and ``async_staging=True``.

Both wait for ``staging_completion`` before the next update (torch's contract). The stall
per checkpoint is the time the loop spends in ``async_save`` plus that wait, over a
step's time without saving; time-to-durable is from the save's call to its upload
completing. Printed side by side, with ours over stock (< 1: ours better). Needs CUDA.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _state(gb: float) -> dict[str, Any]:
    import torch

    # bf16 params (2 B) + two fp32 moments (8 B): 10 B per parameter.
    n = int(gb * 1e9 / 10)
    chunk = 1 << 24
    sizes = [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])
    state: dict[str, Any] = {}
    for i, size in enumerate(sizes):
        state[f"p{i}"] = torch.randn(size, device="cuda").to(torch.bfloat16)
        state[f"m{i}"] = torch.zeros(size, device="cuda")
        state[f"v{i}"] = torch.zeros(size, device="cuda")
    return state


def _run(kind: str, state: dict[str, Any], root: Path, saves: int, every: int) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from storage import CheckpointWriter

    x = torch.randn(4096, 4096, device="cuda")
    stager = DefaultStager(StagingOptions()) if kind == "stock" else None
    stalls: list[float] = []
    durable: list[float] = []
    pending: list[tuple[float, Any]] = []
    step_times: list[float] = []
    for step in range(saves * every + 1):
        start = time.perf_counter()
        for _ in range(4):
            x = torch.tanh(x @ x)
        torch.cuda.synchronize()
        if step and step % every == 0:
            path = root / f"{kind}-{step}"
            t0 = time.perf_counter()
            if kind == "stock":
                response = dcp.async_save(
                    state, storage_writer=FileSystemWriter(path), async_stager=stager, no_dist=True
                )
            else:
                writer = CheckpointWriter(path, async_staging=True)
                response = dcp.async_save(state, storage_writer=writer, no_dist=True)
            response.staging_completion.result()
            stalls.append(time.perf_counter() - t0)
            pending.append((t0, response.upload_completion))
        else:
            step_times.append(time.perf_counter() - start)
        for value in state.values():
            value.add_(1)  # the optimizer step: only after staging completed
        for t0, upload in [p for p in pending if p[1].done()]:
            durable.append(time.perf_counter() - t0)
            pending.remove((t0, upload))
    for t0, upload in pending:
        upload.result()
        durable.append(time.perf_counter() - t0)
    if stager is not None:
        stager.close()
    return {
        "stall": statistics.median(stalls[1:] or stalls),
        "durable": statistics.median(durable[1:] or durable),
        "step": statistics.median(step_times),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.5, help="state size in GB (default 1.5)")
    parser.add_argument("--saves", type=int, default=4, help="checkpoints per variant")
    parser.add_argument("--every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu_staging.py needs a CUDA device; none is available here.", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="gpu-staging-", dir=args.dir))
    try:
        state = _state(args.gb)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        results = {k: _run(k, state, root, args.saves, args.every) for k in ("stock", "ours")}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    device = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    print(f"state {nbytes / 1e9:.2f} GB on {device}")
    print(f"{'':22}{'stock':>10}{'ours':>10}{'ours/stock':>12}")
    for key, label in (("stall", "stall per checkpoint"), ("durable", "time-to-durable")):
        stock, ours = results["stock"][key], results["ours"][key]
        print(f"{label:22}{stock:>9.3f}s{ours:>9.3f}s{ours / stock:>11.2f}x")
    print(f"{'step (no save)':22}{results['stock']['step']:>9.3f}s{results['ours']['step']:>9.3f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
