"""Exporting a sharded checkpoint in SeaweedFS as a Hub-layout model: ours against
what users do today.

    python benchmarks/safetensors_export.py                  # ~1 GB, files of 256 MB
    python benchmarks/safetensors_export.py --size-mb 256

The source: the bf16 model of :mod:`benchmarks.safetensors_load` (hidden 2048, a few
hundred tensors of realistic sizes), each tensor a ``Shard(0)`` DTensor over 2 gloo
ranks, committed once with ``storage.save`` in ``s3://bench/ckpt-*`` (untimed).

Rows, each in a fresh process (its wall time, and its peak RSS: the larger of its own
``VmHWM`` and its children's ``ru_maxrss``, both read by the process itself as it exits.
``wait4``'s ``ru_maxrss`` of the child is not used: Linux carries the parent's resident
set at ``exec`` into it, and this parent holds the 1 GB model):

- ours: ``dcp-storage export s3://bench/ckpt-* s3://bench/hf-* --format safetensors
  --max-shard-size`` in a subprocess: the checkpoint read from the bucket, the model
  written to another prefix of it;
- today: the 2 ranks ``dcp.save`` the same DTensors with torch's
  ``HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)`` to a
  local temporary directory (consolidation included), then boto3 ``upload_file`` of
  each file (the phases timed apart);
- the raw PUT ceiling of :mod:`benchmarks.s3_peers` (8 x 32 MiB in 8 threads, boto3),
  scaled to the same bytes.

Both models are checked bit-exact against the full tensors (untimed). The memory bound
printed beside ours is the RSS of a process that only imports ``storage``, ``torch`` and
``s3fs`` (measured the same way), plus 2 x the S3 part buffers (part size x max
concurrency: the parts in flight, the ones being filled and the read-ahead fit in it)
plus the largest tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.s3_peers import BUCKET, delete_prefix, raw_ceiling  # noqa: E402
from benchmarks.safetensors_load import build_model  # noqa: E402
from tests.support.servers import SeaweedFS, boto3_client, s3_options  # noqa: E402

MB = 1e6
PART_SIZE, MAX_CONCURRENCY = 8 << 20, 16  # the S3 backend's defaults


def _rank_worker(rank: int, store: str, mode: str, url: str, endpoint: str, size_mb: float) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import storage
    from tests.support.distributed import gloo_group

    with gloo_group(rank, 2, store):
        mesh = init_device_mesh("cpu", (2,))
        state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in build_model(size_mb).items()}
        if mode == "ours":
            storage.save(state, url, storage_options=s3_options(endpoint))
        else:
            writer = dcp.HuggingFaceStorageWriter(
                url, save_distributed=True, enable_consolidation=True
            )
            dcp.save(state, storage_writer=writer)


def _spawn(mode: str, url: str, endpoint: str, size_mb: float) -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.spawn(_rank_worker, args=(store, mode, url, endpoint, size_mb), nprocs=2, join=True)


def child_today(endpoint: str, prefix: str, size_mb: float) -> None:
    """Consolidate to local disk with torch's writer on 2 ranks, then upload."""
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        _spawn("today", tmp, endpoint, size_mb)
        saved = time.perf_counter()
        client = boto3_client(endpoint)
        for name in sorted(os.listdir(tmp)):
            if name.endswith((".safetensors", ".json")):
                client.upload_file(os.path.join(tmp, name), BUCKET, f"{prefix}/{name}")
        done = time.perf_counter()
    print(json.dumps({"consolidate": saved - start, "upload": done - saved}))


# Runs a module (``-m NAME``), a script or code (``-c CODE``) as ``__main__`` and, as it
# exits, writes its peak RSS to the file named by $PEAK_RSS_FILE.
_PEAK = """
import atexit, os, resource, runpy, sys
def _peak():
    with open("/proc/self/status") as f:
        own = next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    with open(os.environ["PEAK_RSS_FILE"], "w") as f:
        f.write(str(max(own, kids) * 1024))
atexit.register(_peak)
kind, *rest = sys.argv[1:]
if kind == "-m":
    sys.argv[1:] = rest[1:]
    runpy.run_module(rest[0], run_name="__main__", alter_sys=True)
elif kind == "-c":
    exec(compile(rest[0], "<string>", "exec"), {"__name__": "__main__"})
else:
    sys.argv[:] = [kind, *rest]
    runpy.run_path(kind, run_name="__main__")
"""


def _run_child(cmd: list[str]) -> dict[str, Any]:
    """Run ``cmd`` (after ``sys.executable``: ``-m NAME ...``, ``-c CODE`` or a script);
    its wall time, peak RSS (its own and its children's) and last line."""
    with tempfile.TemporaryDirectory() as tmp:
        peak = os.path.join(tmp, "peak")
        out_path, err_path = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        env = dict(os.environ, PEAK_RSS_FILE=peak)
        with open(out_path, "w") as out, open(err_path, "w") as err:
            start = time.perf_counter()
            code = subprocess.call(
                [sys.executable, "-c", _PEAK, *cmd], stdout=out, stderr=err, env=env
            )
            wall = time.perf_counter() - start
        with open(out_path) as f:
            text = f.read().strip()
        with open(err_path) as f:
            errors = f.read()
        if code:
            raise RuntimeError(f"{cmd[:4]} failed:\n{errors[-3000:]}")
        with open(peak) as f:
            rss = int(f.read())
    result: Any = None
    if text:
        try:
            result = json.loads(text)
        except ValueError:
            result = json.loads(text.splitlines()[-1])
    return {"wall": wall, "rss": rss, "out": result}


