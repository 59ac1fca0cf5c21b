"""dcp-storage against its S3 peers on one SeaweedFS server, with a raw ceiling row.

    python benchmarks/s3_peers.py                         # 268 MB, warm-up + median of 3
    python benchmarks/s3_peers.py --size-mb 128 --repeat 3 --zstd
    python benchmarks/s3_peers.py --capped --zstd --shuffle  # the capped-bucket profile

Rows: ours (``storage.CheckpointWriter`` / ``CheckpointReader`` through ``dcp.save`` /
``dcp.load``), stock ``FsspecWriter`` / ``FsspecReader`` (``thread_count=8``),
s3torchconnector's ``S3StorageWriter`` / ``S3StorageReader`` (``thread_count=8``, its
CRT client pointed at the server with ``endpoint=`` and ``force_path_style=True``),
with ``--zstd`` also ours with ``extensions.ZStandard()``, with ``--shuffle`` also ours
with ``[ByteShuffle(), ZStandard()]``; and a raw ceiling: 8 objects x 32 MiB PUT then
GET in 8 threads with boto3, no DCP.

Two profiles. The default reaches SeaweedFS directly on loopback, so the server's and
the client's CPU on the same two cores are the limit. ``--capped`` puts
:class:`tests.support.capped_proxy.CappedProxy` between every client (the raw ceiling and the
fresh-process loads too) and the server: ``--rate`` bytes per second for both directions
together (default 100 MB/s) and ``--latency`` per request (default 5 ms), the regime of
a bucket that many ranks share, where bandwidth, not CPU, is the limit. The table then
also gives the bytes each save sent and each load received through the proxy, and the
floor those bytes set at the cap.

Protocol: one ``weed mini`` on free ports (``tests.support.servers.SeaweedFS``), one seeded
state dict of 2048x2048 tensors (bf16, every fifth fp32) built once. Each client saves
and loads a small state dict once as a warm-up, then the clients take turns (the order
rotates every round) ``--repeat`` times; every save goes to a fresh prefix. Saves run in
this long-lived process (a training job that checkpoints; clients warm). Every load
runs in a fresh process (a restarted job: module imports, target allocation and the
check untimed; client construction, metadata read and data timed), checked bit-exact.
Client CPU is user+sys of the process doing the timed call (``getrusage``), per GB of
logical bytes; the server's own CPU is not in it, but it shares the same two cores.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support.capped_proxy import CappedProxy  # noqa: E402
from tests.support.servers import KEY, SECRET, SeaweedFS, boto3_client, s3_options  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
BUCKET = "bench"
REGION = "us-east-1"
MB = 1e6
SaveFn = Callable[[dict[str, Any], str], None]
LoadFn = Callable[[dict[str, Any], str], None]


def build_state(size_mb: float, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    total = 0
    while total < size_mb * MB:
        i = len(state)
        dtype = torch.float32 if i % 5 == 4 else torch.bfloat16
        tensor = (torch.randn(2048, 2048, generator=gen) * 0.02).to(dtype)
        state[f"layer{i:03d}.weight"] = tensor
        total += tensor.numel() * tensor.element_size()
    return state


def logical_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# --- clients -------------------------------------------------------------------------


def _ours(endpoint: str, transforms: str) -> tuple[SaveFn, LoadFn]:
    import storage
    import storage.backends.s3  # noqa: F401 - imported untimed, as the peers' modules are
    from extensions import ByteShuffle, ZStandard

    opts = s3_options(endpoint)
    chains: dict[str, list[Any]] = {
        "": [],
        "zstd": [ZStandard()],
        "shuffle+zstd": [ByteShuffle(), ZStandard()],
    }
    chain = chains[transforms]

    def save(state: dict[str, Any], url: str) -> None:
        writer = storage.CheckpointWriter(url, transforms=chain, storage_options=opts)
        dcp.save(state, storage_writer=writer)

    def load(state: dict[str, Any], url: str) -> None:
        dcp.load(state, storage_reader=storage.CheckpointReader(url, storage_options=opts))

    return save, load


def _stock(endpoint: str, transforms: str) -> tuple[SaveFn, LoadFn]:
    import s3fs  # noqa: F401 - imported untimed, as the other clients' modules are
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    opts = s3_options(endpoint)
    chain = {"": None, "zstd": [ZStandard()]}[transforms]

    def save(state: dict[str, Any], url: str) -> None:
        writer = FsspecWriter(url, thread_count=8, _extensions=chain, **opts)
        dcp.save(state, storage_writer=writer)

    def load(state: dict[str, Any], url: str) -> None:
        dcp.load(state, storage_reader=FsspecReader(url, **opts))

    return save, load


def _s3torchconnector(endpoint: str, transforms: str) -> tuple[SaveFn, LoadFn]:
    import s3torchconnector.dcp.s3_file_system as s3tc_fs
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
    from torch.distributed.checkpoint._extension import ZStandard

    # Its DCP filesystem builds S3Client(region, ...) without an endpoint.
    if not isinstance(s3tc_fs.S3Client, functools.partial):
        s3tc_fs.S3Client = functools.partial(S3Client, endpoint=endpoint)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", KEY)
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", SECRET)
    config = S3ClientConfig(force_path_style=True)
    chain = {"": None, "zstd": [ZStandard()]}[transforms]

    def save(state: dict[str, Any], url: str) -> None:
        writer = S3StorageWriter(
            REGION, url, s3client_config=config, thread_count=8, _extensions=chain
        )
        dcp.save(state, storage_writer=writer)

    def load(state: dict[str, Any], url: str) -> None:
        dcp.load(state, storage_reader=S3StorageReader(REGION, url, s3client_config=config))

    return save, load


CLIENTS: dict[str, Callable[[str, str], tuple[SaveFn, LoadFn]]] = {
    "ours": _ours,
    "stock fsspec": _stock,
    "s3torchconnector": _s3torchconnector,
}
# Extra rows: (client, transform chain).
TRANSFORM_ROWS = {"ours+zstd": ("ours", "zstd"), "ours+shuffle+zstd": ("ours", "shuffle+zstd")}


def make_client(name: str, endpoint: str) -> tuple[SaveFn, LoadFn]:
    client, transforms = TRANSFORM_ROWS.get(name, (name, ""))
    return CLIENTS[client](endpoint, transforms)


def _cpu() -> float:
    # getrusage counts in microseconds; os.times in 10 ms ticks (4% of a 268 MB save).
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, client CPU seconds) of ``fn()`` in this process."""
    before, start = _cpu(), time.perf_counter()
    fn()
    wall = time.perf_counter() - start
    return wall, _cpu() - before


