"""Node loss: restoring a lost node's local tier from its peer, against the capped bucket.

    python benchmarks/node_loss.py                   # 1 GB in all, 3 rounds
    python benchmarks/node_loss.py --size-mb 256 --rounds 5

4 gloo ranks on this machine form 2 simulated nodes (ranks 0-1 and 2-3; each node's
local tier a directory on tmpfs ``/dev/shm``, as in memory), ``replicate=True``: each
rank's files also go to the rank at its position on the other node. The root is S3 on a
SeaweedFS server (``weed mini``) reached through :class:`tests.support.capped_proxy.CappedProxy`
(``--rate`` bytes/s for all traffic together, ``--latency`` per request): the capped
bucket of benchmarks/training_loop.py. Each rank holds ``--size-mb / 4`` of its own
float32 tensors (a sharded state: no rank reads another's files).

Protocol: every rank saves step 1 (blocking: committed and replicated on both nodes),
then waits until it is durable in the bucket; rank 0 keeps a copy of both tiers; one
warm-up load. Then ``--rounds`` rounds of three loads, the order rotating: **intact**:
nothing is lost, every rank loads from its node's tier; **peer**: node 1's tier is
deleted (node 1 lost), and every rank times ``mgr.load()`` (node 0's ranks send node 1
its ranks' files and the replicas it kept, then every rank loads from its node's tier);
**bucket**: both tiers are deleted (a pair lost), and every rank times ``mgr.load()``,
which reads the durable copy through the proxy; both tiers are then put back from the
copy. A load's time is the slowest rank's, from a barrier to the end of its
``mgr.load()``; every load is checked bit for bit. Bytes moved: what each rank sent
during the peer restore (``mgr.tiers.restored_bytes``) against its own data files. The
transport's floor: the same bytes sent memory to memory over gloo, both pairs at once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from storage.ops.manager import CheckpointManager  # noqa: E402
from tests.support.capped_proxy import CappedProxy  # noqa: E402
from tests.support.servers import SeaweedFS, s3_options  # noqa: E402

WORLD, PER_NODE = 4, 2
BUCKET = "bench"


def _state(rank: int, mb: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    count, numel = 8, int(mb * 1e6 / 4 / 8)
    return {f"r{rank}.t{i}": torch.randn(numel, generator=gen) for i in range(count)}


def _timed_load(mgr: CheckpointManager, rank: int, mb: float) -> tuple[float, str]:
    target = {k: torch.empty_like(v) for k, v in _state(rank, mb).items()}
    dist.barrier()
    t0 = time.perf_counter()
    step = mgr.load(target)
    elapsed = time.perf_counter() - t0
    expected = _state(rank, mb)
    assert all(torch.equal(target[k], expected[k]) for k in expected), "not bit-exact"
    assert step == 1
    return elapsed, getattr(step, "tier", "?")


def _raw_transfer(rank: int, nbytes: int) -> float:
    """Seconds to send ``nbytes`` from rank r to rank r + 2 (both pairs at once) from
    memory to memory over gloo, 16 MiB at a time: the transport's floor."""
    buffer = torch.zeros(16 << 20, dtype=torch.uint8)
    dist.barrier()
    t0 = time.perf_counter()
    left = nbytes
    while left:
        n = min(buffer.numel(), left)
        if rank < PER_NODE:
            dist.send(buffer[:n], rank + PER_NODE)
        else:
            dist.recv(buffer[:n], rank - PER_NODE)
        left -= n
    dist.barrier()
    return time.perf_counter() - t0


