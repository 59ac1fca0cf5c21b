"""Incremental checkpoints on a LoRA-like state: bytes written and save time per step.

State: a frozen bf16 base (``--size-mb``, default 1024, in 16 MiB tensors), fp32 adapters
and their AdamW state (exp_avg, exp_avg_sq; ``--changed-mb`` in all, default 48) plus a
step counter, all of which change every step. Five steps go through
``CheckpointManager(incremental=True, keep_last=2)``; step 1 is a full save, steps 2..5
reference the frozen base.

Per run: a full save of the same state (``incremental=False``) for reference, then the
five incremental steps; bytes written per step are the sizes of the files in that step's
directory (data files + ``.metadata``), against the bytes of the items that changed plus
the metadata. After retention and ``gc`` (grace 0) every remaining step is loaded and
compared bit for bit. ``--repeat`` runs alternate; medians are reported.

The limit beside the steps: a plain save of only the changed items (``storage.save`` into
a new directory, each step) plus fingerprinting the whole state at the speed measured in
the same run (xxHash3-128, on this process's share of the cores, at most 4; a save takes
its fingerprints on its writing threads, overlapping the changed items' writes, so a step
can beat this sum); the goal is a step within 1.5x of it. Every timed save follows an
``os.sync()``.

    PYTHONPATH=. python benchmarks/incremental.py --size-mb 128 --changed-mb 4 --repeat 5
    PYTHONPATH=. python benchmarks/incremental.py --size-mb 1024 --repeat 3
    PYTHONPATH=. python benchmarks/incremental.py --size-mb 128 --repeat 3 --s3   # moto
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import storage  # noqa: E402
from storage.checkpoint import incremental, persist  # noqa: E402

MIB = 1 << 20
#: The threads the limit's fingerprints run on: this process's share of the cores.
FINGERPRINT_THREADS = persist.copy_threads()


def lora_state(size_mb: int, step: int, changed_mb: float = 48) -> dict[str, Any]:
    frozen = torch.Generator().manual_seed(0)
    moving = torch.Generator().manual_seed(1000 + step)
    per = 16 * MIB // 2  # bf16 elements in a 16 MiB tensor
    state: dict[str, Any] = {
        f"base.{i}": torch.randn(per, generator=frozen).to(torch.bfloat16)
        for i in range(max(1, size_mb // 16))
    }
    numel = max(1, int(changed_mb * MIB) // 4 // 48)
    for i in range(16):  # 16 fp32 adapters, each with AdamW's two moments
        for name in ("lora", "exp_avg", "exp_avg_sq"):
            state[f"{name}.{i}"] = torch.randn(numel, generator=moving)
    state["step"] = torch.tensor(step)
    return state


def changed_bytes(state: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for k, v in state.items() if not k.startswith("base."))


def blank(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.empty_like(v) for k, v in state.items()}


def step_bytes(mgr: storage.CheckpointManager, step: int) -> tuple[int, int]:
    """(bytes of every file in the step, bytes of its .metadata)."""
    path = mgr.step_path(step)
    sizes = {n: mgr.fs.size(mgr.fs.concat_path(path, n)) for n in mgr.fs.ls(path)}
    return sum(sizes.values()), sizes.get(".metadata", 0)


def fingerprint_seconds(state: dict[str, Any]) -> float:
    """Fingerprinting every item of ``state`` (what an incremental save adds) on this
    process's share of the cores."""
    values = [v.contiguous() for v in state.values()]
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(FINGERPRINT_THREADS) as pool:
        list(pool.map(lambda v: incremental.fingerprint(v, []), values))
    return time.perf_counter() - started