# --- a load in a fresh process -------------------------------------------------------


def child_load(name: str, endpoint: str, url: str, size_mb: float) -> None:
    expected = build_state(size_mb)
    target = {k: torch.zeros_like(v) for k, v in expected.items()}  # allocated and touched
    _, load = make_client(name, endpoint)
    wall, cpu = timed(lambda: load(target, url))
    ok = all(torch.equal(target[k], expected[k]) for k in expected)
    print(json.dumps({"wall": wall, "cpu": cpu, "ok": ok}))


def load_in_fresh_process(
    name: str, endpoint: str, url: str, size_mb: float, script: str = __file__
) -> tuple[float, float]:
    """Run ``script --child-load NAME ENDPOINT URL --size-mb N`` (a benchmark whose
    ``--child-load`` calls its own client's load) and return its (wall, CPU) seconds."""
    here = os.path.abspath(script)
    cmd = [sys.executable, here, "--child-load", name, endpoint, url, "--size-mb", str(size_mb)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"{name} load failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if not result["ok"]:
        raise AssertionError(f"{name}: loaded tensors differ from the saved ones")
    return float(result["wall"]), float(result["cpu"])


# --- the raw ceiling -----------------------------------------------------------------


def raw_ceiling(endpoint: str, objects: int = 8, size: int = 32 << 20) -> dict[str, float]:
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=KEY,
        aws_secret_access_key=SECRET,
        config=Config(max_pool_connections=objects * 2),
    )
    payload = os.urandom(size)
    prefix = f"raw-{uuid.uuid4().hex}"
    keys = [f"{prefix}/{i}" for i in range(objects)]
    with concurrent.futures.ThreadPoolExecutor(objects) as pool:

        def put_all() -> None:
            list(pool.map(lambda k: client.put_object(Bucket=BUCKET, Key=k, Body=payload), keys))

        def get_all() -> None:
            bodies = pool.map(
                lambda k: client.get_object(Bucket=BUCKET, Key=k)["Body"].read(), keys
            )
            assert all(len(b) == size for b in bodies)

        put = timed(put_all)
        get = timed(get_all)
    delete_prefix(endpoint, prefix)
    total = objects * size
    return {"save": put[0], "save_cpu": put[1], "load": get[0], "load_cpu": get[1], "bytes": total}


