"""Tiered checkpoints: blocking time of a save, time to durable, restore per tier.

    python benchmarks/tiers.py                      # 1 GB state dict, 3 repeats
    python benchmarks/tiers.py --size-mb 256 --repeat 5
    python benchmarks/tiers.py --only-replication --replication-ranks 4

The durable tier is S3 on a SeaweedFS server started here (``weed mini``, on disk,
loopback); the local tier and the plain save go to the same local disk. Protocol: the
state dict is built once (seeded); one warm-up round, then ``--repeat`` rounds, each:
a plain local save (``storage.save``) and a tiered save with no drain in flight (its
blocking time, then ``wait()``: time from the save's start to durable), in alternating
order, each after ``os.sync()`` so neither pays the other's write-back; then the same
pair under a drain, again alternating: a tiered save issued while the previous step's
drain still runs (it starts a third of an idle drain's time after the previous save
returned, so it lands mid-copy) and a plain save next to it; an asynchronous tiered
save (``blocking=False``: the time to return, which is staging, and to the local
commit); then a restore from the local tier and one from the bucket (``storage.load``
of the durable copy). Medians are reported; the page cache stays warm.

Then peer replication (``--replication-ranks``, default 2; see :func:`replication`):
gloo ranks on loopback, one simulated node each, saving with and without
``replicate=True``; the bytes each rank sent per replica and the seconds replication
adds to a save.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import storage  # noqa: E402
from benchmarks.bench import build_state_dict  # noqa: E402

MB = 1e6
BUCKET = "tiers"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_seaweed(directory: str) -> tuple[subprocess.Popen[bytes], str]:
    """``weed mini`` on free ports; returns the process and the S3 endpoint."""
    weed = shutil.which("weed") or os.path.join(os.path.dirname(sys.executable), "weed")
    ports = {name: _free_port() for name in ("s3", "master", "volume", "filer")}
    cmd = [weed, "mini", f"-dir={directory}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
    cmd += [f"-bucket={BUCKET}", "-admin.ui=false", "-webdav=false"]
    cmd += [f"-{name}.port={port}" for name, port in ports.items()]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{ports['s3']}"
    for _ in range(600):
        try:
            urllib.request.urlopen(f"{endpoint}/{BUCKET}", timeout=1)
            return proc, endpoint
        except urllib.error.HTTPError:
            return proc, endpoint  # it answers (an S3 error body is fine)
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("SeaweedFS did not start")


def _timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--replication-ranks",
        type=int,
        default=2,
        help="gloo ranks (one simulated node each) for the replication part; 0 skips it",
    )
    parser.add_argument("--only-replication", action="store_true")
    args = parser.parse_args()
    if not args.only_replication:
        tiers(args)
    if args.replication_ranks:
        replication(args.size_mb, args.repeat, args.replication_ranks)


def tiers(args: argparse.Namespace) -> None:
    work = tempfile.mkdtemp(prefix="dcp-tiers-")
    proc, endpoint = start_seaweed(os.path.join(work, "weed"))
    try:
        options = {"endpoint_url": endpoint, "key": "any", "secret": "any"}
        state = build_state_dict(args.size_mb)
        logical = (
            sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
            / MB
        )
        root = f"s3://{BUCKET}/run"
        mgr = storage.CheckpointManager(
            root, storage_options=options, local=os.path.join(work, "local"), keep_local=2
        )
        rows: dict[str, list[float]] = {}
        step = 0
        for round_ in range(args.repeat + 1):
            plain = os.path.join(work, "plain")
            shutil.rmtree(plain, ignore_errors=True)
            step += 1
            # Alternate which save goes first; flush the page cache's dirty data before
            # each, so neither pays for the other's write-back.
            for first in ("plain", "tiered") if round_ % 2 else ("tiered", "plain"):
                os.sync()
                if first == "plain":
                    t_plain, _ = _timed(storage.save, state, plain)
                else:
                    start = time.perf_counter()
                    mgr.save(step, state)
                    t_block = time.perf_counter() - start
                    mgr.wait()
                    t_durable = time.perf_counter() - start
            # The same pair under a drain: a tiered save issued while the previous step's
            # drain runs, and a plain save next to it (this machine is shared: a plain
            # save minutes away is no baseline for this one).
            for first in ("tiered", "plain") if round_ % 2 else ("plain", "tiered"):
                os.sync()
                if first == "plain":
                    shutil.rmtree(plain, ignore_errors=True)
                    t_plain_next, _ = _timed(storage.save, state, plain)
                    continue
                step += 1
                mgr.save(step, state)  # its drain runs while the next save blocks
                # Let the drain get going (a third of its idle time): the next save lands
                # mid-copy, as a save during training does, not before the copy starts.
                time.sleep((t_durable - t_block) / 3)
                step += 1
                t_block_busy, _ = _timed(mgr.save, step, state)
                mgr.wait()
            os.sync()
            step += 1
            start = time.perf_counter()
            future = mgr.save(step, state, blocking=False)
            t_async = time.perf_counter() - start
            future.result()
            t_async_local = time.perf_counter() - start
            mgr.wait()
            target = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
            t_local, loaded = _timed(mgr.load, target, step)
            assert loaded.tier == "local"
            url = mgr.step_url(step)
            t_bucket, _ = _timed(storage.load, target, url, storage_options=options)
            if round_ == 0:
                continue  # warm-up
            for name, value in (
                ("plain local save", t_plain),
                ("tiered save, blocking", t_block),
                ("plain local save, next to the one below", t_plain_next),
                ("tiered save, blocking, drain in flight", t_block_busy),
                ("tiered save, blocking=False, returns", t_async),
                ("tiered save, blocking=False, local commit", t_async_local),
                ("save to durable", t_durable),
                ("restore from local tier", t_local),
                ("restore from bucket", t_bucket),
            ):
                rows.setdefault(name, []).append(value)
        med = {k: statistics.median(v) for k, v in rows.items()}
        print(f"state dict: {len(state)} tensors, {logical:.0f} MB; SeaweedFS at {endpoint}")
        print(f"medians of {args.repeat} rounds (after one warm-up)")
        for name, value in med.items():
            print(f"  {name:<42} {value:7.2f} s  {logical / value:8.0f} MB/s")
        plain_s = med["plain local save"]
        busy = med["tiered save, blocking, drain in flight"]
        print(
            f"  tiered/plain blocking: {med['tiered save, blocking'] / plain_s:.2f}x idle, "
            f"{busy / med['plain local save, next to the one below']:.2f}x drain in flight "
            f"({busy / plain_s:.2f}x the first plain save)"
        )
        print(
            "  restore bucket/local: "
            f"{med['restore from bucket'] / med['restore from local tier']:.1f}x"
        )
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)


def replication(size_mb: float, repeat: int, ranks: int) -> None:
    """Peer replication over gloo on loopback: ``ranks`` processes, each its own
    simulated node (a local tier of its own), each saving ``size_mb / ranks`` of its
    own tensors. Per round, a tiered save with ``replicate=True`` (each rank's files
    also go to the next node) and one without, in alternating order, the root on local
    disk and each drain waited for before the next save; the difference of the blocking
    times is what replication costs a save."""
    work = tempfile.mkdtemp(prefix="dcp-replication-")
    try:
        mp.spawn(_replication_rank, args=(ranks, work, size_mb, repeat), nprocs=ranks)
        with open(os.path.join(work, "result.json")) as f:
            result = json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    own, sent = result["own_mb"], result["sent_mb"]
    plain, repl = result["plain"], result["replicated"]
    extra = repl - plain
    print(
        f"replication: {ranks} gloo ranks on loopback, one simulated node each, "
        f"{own:.0f} MB of data files per rank; medians of {repeat} rounds (after one warm-up)"
    )
    print(f"  tiered save, no replica              {plain:7.2f} s")
    print(f"  tiered save, replicate=True          {repl:7.2f} s")
    print(
        f"  replication: {sent:.0f} MB sent per rank ({sent / own:.2f}x its own files), "
        f"+{extra:.2f} s, {sent / extra if extra > 0 else float('inf'):.0f} MB/s per rank"
    )


def _replication_rank(rank: int, world: int, work: str, size_mb: float, repeat: int) -> None:
    store = os.path.join(work, "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    built = build_state_dict(size_mb / world, seed=rank)
    state = {f"rank{rank}.{k}": v for k, v in built.items()}  # each rank's own tensors
    node = os.path.join(work, f"node{rank}")
    managers = {
        name: storage.CheckpointManager(
            os.path.join(work, f"durable-{name}"),
            local=os.path.join(node, name),
            keep_local=1,
            replicate=name == "replicated",
        )
        for name in ("plain", "replicated")
    }
    times: dict[str, list[float]] = {name: [] for name in managers}
    for round_ in range(repeat + 1):
        order = list(managers) if round_ % 2 else list(reversed(managers))
        for name in order:
            mgr = managers[name]
            if rank == 0:
                os.sync()
            dist.barrier()
            start = time.perf_counter()
            mgr.save(round_, state)
            elapsed = time.perf_counter() - start
            mgr.wait()
            if round_:
                times[name].append(elapsed)
    tier = managers["replicated"].tiers
    assert tier is not None
    step_dir = os.path.join(node, "replicated", f"step-{repeat}")
    own = sum(
        os.path.getsize(os.path.join(step_dir, n))
        for n in os.listdir(step_dir)
        if n.startswith(f"__{rank}_")
    )
    # Slowest rank per round: a save returns on every rank together.
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (times, tier.replicated_bytes / (repeat + 1), own))
    if rank == 0:
        slowest = {
            name: statistics.median(max(g[0][name][i] for g in gathered) for i in range(repeat))
            for name in managers
        }
        result = {
            "plain": slowest["plain"],
            "replicated": slowest["replicated"],
            "sent_mb": statistics.mean(g[1] for g in gathered) / MB,
            "own_mb": statistics.mean(g[2] for g in gathered) / MB,
        }
        with open(os.path.join(work, "result.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    # gloo's threads and the interpreter's teardown do not mix (tests/support/distributed.py)
    os._exit(0)


if __name__ == "__main__":
    main()