def one_run(root: str, size_mb: int, changed_mb: float, options: dict[str, Any]) -> dict[str, Any]:
    full_mgr = storage.CheckpointManager(root + "/full", **options)
    state = lora_state(size_mb, 1, changed_mb)
    os.sync()
    started = time.perf_counter()
    full_mgr.save(1, state)
    full_s = time.perf_counter() - started

    mgr = storage.CheckpointManager(root + "/incr", keep_last=2, incremental=True, **options)
    rows = []
    for step in range(1, 6):
        state = lora_state(size_mb, step, changed_mb)
        changed = {k: v for k, v in state.items() if not k.startswith("base.")}
        os.sync()
        started = time.perf_counter()
        storage.save(changed, f"{root}/changed-{step}", **options)
        changed_s = time.perf_counter() - started
        hash_s = fingerprint_seconds(state)
        os.sync()
        started = time.perf_counter()
        mgr.save(step, state)
        seconds = time.perf_counter() - started
        written, meta = step_bytes(mgr, step)
        rows.append((step, seconds, written, changed_bytes(state) + meta, changed_s, hash_s))
    mgr.cleanup(grace_seconds=0)
    for step in mgr.steps():  # retention kept step-1 (the base) and the last two
        out = blank(lora_state(size_mb, step, changed_mb))
        mgr.load(out, step)
        want = lora_state(size_mb, step, changed_mb)
        assert all(torch.equal(out[k], want[k]) for k in want), f"step {step} differs"
    logical = sum(v.numel() * v.element_size() for v in state.values())
    return {"full_s": full_s, "rows": rows, "steps": mgr.steps(), "logical": logical}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="frozen base size (MiB)")
    parser.add_argument(
        "--changed-mb", type=float, default=48, help="adapters + moments, changed each step"
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--s3", action="store_true", help="on a moto S3 server")
    parser.add_argument("--dir", default=None, help="local directory (default: a temp dir)")
    args = parser.parse_args()

    options: dict[str, Any] = {}
    if args.s3:
        from tests.support.servers import create_bucket, moto_endpoint, s3_options

        endpoint = moto_endpoint()
        bucket = f"incr-{uuid.uuid4().hex[:8]}"
        create_bucket(endpoint, bucket)
        options["storage_options"] = s3_options(endpoint)
    runs = []
    for r in range(args.repeat):
        if args.s3:
            runs.append(one_run(f"s3://{bucket}/run{r}", args.size_mb, args.changed_mb, options))
            continue
        tmp = tempfile.mkdtemp(dir=args.dir)
        try:
            runs.append(one_run(tmp, args.size_mb, args.changed_mb, options))
        finally:
            shutil.rmtree(tmp)
    full_s = statistics.median(run["full_s"] for run in runs)
    print(
        f"where: {'moto S3' if args.s3 else 'local disk'}; base {args.size_mb} MiB bf16, "
        f"{args.changed_mb} MiB changed per step; {args.repeat} runs, medians; steps kept "
        f"after retention+gc: {runs[-1]['steps']}, all bit-exact"
    )
    print(f"full save (incremental=False): {full_s:.3f} s")
    print(
        "| step | save s | vs full save | written MB | changed+metadata MB | ratio "
        "| changed-items save s | fingerprint s | limit s (1.5x both) | step / (both) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i in range(5):
        seconds, written, needed, changed_s, hash_s = (
            statistics.median(run["rows"][i][j] for run in runs) for j in (1, 2, 3, 4, 5)
        )
        floor = changed_s + hash_s
        print(
            f"| {i + 1} | {seconds:.3f} | {seconds / full_s:.3f}x | {written / 1e6:.2f} | "
            f"{needed / 1e6:.2f} | {written / needed:.3f}x | {changed_s:.3f} | {hash_s:.3f} | "
            f"{1.5 * floor:.3f} | {seconds / floor:.2f}x |"
        )
    hashed = statistics.median(r[5] for run in runs for r in run["rows"])
    print(
        f"fingerprint speed: {runs[-1]['logical'] / hashed / 1e9:.1f} GB/s "
        f"(xxHash3-128, {FINGERPRINT_THREADS} threads)"
    )


if __name__ == "__main__":
    main()