def delete_prefix(endpoint: str, prefix: str) -> None:
    s3 = boto3_client(endpoint)
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    for page in pages:
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})


# --- driver --------------------------------------------------------------------------


Samples = dict[str, dict[str, list[float]]]


def side_by_side(
    clients: dict[str, tuple[SaveFn, LoadFn]],
    size_mb: float,
    repeat: int,
    *,
    url: Callable[[str], str],
    load: Callable[[str, str, float], tuple[float, float]],
    delete: Callable[[str], None],
    ceiling: Callable[[], dict[str, float]],
    moved: Callable[[], tuple[int, int]] | None = None,
) -> tuple[Samples, int]:
    """The protocol every store comparison here shares: each client saves and loads a
    small state dict (warm-up), then in ``repeat`` rounds, the order rotating, saves the
    state dict to a fresh prefix in this process and loads it with ``load`` (a fresh
    process), then the prefix is deleted; the raw ``ceiling`` is measured after every
    round and scaled to the same bytes. ``url`` maps a prefix to a URL; the samples are
    seconds and CPU seconds, with the logical byte count. ``moved`` (a proxy's byte
    counters, sent and received) adds the bytes each save sent and each load received."""
    names = list(clients)
    state = build_state(size_mb)
    logical = logical_bytes(state)
    small = build_state(20)
    for name, (save, _) in clients.items():  # warm-up: clients, models, pools, server
        prefix = f"warm-{uuid.uuid4().hex}"
        save(small, url(prefix))
        load(name, url(prefix), 20)
        delete(prefix)
    ceiling()  # its warm-up

    samples: Samples = {n: {} for n in names + ["raw ceiling"]}

    def add(name: str, **values: float) -> None:
        for key, value in values.items():
            samples[name].setdefault(key, []).append(value)

    for round_ in range(repeat):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for name in order:
            prefix = f"{name.replace(' ', '-')}-{uuid.uuid4().hex}"
            before = moved() if moved else (0, 0)
            save_s, save_cpu = timed(lambda: clients[name][0](state, url(prefix)))  # noqa: B023
            between = moved() if moved else (0, 0)
            load_s, load_cpu = load(name, url(prefix), size_mb)
            after = moved() if moved else (0, 0)
            add(name, save=save_s, save_cpu=save_cpu, load=load_s, load_cpu=load_cpu)
            if moved:
                add(name, sent=between[0] - before[0], received=after[1] - between[1])
            delete(prefix)
        raw = ceiling()
        scale = logical / raw.pop("bytes")  # the ceiling per the same bytes
        add("raw ceiling", **{k: v * scale for k, v in raw.items()})
    return samples, logical


def report(
    samples: Samples,
    logical: int,
    repeat: int,
    *,
    store: str,
    baseline: str,
    short: str,
    cap: float | None = None,
) -> None:
    """The table: each row's times and CPU per GB, against the ``baseline`` row (named
    ``short`` in the headers) and against the raw ceiling; with ``cap`` (bytes per second
    of a capped bucket; samples with bytes moved) also the MB each save sent and each
    load received, and the time those bytes take at the cap."""
    med = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()}
    gb, mb = logical / 1e9, logical / MB
    peer, ceiling = med[baseline], med["raw ceiling"]
    print(
        f"\n{store}, {mb:.0f} MB state dict, median of {repeat} after a warm-up; "
        "saves in this process, loads in a fresh one; CPU = client user+sys per GB"
    )
    capped = cap is not None and "sent" in med[baseline]
    print(
        "| client | save s | MB/s | CPU s/GB | load s | MB/s | CPU s/GB | "
        f"save vs {short} (time, CPU) | load vs {short} (time, CPU) | % of ceiling (save, load) |"
        + (" MB sent, received | their time at the cap, s (save, load) |" if capped else "")
    )
    print("|---" * (10 + 2 * capped) + "|")
    for name, m in med.items():
        moved = ""
        if capped:
            assert cap is not None
            if "sent" in m:
                moved = (
                    f" {m['sent'] / MB:.0f}, {m['received'] / MB:.0f} "
                    f"| {m['sent'] / cap:.2f}, {m['received'] / cap:.2f} |"
                )
            else:
                moved = f" {mb:.0f}, {mb:.0f} (scaled) | {mb * MB / cap:.2f}, {mb * MB / cap:.2f} |"
        print(
            f"| {name} | {m['save']:.2f} | {mb / m['save']:.0f} | {m['save_cpu'] / gb:.2f} "
            f"| {m['load']:.2f} | {mb / m['load']:.0f} | {m['load_cpu'] / gb:.2f} "
            f"| {peer['save'] / m['save']:.2f}x, {m['save_cpu'] / peer['save_cpu']:.2f}x "
            f"| {peer['load'] / m['load']:.2f}x, {m['load_cpu'] / peer['load_cpu']:.2f}x "
            f"| {100 * ceiling['save'] / m['save']:.0f}%, "
            f"{100 * ceiling['load'] / m['load']:.0f}% |" + moved
        )
    print(
        f"\nvs {short}: time = {baseline}'s time / this row's (> 1: faster); CPU = this "
        f"row's CPU per GB / {baseline}'s (< 1: cheaper); the ceiling: raw requests, 8 x 32 "
        "MiB in 8 threads, no DCP, scaled to the same bytes."
    )
    if capped:
        assert cap is not None
        print(
            f"The cap: {cap / MB:.0f} MB/s for both directions together; bytes counted at "
            "the proxy (bodies and HTTP headers); their time at the cap is the floor no "
            "client can beat."
        )
    print("raw samples:", json.dumps(samples))


