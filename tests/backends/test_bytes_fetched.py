"""Bytes on the wire when loading from S3: a full load fetches exactly the stored data
bytes once; a partial load fetches only the ranges of the items asked for. Counted by
the proxy in front of moto, from the GET response bodies it relays."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import storage
from extensions import ZStandard
from storage import S3FileSystem
from tests.support.servers import (
    FaultProxy,
    boto3_client,
    create_bucket,
    list_keys,
    moto_endpoint,
    s3_options,
)

BUCKET = "dcp-bytes"


@pytest.fixture(scope="module")
def proxy() -> Iterator[FaultProxy]:
    endpoint = moto_endpoint()
    create_bucket(endpoint, BUCKET)
    with FaultProxy(endpoint) as p:
        yield p


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {f"layer{i:02d}": torch.randn(64, 257, generator=gen) for i in range(40)}


def _stored(s3: Any, prefix: str) -> tuple[int, int]:
    """(bytes of data objects, bytes of the metadata object) under ``prefix``."""
    data = meta = 0
    for key in list_keys(s3, BUCKET, prefix):
        size = s3.head_object(Bucket=BUCKET, Key=key)["ContentLength"]
        if key.endswith(".distcp"):
            data += size
        elif key.endswith(".metadata"):
            meta += size
    return data, meta


@pytest.mark.parametrize("chain", ["plain", "zstd"])
def test_full_load_fetches_stored_bytes_once(proxy: FaultProxy, chain: str) -> None:
    prefix = f"{uuid.uuid4().hex}/ckpt"
    url = f"s3://{BUCKET}/{prefix}"
    opts = s3_options(proxy.url)
    state = _state()
    storage.save(
        state, url, storage_options=opts, transforms=[ZStandard()] if chain == "zstd" else []
    )
    data, meta = _stored(boto3_client(proxy.url), prefix)
    proxy.clear()
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    storage.load(target, url, storage_options=opts)
    assert all(torch.equal(target[k], state[k]) for k in state)
    assert proxy.get_bytes(r"\.distcp") == data  # ratio 1.00
    assert proxy.get_bytes(r"\.metadata") == meta


def test_partial_load_fetches_only_that_item(proxy: FaultProxy) -> None:
    prefix = f"{uuid.uuid4().hex}/ckpt"
    url = f"s3://{BUCKET}/{prefix}"
    opts = s3_options(proxy.url)
    state = _state()
    storage.save(state, url, storage_options=opts)
    reader = storage.CheckpointReader(url, storage_options=opts)
    md = reader.read_metadata()
    (info,) = [i for idx, i in md.storage_data.items() if idx.fqn == "layer17"]
    proxy.clear()
    target = {"layer17": torch.zeros(64, 257)}
    storage.load(target, url, storage_options=opts)
    assert torch.equal(target["layer17"], state["layer17"])
    assert proxy.get_bytes(r"\.distcp") == info.length
    data_gets = [r for r in proxy.records if r.method == "GET" and ".distcp" in r.target]
    assert len(data_gets) == 1


def test_large_item_is_fetched_by_parallel_ranged_gets_once(proxy: FaultProxy) -> None:
    # 24 MiB items with 5 MiB parts: each is read with several ranged GETs at once,
    # straight into the tensor, and still every stored byte crosses the wire once.
    prefix = f"{uuid.uuid4().hex}/ckpt"
    url = f"s3://{BUCKET}/{prefix}"
    fs = S3FileSystem(storage_options=s3_options(proxy.url), part_size=5 << 20)
    gen = torch.Generator().manual_seed(4)
    state = {f"big{i}": torch.randn(6 << 20, generator=gen) for i in range(2)}
    storage.save(state, url, filesystem=fs)
    data, _ = _stored(boto3_client(proxy.url), prefix)
    proxy.clear()
    # After each item's first window (two, one per reader thread), GETs are held until
    # three are in flight, so those sent together overlap whatever the scheduling of
    # this machine; the two first windows alone overlapped even with one GET at a time.
    proxy.add("delay", method="GET", path=r"\.distcp", gather=3, skip=2, delay=60)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    storage.load(target, url, filesystem=fs)
    assert all(torch.equal(target[k], state[k]) for k in state)
    assert proxy.get_bytes(r"\.distcp") == data
    assert proxy.max_concurrent("GET", r"\.distcp") >= 3
    # A piece whose body is cut off is resumed from where it stopped.
    proxy.clear()
    fault = proxy.add("truncate", method="GET", path=r"\.distcp", count=3)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    storage.load(target, url, filesystem=fs)
    assert all(torch.equal(target[k], state[k]) for k in state)
    assert fault.hits == 3
