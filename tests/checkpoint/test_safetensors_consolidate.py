"""SafetensorsWriter on N ranks with DTensor shards: each rank stages its shards, the
coordinator assembles whole tensors in Hub-layout files (no rank holds the model), the
index last; the files load bit-exact with the safetensors library, on local disk and in
a bucket."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from safetensors.torch import load_file

from storage.checkpoint.safetensors import SafetensorsWriter, load_safetensors
from storage.checkpoint.safetensors.consolidate import byte_range
from storage.checkpoint.safetensors.crcs import crc32c_combine
from tests.support.distributed import gloo_group
from tests.support.servers import boto3_client, endpoint_with_bucket, s3_options

BUCKET = "consolidate"


def _full() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        "embed.weight": torch.randn(33, 16, generator=gen).to(torch.bfloat16),  # uneven rows
        "layers.0.w": torch.randn(16, 8, generator=gen),
        "layers.0.b": torch.randn(16, generator=gen).to(torch.float16),
        "norm": torch.randn(8, generator=gen),  # replicated plain tensor: saved once
        "ids": torch.arange(5, dtype=torch.int64),
        "cube": torch.randn(4, 3, 2, generator=gen).to(torch.float64),
    }


def _worker(rank: int, store: str, url: str, options: dict[str, Any] | None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    with gloo_group(rank, 2, store):
        mesh = init_device_mesh("cpu", (2,))
        full = _full()
        state: dict[str, Any] = {
            k: distribute_tensor(v, mesh, [Shard(0)])
            for k, v in full.items()
            if k not in ("norm", "ids")
        }
        state["norm"] = full["norm"]
        state["ids"] = distribute_tensor(full["ids"], mesh, [Replicate()])
        writer = SafetensorsWriter(url, storage_options=options, max_shard_size=1200)
        dcp.save(state, storage_writer=writer)


def _check(files: dict[str, bytes], url: str, options: dict[str, Any] | None) -> None:
    from safetensors.torch import load

    names = sorted(files)
    assert "model.safetensors.index.json" in names, names
    assert not [n for n in names if ".dcp-staging-" in n], names  # staging removed
    loaded: dict[str, torch.Tensor] = {}
    for name in names:
        if name.endswith(".safetensors"):
            loaded.update(load(files[name]))
    full = _full()
    assert sorted(loaded) == sorted(full)
    for key, value in full.items():
        got = loaded[key]
        assert got.dtype == value.dtype and got.shape == value.shape, key
        assert torch.equal(got.reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8))
    # Our reader checks each whole tensor's CRC-32C (combined from the shards').
    out = {k: torch.zeros_like(v) for k, v in full.items()}
    load_safetensors(out, url, storage_options=options)
    assert all(torch.equal(out[k], full[k]) for k in full)


def test_two_ranks_consolidate_dtensor_shards_on_local_disk(tmp_path: Path) -> None:
    """A sharded save used to be refused ("gather full tensors first")."""
    url = str(tmp_path / "model")
    mp.spawn(_worker, args=(str(tmp_path / "store"), url, None), nprocs=2, join=True)
    files: dict[str, bytes] = {}
    for folder, _, names in os.walk(url):
        for name in names:
            path = os.path.join(folder, name)
            files[os.path.relpath(path, url)] = Path(path).read_bytes()
    _check(files, url, None)
    assert len([n for n in files if n.endswith(".safetensors")]) > 1
    assert load_file(os.path.join(url, sorted(files)[0]))  # loads from a path too


@pytest.fixture(scope="module", params=["seaweedfs"])
def endpoint(request: pytest.FixtureRequest) -> str:
    return endpoint_with_bucket(request, BUCKET)


def test_two_ranks_consolidate_dtensor_shards_in_a_bucket(endpoint: str, tmp_path: Path) -> None:
    prefix = f"model-{uuid.uuid4().hex[:8]}"
    url = f"s3://{BUCKET}/{prefix}"
    options = s3_options(endpoint)
    mp.spawn(_worker, args=(str(tmp_path / "store"), url, options), nprocs=2, join=True)
    client = boto3_client(endpoint)
    listing = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")
    keys = [o["Key"] for o in listing.get("Contents", [])]
    files = {
        k[len(prefix) + 1 :]: client.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in keys
    }
    _check(files, url, options)


def test_only_contiguous_shards_have_a_byte_range() -> None:
    f32 = torch.float32
    assert byte_range([4, 0], [4, 6], [8, 6], f32) == (4 * 6 * 4, 4 * 6 * 4)  # rows
    assert byte_range([0, 3], [8, 3], [8, 6], f32) is None  # columns
    assert byte_range([0, 3], [1, 3], [1, 6], f32) == (12, 12)  # columns of one row
    assert byte_range([2, 1, 0], [1, 2, 5], [3, 4, 5], f32) == ((2 * 20 + 5) * 4, 40)
    assert byte_range([], [], [], f32) == (0, 4)  # a scalar


def test_crc32c_combine_matches_the_crc_of_the_concatenation() -> None:
    gen = torch.Generator().manual_seed(0)
    data = bytes(torch.randint(0, 256, (5000,), generator=gen, dtype=torch.uint8).tolist())
    for cut in (0, 1, 7, 2500, 4999, 5000):
        a, b = data[:cut], data[cut:]
        combined = crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b))
        assert combined == crc32c.crc32c(data), cut
