"""Preemption: from SIGTERM to the step committed in the local tier.

    python benchmarks/preemption.py                      # every case, 3 rounds
    python benchmarks/preemption.py --cases 1gb-shm --rounds 5

Each round of a case is a fresh process (the job) that builds its state, creates a
tiered manager (``local=`` on tmpfs ``/dev/shm`` or on the local disk, the root a
directory on disk: the drain is not timed) and ``mgr.save_on_signal(state_fn)``, then
trains, calling ``guard.should_stop(step)`` after every step. This process sends it
SIGTERM at a random point of a step (seeded) and takes the time; the job reports when
``should_stop`` began the save (the step boundary) and when it returned (the step
committed locally), on the same monotonic clock.

States: ``loop``, the training-loop benchmark's (benchmarks/training_loop.py: its
transformer and AdamW after 3 steps, ~260 MB; a step is a real training step, ~0.3 s);
``1gb``, ``benchmarks.bench.build_state_dict(1024)`` with a 20 ms sleep as the step.
``-inflight``: an asynchronous save of the previous step is in flight when the signal
lands (the job signals this process right after it returns), so the preemption save
waits for its local commit first.

Beside each case, in the same process before the loop, the floors (best of 3):
``copy``: the state's tensors copied into buffers allocated beforehand (one copy of the
state in memory); ``write``: their bytes written to files on the same tier, as many
files at once as the writer has threads (one copy into the page cache, with ``fsync``
on disk): the least a commit to that tier costs.

Then the per-step cost of the guard without a signal: ``should_stop`` on one process
(a flag) and on 2 gloo ranks (a 4-number all-reduce on the guard's own group).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench import build_state_dict  # noqa: E402
from storage.backends._local import LocalFileSystem  # noqa: E402

CASES = {  # name: (state, tier, save in flight)
    "loop-shm": ("loop", "shm", False),
    "loop-disk": ("loop", "disk", False),
    "1gb-shm": ("1gb", "shm", False),
    "1gb-disk": ("1gb", "disk", False),
    "1gb-shm-inflight": ("1gb", "shm", True),
}
STEP_SLEEP = 0.02  # the 1gb state's "training step"


# --- the job -------------------------------------------------------------------------------


def _loop_state() -> tuple[Callable[[], dict[str, Any]], Callable[[], None]]:
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from benchmarks.training_loop import SIZES, TinyLM

    vocab, width, layers, batch, seq = SIZES["full"]
    torch.manual_seed(0)
    model = TinyLM(vocab, width, layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = torch.Generator().manual_seed(1000)

    def train_step() -> None:
        tokens = torch.randint(vocab, (batch, seq + 1), generator=batches)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def state() -> dict[str, Any]:
        model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optim": optim_state}

    for _ in range(3):  # AdamW's moments exist after the first step
        train_step()
    return state, train_step


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


def _floors(tensors: list[torch.Tensor], directory: str, sync: bool) -> dict[str, float]:
    """The best of 3 of each floor: ``copy`` (into buffers allocated and touched
    beforehand) and ``write`` (the bytes into files on the tier, as many files written
    at once as the writer's threads, each ``fsync``-ed on disk)."""
    buffers = [torch.empty_like(t) for t in tensors]
    copies = []
    for _ in range(4):  # the first one touches the buffers' pages
        t0 = time.perf_counter()
        for b, t in zip(buffers, tensors):
            b.copy_(t)
        copies.append(time.perf_counter() - t0)
    del buffers
    threads = LocalFileSystem().io_concurrency

    def write(part: int) -> None:
        with open(os.path.join(directory, f"{part}.bin"), "wb") as f:
            for t in tensors[part::threads]:
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            if sync:
                f.flush()
                os.fsync(f.fileno())

    writes = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(3):
            os.makedirs(directory)
            t0 = time.perf_counter()
            list(pool.map(write, range(threads)))
            writes.append(time.perf_counter() - t0)
            shutil.rmtree(directory)
    return {"copy": min(copies[1:]), "write": min(writes), "threads": threads}


def child(args: argparse.Namespace) -> None:
    from storage.ops.manager import CheckpointManager

    kind, tier, inflight = CASES[args.child]
    if kind == "loop":
        state_fn, train_step = _loop_state()
    else:
        state = build_state_dict(1024)
        state_fn = lambda: state  # noqa: E731

        def train_step() -> None:
            state["layer00.weight"][0, 0] += 1
            time.sleep(STEP_SLEEP)

    tensors = _tensors(state_fn())
    floors = _floors(tensors, os.path.join(args.local, "floor"), sync=tier == "disk")
    mgr = CheckpointManager(args.root, local=os.path.join(args.local, "tier"))
    guard = mgr.save_on_signal(state_fn, grace=120)
    print("@ready", flush=True)
    step = 0
    while True:
        step += 1
        train_step()
        if inflight and step == 3:
            mgr.save(step, state_fn(), blocking=False)
            os.kill(os.getppid(), signal.SIGUSR1)  # "signal me now"
        t0 = time.monotonic()
        if guard.should_stop(step):
            t1 = time.monotonic()
            break
    result = {
        "boundary": t0,
        "commit": t1,
        "saved": guard.saved,
        "error": None if guard.error is None else str(guard.error),
        "bytes": sum(t.numel() * t.element_size() for t in tensors),
        **floors,
    }
    print("@result", json.dumps(result), flush=True)
    os._exit(0)  # the drain is not timed: leave it


# --- this process ------------------------------------------------------------------------


def run_case(name: str, rounds: int, rng: random.Random) -> list[dict[str, Any]]:
    kind, tier, inflight = CASES[name]
    base = "/dev/shm" if tier == "shm" else tempfile.gettempdir()
    out = []
    poked = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: poked.set())
    for _ in range(rounds):
        poked.clear()
        work = tempfile.mkdtemp(prefix="dcp-preempt-", dir=base)
        root = tempfile.mkdtemp(prefix="dcp-preempt-root-")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name]
        proc = subprocess.Popen(
            [*cmd, "--local", work, "--root", root], stdout=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().startswith("@ready"), "the job did not start"
            if inflight:
                poked.wait(120)
            else:
                step = 0.3 if kind == "loop" else STEP_SLEEP
                time.sleep(1.0 + rng.uniform(0, step))
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            line = proc.stdout.readline()
            proc.wait(60)
            if not line.startswith("@result"):
                raise RuntimeError(f"{name}: the job printed {line!r}")
            result = json.loads(line.split(" ", 1)[1])
            if result["saved"] is None:
                raise RuntimeError(f"{name}: nothing saved: {result['error']}")
            result.update(sent=sent)
            out.append(result)
            print(
                f"  {name}: signal -> commit {result['commit'] - sent:.3f} s",
                flush=True,
            )
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(root, ignore_errors=True)
    return out


def guard_cost(calls: int) -> dict[str, float]:
    """Median seconds per ``should_stop`` call without a signal: 1 process, 2 gloo ranks."""
    import torch.multiprocessing as mp

    store = tempfile.mkdtemp(prefix="dcp-preempt-cost-")
    try:
        single = _cost_worker(0, 1, "", store, calls)
        queue: Any = mp.get_context("spawn").SimpleQueue()
        mp.spawn(_cost_spawned, args=(store, calls, queue), nprocs=2, join=True)
        two = max(queue.get(), queue.get())
    finally:
        shutil.rmtree(store, ignore_errors=True)
    return {"1 process": single, "2 gloo ranks": two}


def _cost_spawned(rank: int, store: str, calls: int, queue: Any) -> None:
    queue.put(_cost_worker(rank, 2, f"{store}/pg", store, calls))


def _cost_worker(rank: int, world: int, pg_store: str, work: str, calls: int) -> float:
    import torch.distributed as dist

    from storage.ops.manager import CheckpointManager

    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"file://{pg_store}", rank=rank, world_size=world
        )
    mgr = CheckpointManager(f"{work}/root", local=f"{work}/local-{world}")
    previous = signal.getsignal(signal.SIGTERM)
    with mgr.save_on_signal(dict) as guard:
        times = []
        for step in range(calls):
            t0 = time.perf_counter()
            guard.should_stop(step)
            times.append(time.perf_counter() - t0)
    signal.signal(signal.SIGTERM, previous)
    if world > 1:
        dist.destroy_process_group()
    return statistics.median(times)