def _check(endpoint: str, prefix: str, expected: dict[str, torch.Tensor]) -> int:
    from safetensors.torch import load

    client = boto3_client(endpoint)
    listing = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")
    got: dict[str, torch.Tensor] = {}
    files = 0
    for obj in listing.get("Contents", []):
        if obj["Key"].endswith(".safetensors"):
            files += 1
            got.update(load(client.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"].read()))
    bad = [k for k, v in expected.items() if k not in got or not torch.equal(got[k], v)]
    if bad or len(got) != len(expected):
        raise AssertionError(f"{prefix}: {len(bad)} tensors differ, e.g. {bad[:3]}")
    return files


def run(args: argparse.Namespace, endpoint: str) -> None:
    tag = uuid.uuid4().hex[:8]
    ckpt, ours, today = f"ckpt-{tag}", f"hf-{tag}", f"today-{tag}"
    expected = build_model(args.size_mb)
    logical = sum(t.nbytes for t in expected.values())
    largest = max(t.nbytes for t in expected.values())
    _spawn("ours", f"s3://{BUCKET}/{ckpt}", endpoint, args.size_mb)  # the source, untimed
    raw_ceiling(endpoint)  # warm the server up
    options = [f"--storage-option={k}={v}" for k, v in s3_options(endpoint).items()]
    baseline = _run_child(["-c", "import storage, torch, s3fs"])["rss"]
    export = ["-m", "storage", "export", f"s3://{BUCKET}/{ckpt}"]
    export += [f"s3://{BUCKET}/{ours}", "--format", "safetensors", "--json", *options]
    export += ["--max-shard-size", f"{int(args.max_shard_size_mb * MB)}"]
    mine = _run_child(export)
    files = _check(endpoint, ours, expected)
    theirs = _run_child(
        [os.path.abspath(__file__), "--child-today", endpoint, today]
        + ["--size-mb", str(args.size_mb)]
    )
    _check(endpoint, today, expected)
    raw = raw_ceiling(endpoint)
    ceiling = raw["save"] * logical / raw["bytes"]
    for prefix in (ckpt, ours, today):
        delete_prefix(endpoint, prefix)
    bound = baseline + 2 * PART_SIZE * MAX_CONCURRENCY + largest
    gb = logical / 1e9
    print(
        f"\nSeaweedFS on loopback: {logical / MB:.0f} MB bf16 model, {len(expected)} tensors "
        f"(largest {largest / MB:.0f} MB), 2-rank Shard(0) checkpoint; ours in {files} files "
        f"of <= {args.max_shard_size_mb:.0f} MB"
    )
    print("| path | wall s | MB/s | % of PUT ceiling | peak RSS MB | vs bound |")
    print("|---|---|---|---|---|---|")
    rows = [("dcp-storage export (bucket -> bucket)", mine)]
    rows.append(
        (
            f"HF writer consolidation {theirs['out']['consolidate']:.2f} s + boto3 upload "
            f"{theirs['out']['upload']:.2f} s",
            theirs,
        )
    )
    for name, row in rows:
        print(
            f"| {name} | {row['wall']:.2f} | {logical / MB / row['wall']:.0f} "
            f"| {100 * ceiling / row['wall']:.0f}% | {row['rss'] / MB:.0f} "
            f"| {row['rss'] / bound:.2f}x |"
        )
    print(f"| raw PUT ceiling (8 x 32 MiB, 8 threads) | {ceiling:.2f} | {gb * 1e3 / ceiling:.0f} |")
    goal = ceiling / mine["wall"] >= 0.85
    print(
        f"\ngoal (export >= 85% of the PUT ceiling): {'met' if goal else 'NOT met'}; memory "
        f"bound: imports ({baseline / MB:.0f} MB) + 2 x part buffers "
        f"({2 * PART_SIZE * MAX_CONCURRENCY / MB:.0f} MB) + largest "
        f"tensor ({largest / MB:.0f} MB) = {bound / MB:.0f} MB: "
        f"{'met' if mine['rss'] <= bound else 'NOT met'} by the export"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=1024)
    parser.add_argument("--max-shard-size-mb", type=float, default=256)
    parser.add_argument("--child-today", nargs=2, metavar=("ENDPOINT", "PREFIX"))
    args = parser.parse_args()
    if args.child_today:
        endpoint, prefix = args.child_today
        child_today(endpoint, prefix, args.size_mb)
        return
    with SeaweedFS(bucket=BUCKET) as server:
        print(f"SeaweedFS {server.url} (data in {server.dir})", flush=True)
        run(args, server.url)


if __name__ == "__main__":
    main()
