"""dcp-storage vs stock ``FsspecWriter``/``FsspecReader`` on one moto S3 server.

    python benchmarks/s3_compare.py                 # ~200 MB state dict, 1 timed round
    python benchmarks/s3_compare.py --size-mb 100 --repeat 3

moto is a single Python process and the bottleneck: its times are not S3's, only the
ratio between the two clients on the same server means something. Protocol: one small
warm-up save/load per client, then alternate stock/ours ``--repeat`` times and report
the median; then one load per client through a counting proxy for the bytes fetched
(GET body bytes of data objects / stored data bytes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import ZStandard as TorchZStandard
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import storage  # noqa: E402
from extensions import ZStandard  # noqa: E402
from tests.support.servers import (  # noqa: E402
    FaultProxy,
    boto3_client,
    create_bucket,
    list_keys,
    moto_endpoint,
    s3_options,
)

BUCKET = "bench"


def _state(size_mb: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    n = max(1, size_mb // 4)
    return {f"layer{i:03d}.weight": torch.randn(1 << 20, generator=gen) for i in range(n)}


def _blank(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.empty_like(v) for k, v in state.items()}


def _clients(endpoint: str, zstd: bool = False) -> dict[str, tuple[Callable, Callable]]:
    opts = s3_options(endpoint)
    ours_chain = [ZStandard()] if zstd else []
    stock_chain = [TorchZStandard()] if zstd else None

    def ours_save(state: dict, url: str) -> None:
        storage.save(state, url, storage_options=opts, transforms=ours_chain)

    def ours_load(state: dict, url: str) -> None:
        storage.load(state, url, storage_options=opts)

    def stock_save(state: dict, url: str) -> None:
        dcp.save(state, storage_writer=FsspecWriter(url, _extensions=stock_chain, **opts))

    def stock_load(state: dict, url: str) -> None:
        dcp.load(state, storage_reader=FsspecReader(url, **opts))

    return {"stock": (stock_save, stock_load), "ours": (ours_save, ours_load)}


def _timed(fn: Callable, *args: object) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--zstd", action="store_true", help="both clients compress with zstd")
    args = parser.parse_args()

    endpoint = moto_endpoint()
    create_bucket(endpoint, BUCKET)
    s3 = boto3_client(endpoint)
    state = _state(args.size_mb)
    logical = sum(t.numel() * t.element_size() for t in state.values())
    clients = _clients(endpoint, args.zstd)
    small = _state(8)
    for save, load in clients.values():  # warm-up: clients, service models, threads
        url = f"s3://{BUCKET}/warm-{uuid.uuid4().hex}"
        save(small, url)
        load(_blank(small), url)

    times: dict[str, dict[str, list[float]]] = {c: {"save": [], "load": []} for c in clients}
    urls: dict[str, str] = {}
    for _ in range(args.repeat):
        for name, (save, load) in clients.items():
            url = f"s3://{BUCKET}/{name}-{uuid.uuid4().hex}"
            times[name]["save"].append(_timed(save, state, url))
            target = _blank(state)
            times[name]["load"].append(_timed(load, target, url))
            assert all(torch.equal(target[k], state[k]) for k in state), name
            urls[name] = url

    ratios = {}
    with FaultProxy(endpoint) as proxy:
        for name, (_, load) in _clients(proxy.url, args.zstd).items():
            prefix = urls[name].removeprefix(f"s3://{BUCKET}/") + "/"
            stored = sum(
                s3.head_object(Bucket=BUCKET, Key=k)["ContentLength"]
                for k in list_keys(s3, BUCKET, prefix)
                if k.endswith(".distcp")
            )
            proxy.clear()
            load(_blank(state), urls[name])
            ratios[name] = proxy.get_bytes(r"\.distcp") / stored

    mb = logical / 1e6
    print(
        f"state dict: {len(state)} tensors, {mb:.0f} MB; moto at {endpoint}; "
        f"repeat={args.repeat}; zstd={args.zstd}"
    )
    print(f"{'client':8} {'save s':>8} {'MB/s':>7} {'load s':>8} {'MB/s':>7} {'fetched':>8}")
    for name in clients:
        save_s = statistics.median(times[name]["save"])
        load_s = statistics.median(times[name]["load"])
        print(
            f"{name:8} {save_s:8.2f} {mb / save_s:7.1f} {load_s:8.2f} {mb / load_s:7.1f} "
            f"{ratios[name]:7.2f}x"
        )
    for op in ("save", "load"):
        ratio = statistics.median(times["stock"][op]) / statistics.median(times["ours"][op])
        print(f"{op}: stock/ours time ratio {ratio:.2f} (> 1: ours faster)")


if __name__ == "__main__":
    main()
