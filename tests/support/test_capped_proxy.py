"""The capped-bucket proxy (tests/support/capped_proxy.py) in front of a moto server: bytes pass
intact, and the cap and the latency hold as lower bounds on a transfer's time (bounds the
token bucket guarantees, not timings of our code)."""

from __future__ import annotations

import os
import time
import urllib.parse
import uuid

import pytest
import torch

import storage
from tests.support.capped_proxy import CappedProxy
from tests.support.server_process import listens
from tests.support.servers import boto3_client, create_bucket, moto_endpoint, s3_options

BUCKET = "dcp-capped"


@pytest.fixture(scope="module")
def upstream() -> str:
    endpoint = moto_endpoint()
    create_bucket(endpoint, BUCKET)
    return endpoint


def test_objects_and_a_checkpoint_pass_intact(upstream: str) -> None:
    payload = os.urandom(3 << 20)
    state = {
        f"w{i}": torch.randn(1 << 20, generator=torch.Generator().manual_seed(i)) for i in range(3)
    }
    with CappedProxy(upstream, rate=200e6, latency=0.001) as proxy:
        client = boto3_client(proxy.url)
        client.put_object(Bucket=BUCKET, Key="raw", Body=payload)
        assert client.get_object(Bucket=BUCKET, Key="raw")["Body"].read() == payload
        assert proxy.bytes_up >= len(payload) and proxy.bytes_down >= len(payload)

        # Our S3 path: parallel connections, multipart parts, ranged reads.
        url = f"s3://{BUCKET}/{uuid.uuid4().hex}/ckpt"
        opts = s3_options(proxy.url)
        storage.save(state, url, storage_options=opts)
        loaded = {k: torch.zeros_like(v) for k, v in state.items()}
        storage.load(loaded, url, storage_options=opts)
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_a_transfer_takes_at_least_its_bytes_over_the_cap(upstream: str) -> None:
    # The bucket lets at most rate * t + burst bytes through in t seconds, both
    # directions together, so moving N bytes takes at least (N - burst) / rate.
    rate, burst = 2e6, 64 << 10
    payload = os.urandom(1 << 20)
    with CappedProxy(upstream, rate=rate, latency=0.0, burst=burst, chunk=64 << 10) as proxy:
        client = boto3_client(proxy.url)
        client.head_bucket(Bucket=BUCKET)  # connection and signing set up outside the clock
        moved_before = proxy.bytes_up + proxy.bytes_down
        start = time.monotonic()
        client.put_object(Bucket=BUCKET, Key="capped", Body=payload)
        body = client.get_object(Bucket=BUCKET, Key="capped")["Body"].read()
        elapsed = time.monotonic() - start
        moved = proxy.bytes_up + proxy.bytes_down - moved_before
    assert body == payload
    assert moved >= 2 * len(payload)
    assert elapsed >= (moved - burst) / rate


def test_each_request_waits_the_latency(upstream: str) -> None:
    latency, requests = 0.1, 4
    with CappedProxy(upstream, rate=None, latency=latency) as proxy:
        client = boto3_client(proxy.url)
        start = time.monotonic()
        for _ in range(requests):  # one keep-alive connection, one exchange each
            client.head_bucket(Bucket=BUCKET)
        assert time.monotonic() - start >= requests * latency


def test_closed_proxy_refuses_connections(upstream: str) -> None:
    proxy = CappedProxy(upstream)
    address = urllib.parse.urlsplit(proxy.url)
    boto3_client(proxy.url).head_bucket(Bucket=BUCKET)
    assert address.port is not None and listens(os.getpid(), address.port)
    proxy.close()
    # Nothing of ours listens there any more (a connection attempt could reach a
    # neighbour that took the freed port meanwhile).
    assert not listens(os.getpid(), address.port)


def test_bad_settings_are_refused(upstream: str) -> None:
    with pytest.raises(ValueError, match="rate and burst"):
        CappedProxy(upstream, rate=0)
    with pytest.raises(ValueError, match="latency"):
        CappedProxy(upstream, latency=-1)