def report(name: str, results: list[dict[str, Any]]) -> None:
    to_boundary = [r["boundary"] - r["sent"] for r in results]
    save = [r["commit"] - r["boundary"] for r in results]
    total = [r["commit"] - r["sent"] for r in results]
    mb = results[0]["bytes"] / 1e6
    copy = statistics.median(r["copy"] for r in results)
    write = statistics.median(r["write"] for r in results)
    cells = [
        name,
        f"{mb:.0f}",
        f"{statistics.median(to_boundary):.3f}",
        f"{statistics.median(save):.3f} / {max(save):.3f}",
        f"{statistics.median(total):.3f} / {max(total):.3f}",
        f"{copy:.3f}",
        f"{write:.3f}",
        f"{statistics.median(save) / write:.2f}x",
    ]
    print("| " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2000, help="should_stop calls timed")
    parser.add_argument("--seed", type=int, default=0)
    for hidden in ("--child", "--local", "--root"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    rng = random.Random(args.seed)
    results = {name: run_case(name, args.rounds, rng) for name in args.cases}
    print(
        "\n| case | state MB | signal -> step boundary s | save (boundary -> local "
        "commit) s, median / max | signal -> local commit s, median / max | floor: copy "
        "s | floor: write s | save / write floor |"
    )
    print("|---" * 8 + "|")
    for name, runs in results.items():
        report(name, runs)
    cost = guard_cost(args.calls)
    print(
        "\nshould_stop without a signal, median per call: "
        + ", ".join(f"{k} {1e6 * v:.1f} us" for k, v in cost.items())
    )
    print("raw:", json.dumps(results))


if __name__ == "__main__":
    main()