def plot_throughput(med: dict[str, dict[str, float]], logical: int, path: str) -> None:
    """Save and load throughput (MB/s) of each client beside the raw ceiling, from the
    medians (matplotlib, from the bench extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(med)
    mb = logical / MB
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        rates = [mb / med[name][op] for op in ("save", "load")]
        hatch = "//" if name == "raw ceiling" else None
        bars = ax.bar([j + i * width for j in range(2)], rates, width, label=name, hatch=hatch)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(2)], ["save", "load"])
    ax.set_ylabel("MB/s (higher is better)")
    ax.set_title(f"{mb:.0f} MB state dict, SeaweedFS on loopback, medians", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace, endpoint: str, proxy: CappedProxy | None = None) -> None:
    """The side-by-side run against ``endpoint``; with ``proxy`` every client, load and
    ceiling goes through it (prefixes are deleted directly)."""
    names = list(CLIENTS) + (["ours+zstd"] if args.zstd else [])
    names += ["ours+shuffle+zstd"] if args.shuffle else []
    via = proxy.url if proxy else endpoint
    samples, logical = side_by_side(
        {name: make_client(name, via) for name in names},
        args.size_mb,
        args.repeat,
        url=lambda prefix: f"s3://{BUCKET}/{prefix}",
        load=lambda name, url, mb: load_in_fresh_process(name, via, url, mb),
        delete=lambda prefix: delete_prefix(endpoint, prefix),
        ceiling=lambda: raw_ceiling(via),
        moved=(lambda: (proxy.bytes_up, proxy.bytes_down)) if proxy else None,
    )
    store = "SeaweedFS"
    if proxy:
        assert proxy.bucket is not None
        store += (
            f" behind the capped proxy ({proxy.bucket.rate / MB:.0f} MB/s both ways together, "
            f"{proxy.latency * 1e3:.0f} ms per request; proxy CPU {proxy.cpu_seconds():.1f} s)"
        )
    report(
        samples,
        logical,
        args.repeat,
        store=store,
        baseline="s3torchconnector",
        short="s3tc",
        cap=proxy.bucket.rate if proxy and proxy.bucket else None,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=268)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--zstd", action="store_true", help="add a row: ours with zstd")
    parser.add_argument("--shuffle", action="store_true", help="add a row: shuffle + zstd")
    parser.add_argument("--capped", action="store_true", help="reach the server via the proxy")
    parser.add_argument("--rate", type=float, default=100e6, help="proxy cap, bytes/s in all")
    parser.add_argument("--latency", type=float, default=0.005, help="proxy delay per request, s")
    parser.add_argument("--endpoint", help="use this S3 endpoint instead of starting SeaweedFS")
    parser.add_argument("--child-load", nargs=3, metavar=("CLIENT", "ENDPOINT", "URL"))
    args = parser.parse_args()
    if args.child_load:
        child_load(*args.child_load, args.size_mb)
        return
    if args.endpoint:
        run(args, args.endpoint)
        return
    with SeaweedFS(bucket=BUCKET) as server:
        print(f"SeaweedFS {server.url} (data in {server.dir})", flush=True)
        if not args.capped:
            run(args, server.url)
            return
        with CappedProxy(server.url, rate=args.rate, latency=args.latency) as proxy:
            run(args, server.url, proxy)


if __name__ == "__main__":
    main()
