"""Replicated loads from a capped bucket: 8 ranks, read-once against the S3 peers.

    python benchmarks/replicated_load.py                      # 8 ranks, 128 MB, 2 rounds
    python benchmarks/replicated_load.py --size-mb 256 --repeat 3 --rate 100e6

Every rank loads the same full state dict (a model replicated under DDP: every rank
needs every byte) from one SeaweedFS (``weed mini``) behind
:class:`tests.support.capped_proxy.CappedProxy` (``--rate`` bytes per second for all ranks and
both directions together, ``--latency`` per request): the bucket the ranks share is
the limit, as it is for a job on many nodes. Rows, in the same run: ours
(``storage.load``, ``read_once`` left at its default, which is on for S3), ours with
``read_once=False``, stock ``FsspecReader`` and s3torchconnector's ``S3StorageReader``
(its CRT client pointed at the server with ``endpoint=``, ``force_path_style=True``),
each through ``dcp.load``.

Protocol: ``--ranks`` gloo processes (CPU; on this 2-core machine all ranks share the
two cores, the server and the proxy too) started once. The state (2048x2048 tensors,
bf16 with every fifth fp32, as benchmarks/s3_peers.py builds it) is saved once by the
parent with ours, no transforms (a format every reader here loads). Each rank builds
its target once and zeroes it before every load. Each client loads a small checkpoint
first (warm-up: imports, clients, connection pools), then the clients take turns, the
order rotating every round. A load is timed on every rank from a barrier to its end;
the row's time is the slowest rank's, median over the rounds. Bytes fetched are the
bytes the proxy relayed from the server during the load (bodies and headers, all
ranks), against the stored bytes of the data files. Every load is checked bit-exact
(CRC-32C per tensor), untimed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import queue
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from typing import Any

import crc32c
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import storage  # noqa: E402
from benchmarks.s3_peers import BUCKET, REGION, build_state  # noqa: E402
from tests.support.capped_proxy import CappedProxy  # noqa: E402
from tests.support.servers import KEY, SECRET, SeaweedFS, s3_options  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
MB = 1e6
CLIENTS = ("ours", "ours, read_once=False", "stock fsspec", "s3torchconnector")


def _crcs(state: dict[str, torch.Tensor]) -> dict[str, int]:
    return {k: crc32c.crc32c(v.view(torch.uint8).numpy()) for k, v in state.items()}


def _loader(name: str, endpoint: str) -> Any:
    """``load(target, url)`` for client ``name`` (imports done here, untimed)."""
    opts = s3_options(endpoint)
    if name.startswith("ours"):
        import storage.backends.s3  # noqa: F401

        once = None if name == "ours" else False
        return lambda target, url: storage.load(target, url, storage_options=opts, read_once=once)
    if name == "stock fsspec":
        import s3fs  # noqa: F401
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return lambda target, url: dcp.load(target, storage_reader=FsspecReader(url, **opts))
    import s3torchconnector.dcp.s3_file_system as s3tc_fs
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3StorageReader

    # Its DCP filesystem builds S3Client(region, ...) without an endpoint.
    if not isinstance(s3tc_fs.S3Client, functools.partial):
        s3tc_fs.S3Client = functools.partial(S3Client, endpoint=endpoint)  # type: ignore[misc]
    os.environ.setdefault("AWS_ACCESS_KEY_ID", KEY)
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", SECRET)
    config = S3ClientConfig(force_path_style=True)
    return lambda target, url: dcp.load(
        target, storage_reader=S3StorageReader(REGION, url, s3client_config=config)
    )


def _worker(rank: int, world: int, store: str, job: dict[str, Any], ask: Any, answer: Any) -> None:
    """One rank: warm-up loads, then ``repeat`` rounds of every client; rank 0 asks the
    parent for the proxy's byte count around each load and sends the results."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    loaders = {name: _loader(name, job["endpoint"]) for name in CLIENTS}
    target = {k: torch.empty_like(v) for k, v in build_state(job["size_mb"]).items()}
    small = {k: torch.empty_like(v) for k, v in build_state(job["warm_mb"]).items()}

    def received() -> int:
        dist.barrier()
        value = 0
        if rank == 0:
            ask.put("count")
            value = answer.get()
        dist.barrier()
        return value

    for load in loaders.values():
        load(small, job["warm_url"])
    results: dict[str, list[dict[str, float]]] = {name: [] for name in CLIENTS}
    for round_ in range(job["repeat"]):
        shift = round_ % len(CLIENTS)
        for name in CLIENTS[shift:] + CLIENTS[:shift]:
            for tensor in target.values():
                tensor.zero_()
            before = received()
            start = time.perf_counter()
            loaders[name](target, job["url"])
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            fetched = received() - before
            if _crcs(target) != job["crcs"]:
                raise AssertionError(f"rank {rank}: {name} loaded tensors that differ")
            results[name].append({"s": float(elapsed), "fetched": fetched})
    if rank == 0:
        ask.put(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _save(state: dict[str, torch.Tensor], url: str, endpoint: str) -> int:
    """Save ``state`` at ``url`` (ours, no transforms); its stored data bytes."""
    storage.save(state, url, storage_options=s3_options(endpoint))
    md = storage.CheckpointReader(url, storage_options=s3_options(endpoint)).read_metadata()
    return sum(info.length for info in md.storage_data.values())


def run(args: argparse.Namespace, server: SeaweedFS, proxy: CappedProxy) -> None:
    prefix = f"replicated-{uuid.uuid4().hex}"
    url, warm_url = f"s3://{BUCKET}/{prefix}/full", f"s3://{BUCKET}/{prefix}/warm"
    state = build_state(args.size_mb)
    logical = sum(t.numel() * t.element_size() for t in state.values())
    stored = _save(state, url, server.url)
    _save(build_state(args.warm_mb), warm_url, server.url)
    job = {
        "endpoint": proxy.url,
        "url": url,
        "warm_url": warm_url,
        "size_mb": args.size_mb,
        "warm_mb": args.warm_mb,
        "repeat": args.repeat,
        "crcs": _crcs(state),
    }
    del state
    ctx = mp.get_context("spawn")
    ask, answer = ctx.Queue(), ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = mp.start_processes(
            _worker,
            args=(args.ranks, os.path.join(tmp, "store"), job, ask, answer),
            nprocs=args.ranks,
            join=False,
            start_method="spawn",
        )
        cpu_before = proxy.cpu_seconds()
        while True:  # serve rank 0's byte counts until it sends the results
            try:
                message = ask.get(timeout=1)
            except queue.Empty:
                procs.join(timeout=0.01)  # raises if a rank failed
                continue
            if message != "count":
                break
            answer.put(proxy.bytes_down)
        procs.join()
    results = json.loads(message)
    report(args, results, logical, stored, proxy.cpu_seconds() - cpu_before)


def report(
    args: argparse.Namespace,
    results: dict[str, list[dict[str, float]]],
    logical: int,
    stored: int,
    proxy_cpu: float,
) -> None:
    rate = args.rate
    med = {n: statistics.median(r["s"] for r in rs) for n, rs in results.items()}
    print(
        f"\n{args.ranks} gloo ranks (CPU, all on this machine's 2 cores with the server and "
        f"the proxy), every rank loading the same {logical / MB:.0f} MB state dict "
        f"({stored / MB:.0f} MB stored) from SeaweedFS behind the capped proxy "
        f"({rate / MB:.0f} MB/s for all traffic, {args.latency * 1e3:.0f} ms per request); "
        "slowest rank, median of "
        f"{args.repeat} after a warm-up; proxy CPU {proxy_cpu:.1f} s in all"
    )
    print(
        "| client | load s | vs stock | vs s3torchconnector | MB fetched | fetched / stored "
        "| fetched bytes' time at the cap, s |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, rs in results.items():
        fetched = statistics.median(r["fetched"] for r in rs)
        print(
            f"| {name} | {med[name]:.2f} | {med['stock fsspec'] / med[name]:.2f}x "
            f"| {med['s3torchconnector'] / med[name]:.2f}x | {fetched / MB:.0f} "
            f"| {fetched / stored:.3f}x | {fetched / rate:.2f} |"
        )
    print(
        f"\nThe floor at the cap: the stored bytes once, {stored / rate:.2f} s; once per "
        f"rank, {args.ranks * stored / rate:.2f} s. vs X = X's time / this row's (> 1: faster)."
    )
    print("raw samples:", json.dumps(results))
    print("raw sizes:", json.dumps({"logical": logical, "stored": stored, "rate": rate}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--size-mb", type=float, default=128)
    parser.add_argument("--warm-mb", type=float, default=8)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--rate", type=float, default=100e6, help="proxy cap, bytes/s in all")
    parser.add_argument("--latency", type=float, default=0.005, help="proxy delay per request, s")
    args = parser.parse_args()
    with (
        SeaweedFS(bucket=BUCKET) as server,
        CappedProxy(server.url, rate=args.rate, latency=args.latency) as proxy,
    ):
        run(args, server, proxy)


if __name__ == "__main__":
    main()
