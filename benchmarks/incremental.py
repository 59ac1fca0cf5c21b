"""Incremental checkpoints on a LoRA-like state: bytes written and save time per step.

State: a frozen bf16 base (``--size-mb``, default 1024, in 16 MiB tensors), 16 MiB of fp32
adapters and their AdamW state (exp_avg, exp_avg_sq) plus a step counter, all of which
change every step. Five steps go through ``CheckpointManager(incremental=True,
keep_last=2)``; step 1 is a full save, steps 2..5 reference the frozen base.

Per run: a full save of the same state (``incremental=False``) for reference, then the
five incremental steps; bytes written per step are the sizes of the files in that step's
directory (data files + ``.metadata``), against the bytes of the items that changed plus
the metadata. After retention and ``gc`` (grace 0) every remaining step is loaded and
compared bit for bit. ``--repeat`` runs alternate; medians are reported.

    PYTHONPATH=. python benchmarks/incremental.py --size-mb 1024 --repeat 3
    PYTHONPATH=. python benchmarks/incremental.py --size-mb 128 --repeat 3 --s3   # moto
"""

from __future__ import annotations

import argparse
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

MIB = 1 << 20


def lora_state(size_mb: int, step: int) -> dict[str, Any]:
    frozen = torch.Generator().manual_seed(0)
    moving = torch.Generator().manual_seed(1000 + step)
    per = 16 * MIB // 2  # bf16 elements in a 16 MiB tensor
    state: dict[str, Any] = {
        f"base.{i}": torch.randn(per, generator=frozen).to(torch.bfloat16)
        for i in range(max(1, size_mb // 16))
    }
    for i in range(16):  # 16 x 1 MiB fp32 adapters, each with AdamW's two moments
        for name in ("lora", "exp_avg", "exp_avg_sq"):
            state[f"{name}.{i}"] = torch.randn(MIB // 4, generator=moving)
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


def one_run(root: str, size_mb: int, options: dict[str, Any]) -> dict[str, Any]:
    full_mgr = storage.CheckpointManager(root + "/full", **options)
    state = lora_state(size_mb, 1)
    started = time.perf_counter()
    full_mgr.save(1, state)
    full_s = time.perf_counter() - started

    mgr = storage.CheckpointManager(root + "/incr", keep_last=2, incremental=True, **options)
    rows = []
    for step in range(1, 6):
        state = lora_state(size_mb, step)
        started = time.perf_counter()
        mgr.save(step, state)
        seconds = time.perf_counter() - started
        written, meta = step_bytes(mgr, step)
        rows.append((step, seconds, written, changed_bytes(state) + meta))
    mgr.cleanup(grace_seconds=0)
    for step in mgr.steps():  # retention kept step-1 (the base) and the last two
        out = blank(lora_state(size_mb, step))
        mgr.load(out, step)
        want = lora_state(size_mb, step)
        assert all(torch.equal(out[k], want[k]) for k in want), f"step {step} differs"
    return {"full_s": full_s, "rows": rows, "steps": mgr.steps()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="frozen base size (MiB)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--s3", action="store_true", help="on a moto S3 server")
    parser.add_argument("--dir", default=None, help="local directory (default: a temp dir)")
    args = parser.parse_args()

    options: dict[str, Any] = {}
    if args.s3:
        from tests.servers import create_bucket, moto_endpoint, s3_options

        endpoint = moto_endpoint()
        bucket = f"incr-{uuid.uuid4().hex[:8]}"
        create_bucket(endpoint, bucket)
        options["storage_options"] = s3_options(endpoint)
    runs = []
    for r in range(args.repeat):
        if args.s3:
            runs.append(one_run(f"s3://{bucket}/run{r}", args.size_mb, options))
            continue
        tmp = tempfile.mkdtemp(dir=args.dir)
        try:
            runs.append(one_run(tmp, args.size_mb, options))
        finally:
            shutil.rmtree(tmp)
    full_s = statistics.median(run["full_s"] for run in runs)
    print(
        f"where: {'moto S3' if args.s3 else 'local disk'}; base {args.size_mb} MiB bf16; "
        f"{args.repeat} runs, medians; steps kept after retention+gc: {runs[-1]['steps']}, "
        "all bit-exact"
    )
    print(f"full save (incremental=False): {full_s:.3f} s")
    print("| step | save s | vs full save | written MB | changed+metadata MB | ratio |")
    print("|---|---|---|---|---|---|")
    for i in range(5):
        seconds = statistics.median(run["rows"][i][1] for run in runs)
        written = statistics.median(run["rows"][i][2] for run in runs)
        needed = statistics.median(run["rows"][i][3] for run in runs)
        print(
            f"| {i + 1} | {seconds:.3f} | {seconds / full_s:.3f}x | {written / 1e6:.2f} | "
            f"{needed / 1e6:.2f} | {written / needed:.3f}x |"
        )


if __name__ == "__main__":
    main()