def worker(rank: int, args: argparse.Namespace, endpoint: str, work: str, queue: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{work}/store", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    mb = args.size_mb / WORLD
    tiers = [f"{work}/node{n}" for n in range(WORLD // PER_NODE)]
    prefix = [uuid.uuid4().hex[:8]]
    dist.broadcast_object_list(prefix, src=0)
    mgr = CheckpointManager(
        f"s3://{BUCKET}/{prefix[0]}",
        local=tiers[rank // PER_NODE],
        replicate=True,
        storage_options=s3_options(endpoint),
    )
    assert mgr.tiers is not None
    state = _state(rank, mb)
    t0 = time.perf_counter()
    mgr.save(1, state)
    saved = time.perf_counter() - t0
    mgr.wait()
    durable = time.perf_counter() - t0
    del state
    own = sum(
        os.path.getsize(os.path.join(tiers[rank // PER_NODE], "step-1", n))
        for n in os.listdir(os.path.join(tiers[rank // PER_NODE], "step-1"))
        if n.startswith(f"__{rank}_")
    )
    dist.barrier()
    if rank == 0:
        for t in tiers:
            shutil.copytree(t, t + ".copy")
    dist.barrier()
    _timed_load(mgr, rank, mb)  # warm-up: the first load in a process pays for imports
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        row: dict[str, Any] = {}
        cases = ["intact", "peer", "bucket"]
        for case in cases[r % 3 :] + cases[: r % 3]:
            dist.barrier()
            if rank == 0 and case != "intact":
                shutil.rmtree(tiers[1])
                if case == "bucket":
                    shutil.rmtree(tiers[0])
            before = mgr.tiers.restored_bytes
            elapsed, tier = _timed_load(mgr, rank, mb)
            row[case] = elapsed
            row[f"{case}_tier"] = tier
            if case == "peer":
                row["sent"] = mgr.tiers.restored_bytes - before
            dist.barrier()
            if rank == 0:
                for t in tiers:
                    shutil.rmtree(t, ignore_errors=True)
                    shutil.copytree(t + ".copy", t)
        rounds.append(row)
    mgr.wait()
    raw = _raw_transfer(rank, int(mb * 1e6))  # what a peer restore sends, per pair
    queue.put(
        {
            "rank": rank,
            "own": own,
            "save": saved,
            "durable": durable,
            "raw": raw,
            "rounds": rounds,
        }
    )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=100e6, help="proxy cap, bytes/s in all")
    parser.add_argument("--latency", type=float, default=0.005, help="proxy delay per request, s")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="dcp-node-loss-", dir="/dev/shm")
    try:
        with (
            SeaweedFS(bucket=BUCKET) as server,
            CappedProxy(server.url, rate=args.rate, latency=args.latency) as proxy,
        ):
            queue: Any = mp.get_context("spawn").SimpleQueue()
            mp.spawn(worker, args=(args, proxy.url, work, queue), nprocs=WORLD, join=True)
            results = sorted((queue.get() for _ in range(WORLD)), key=lambda r: r["rank"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(args, results)


def report(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    def slowest(case: str) -> list[float]:
        return [max(r["rounds"][i][case] for r in results) for i in range(args.rounds)]

    def cells(times: list[float]) -> str:
        return f"{statistics.median(times):.3f} | {', '.join(f'{x:.3f}' for x in times)}"

    peer, bucket = slowest("peer"), slowest("bucket")
    used = {(x["peer_tier"], x["bucket_tier"]) for r in results for x in r["rounds"]}
    total = sum(r["own"] for r in results)
    print(
        f"\n{args.size_mb:.0f} MB in all ({total / 1e6:.0f} MB of data files), 4 gloo ranks, "
        f"2 nodes, replicate=True; bucket capped at {args.rate / 1e6:.0f} MB/s + "
        f"{1e3 * args.latency:.0f} ms per request; {args.rounds} rounds; tiers (peer, "
        f"bucket) loaded: {sorted(used)}"
    )
    print(
        f"save (blocking, with replica): {max(r['save'] for r in results):.2f} s; durable "
        f"after {max(r['durable'] for r in results):.1f} s"
    )
    print("| load | median s | each round s |\n|---|---:|---|")
    print(f"| nothing lost: own node's tier | {cells(slowest('intact'))} |")
    print(f"| node 1 lost: from the peer | {cells(peer)} |")
    print(f"| both nodes lost: from the capped bucket | {cells(bucket)} |")
    raw = max(r["raw"] for r in results)
    moved = sum(statistics.median(x["sent"] for x in r["rounds"]) for r in results)
    print(
        f"floor of the peer restore's transport: {moved / 1e6:.0f} MB sent memory to memory "
        f"over gloo, both pairs at once: {raw:.3f} s ({moved / raw / 1e6:.0f} MB/s)"
    )
    ratio = statistics.median(bucket) / statistics.median(peer)
    print(
        f"peer restore: {ratio:.1f}x faster than the bucket (the bucket's floor at the "
        f"cap: {total / args.rate:.2f} s)"
    )
    for r in results:
        sent = statistics.median(x["sent"] for x in r["rounds"])
        print(
            f"rank {r['rank']}: own data files {r['own'] / 1e6:.1f} MB; sent in a peer "
            f"restore {sent / 1e6:.1f} MB ({sent / r['own']:.2f}x its own files)"
        )
    print("raw:", json.dumps(results))


if __name__ == "__main__":
    main()
