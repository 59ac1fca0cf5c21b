"""A 1,024-rank save on paper and in code: planning time, metadata size, requests.

    python benchmarks/scale_sim.py                        # 1,024 ranks x 200 items
    python benchmarks/scale_sim.py --ranks 1024 --items 200 --model-gb 140 --key-prefixes 0,16,64

In one process: 1,024 fake ``SavePlan`` (each rank a 1/1,024 row shard of 200 bf16
parameters of a ``--model-gb`` model, as FSDP holds them) go through DCP's
``DefaultSavePlanner.create_global_plan`` and our writer's ``prepare_global_plan``; the
write results each rank's ``write_data`` would return (our file bucketing, our storage
records) go through the writer's real ``finish``, which publishes ``.metadata`` to a
``MemoryFileSystem`` (the data files exist there, empty). Printed: the time of each
step, the metadata bytes, the requests each rank and the coordinator make on S3, and
the peak requests per second per key prefix (the arithmetic is in docs/scale.md).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import Counter
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from storage import CheckpointWriter, MemoryFileSystem  # noqa: E402
from storage.backends.s3._filesystem import DEFAULT_PART_SIZE  # noqa: E402
from storage.checkpoint import storage_format as fmt  # noqa: E402
from storage.checkpoint.data_files import split_into_files  # noqa: E402
from storage.checkpoint.prefixes import split  # noqa: E402

MiB = 1 << 20
#: Figures the docs quote (AWS S3 per prefix partition; our S3 backend's defaults).
S3_PUT_PER_S, S3_GET_PER_S = 3500, 5500
S3_PART = DEFAULT_PART_SIZE  # the S3 backend's part size (8 MiB)
S3_THREADS = 16


class CountingMemory(MemoryFileSystem):
    """The coordinator's storage calls during ``finish``, by method."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def ls(self, path: str) -> list[str]:
        self.calls["LIST"] += 1
        return super().ls(path)

    def read_bytes(self, path: str) -> bytes:
        self.calls["GET"] += 1
        return super().read_bytes(path)

    def write_atomic(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        self.calls["PUT"] += 1
        super().write_atomic(path, data, exclusive=exclusive)

    def exists(self, path: str) -> bool:
        self.calls["HEAD"] += 1
        return super().exists(path)


def rank_plan(rank: int, ranks: int, items: int, item_bytes: int) -> SavePlan:
    cols = 1024
    rows = max(1, item_bytes // (2 * cols))
    plan = []
    for i in range(items):
        offsets = torch.Size([rank * rows, 0])
        plan.append(
            WriteItem(
                index=MetadataIndex(f"model.layers.{i}.weight", offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([rows, cols])),
                    properties=TensorProperties(dtype=torch.bfloat16),
                    size=torch.Size([ranks * rows, cols]),
                ),
            )
        )
    return SavePlan(plan, planner_data={i.index.fqn: (i.index.fqn,) for i in plan})


def write_results(
    plan: SavePlan, rank: int, writer: CheckpointWriter, item_bytes: int
) -> tuple[list[WriteResult], list[tuple[str, int]]]:
    """What ``write_data`` returns for ``plan`` (our bucketing and records), and the
    (name, bytes) of each data file; each file is created, empty, in the memory store."""
    buckets, _ = split_into_files(
        list(plan.items),
        rank=rank,
        save_id=writer.save_id,
        thread_count=S3_THREADS,
        single_file_per_rank=True,
        key_prefixes=writer.key_prefixes,
    )
    results, files = [], []
    for name, bucket in buckets:
        offset = 0
        for item in bucket:
            length = item_bytes + 1100  # the torch.save archive around the raw bytes
            record = fmt.StoredItem(
                name,
                offset,
                length,
                crc32c=0x1234ABCD,
                data_offset=1024,
                dtype="bfloat16",
                nbytes=item_bytes,
            )
            info = fmt.new_storage_info(record)
            results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
            offset += length
        files.append((name, offset))
        with writer.fs.create_stream(writer.fs.concat_path(writer.path, name), "wb"):
            pass
    return results, files


def simulate(args: Any, key_prefixes: int) -> dict[str, Any]:
    item_bytes = int(args.model_gb * 1e9 / args.ranks / args.items)
    fs = CountingMemory()
    writer = CheckpointWriter(
        f"dcpmem://sim{key_prefixes}/ckpt", filesystem=fs, key_prefixes=key_prefixes
    )
    writer.set_up_storage_writer(True, rank=0)
    plans = [rank_plan(r, args.ranks, args.items, item_bytes) for r in range(args.ranks)]
    planner = DefaultSavePlanner()
    t0 = time.perf_counter()
    plans, metadata = planner.create_global_plan(plans)
    plans = writer.prepare_global_plan(plans)
    t_plan = time.perf_counter() - t0
    all_results, per_rank_files = [], []
    for rank, plan in enumerate(plans):
        results, files = write_results(plan, rank, writer, item_bytes)
        all_results.append(results)
        per_rank_files.append(files)
    fs.calls.clear()
    t0 = time.perf_counter()
    writer.finish(metadata, all_results)
    t_finish = time.perf_counter() - t0
    meta_bytes = fs.size(fs.concat_path(writer.path, fmt.METADATA_NAME))
    # Requests per rank: per data file a multipart upload (create, parts, complete).
    per_rank = [sum(2 + math.ceil(size / S3_PART) for _, size in files) for files in per_rank_files]
    creates: Counter[str | None] = Counter(
        split(name)[0] for files in per_rank_files for name, _ in files
    )
    rank_bytes = item_bytes * args.items
    upload_s = rank_bytes / (args.rank_gbps * 1e9)
    # Steady state: each rank streams its files in parallel at --rank-gbps in all, one
    # UploadPart per part_size; all ranks start together. The burst: every rank's
    # CreateMultipartUpload in the first --burst-s seconds.
    part_rate = args.rank_gbps * 1e9 / S3_PART  # PUT/s per rank
    ranks_per_prefix = Counter(
        split(files[0][0])[0] for files in per_rank_files if files
    ).most_common(1)[0][1]
    steady = ranks_per_prefix * part_rate
    burst = max(creates.values()) / args.burst_s
    # A load with every rank reading its own shard: ranged GETs of up to 32 MiB.
    get_rate = ranks_per_prefix * args.rank_gbps * 1e9 / (32 * MiB)
    return {
        "key_prefixes": key_prefixes,
        "plan_s": t_plan,
        "finish_s": t_finish,
        "metadata_mb": meta_bytes / 1e6,
        "rank_mb": rank_bytes / 1e6,
        "files_per_rank": len(per_rank_files[0]),
        "requests_per_rank": per_rank[0],
        "coordinator_extra": dict(fs.calls),
        "prefixes_used": len(creates),
        "peak_put_per_prefix": max(steady, burst),
        "peak_get_per_prefix": get_rate,
        "upload_s": upload_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--model-gb", type=float, default=140.0, help="bf16 bytes in all")
    parser.add_argument("--rank-gbps", type=float, default=1.0, help="GB/s each rank uploads")
    parser.add_argument("--burst-s", type=float, default=1.0, help="spread of the start")
    parser.add_argument("--key-prefixes", default="0,16,64")
    args = parser.parse_args()
    print(
        f"{args.ranks} ranks x {args.items} items, {args.model_gb:g} GB model (bf16), "
        f"{args.rank_gbps:g} GB/s per rank, S3 part {S3_PART // MiB} MiB"
    )
    print(
        "| key_prefixes | plan s | finish s | .metadata MB | MB/rank | files/rank | "
        "requests/rank | coordinator extra | prefixes | peak PUT/s/prefix | "
        "peak GET/s/prefix |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for k in (int(v) for v in args.key_prefixes.split(",")):
        r = simulate(args, k)
        print(
            f"| {k} | {r['plan_s']:.2f} | {r['finish_s']:.2f} | {r['metadata_mb']:.1f} | "
            f"{r['rank_mb']:.0f} | {r['files_per_rank']} | {r['requests_per_rank']} | "
            f"{r['coordinator_extra']} | {r['prefixes_used']} | "
            f"{r['peak_put_per_prefix']:,.0f} | {r['peak_get_per_prefix']:,.0f} |"
        )


if __name__ == "__main__":
    main()
