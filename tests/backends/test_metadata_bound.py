"""A metadata object over ``MAX_METADATA_BYTES`` on an object store is refused after
fetching at most one byte more than the bound, in the one GET a metadata read takes
anyway (no size request first). Counted by a proxy in front of real servers (moto,
SeaweedFS, fake-gcs-server), from the GET response bodies it relays."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import torch

import storage
from extensions.errors import UnsafeCheckpointError
from storage import GCSFileSystem, S3FileSystem
from storage.backends.base import FileSystemBase
from storage.checkpoint import committed
from storage.checkpoint import storage_format as fmt
from tests.support.servers import (
    FaultProxy,
    Record,
    ServerUnavailable,
    create_bucket,
    fake_gcs_endpoint,
    gcs_create_bucket,
    gcs_options,
    s3_endpoint,
    s3_options,
)

BUCKET = "dcp-meta-bound"
LIMIT = 64 << 10


@pytest.fixture(scope="module", params=["moto", "seaweedfs", "fake-gcs"])
def store(request: pytest.FixtureRequest) -> Iterator[tuple[FaultProxy, FileSystemBase, str]]:
    """(proxy, a backend that talks through it, the URL scheme)."""
    if request.param == "fake-gcs":
        endpoint = fake_gcs_endpoint()
        gcs_create_bucket(endpoint, BUCKET)
    else:
        try:
            endpoint = s3_endpoint(request.param)
        except ServerUnavailable as exc:
            pytest.skip(str(exc))
        create_bucket(endpoint, BUCKET)
    with FaultProxy(endpoint) as proxy:
        fs: FileSystemBase
        if request.param == "fake-gcs":
            fs, scheme = GCSFileSystem(storage_options=gcs_options(proxy.url)), "gs"
        else:
            fs, scheme = S3FileSystem(storage_options=s3_options(proxy.url)), "s3"
        yield proxy, fs, scheme


def _checkpoint(fs: FileSystemBase, scheme: str) -> tuple[str, str]:
    """(url, path of its .metadata) of a small committed checkpoint."""
    url = f"{scheme}://{BUCKET}/{uuid.uuid4().hex}/ckpt"
    storage.save({"t": torch.ones(8)}, url, filesystem=fs)
    return url, fs.concat_path(fs.init_path(url), ".metadata")


def _of_metadata(proxy: FaultProxy, url: str) -> list[Record]:
    """The requests for ``url``'s metadata: the save's background work (removing what it
    replaced) and an earlier test's load may still be talking to the shared proxy, and on
    a loaded machine their records land after ``clear``. Object names hold the
    checkpoint's random part, in S3's paths and GCS's encoded ones alike. Writes are left
    out: the test's own write of the metadata may be recorded after ``clear`` too."""
    tag = url.split("/")[3]
    return [
        r
        for r in proxy.settle()
        if tag in r.target
        and r.target.split("?")[0].endswith("metadata")
        and r.method not in ("PUT", "POST")
    ]


def test_an_oversized_metadata_is_refused_after_one_get_of_the_bound_plus_one_byte(
    store: tuple[FaultProxy, FileSystemBase, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy, fs, scheme = store
    url, meta = _checkpoint(fs, scheme)
    fs.write_atomic(meta, bytes(4 * LIMIT))  # a metadata bomb, far past the bound
    monkeypatch.setattr(fmt, "MAX_METADATA_BYTES", LIMIT)
    proxy.clear()
    with pytest.raises(UnsafeCheckpointError, match="larger than"):
        committed.read_metadata_bytes(fs, meta)
    records = _of_metadata(proxy, url)
    assert len(records) == 1, [(r.method, r.target, r.range, r.body_bytes) for r in proxy.settle()]
    (request,) = records  # one request: no size asked first
    assert request.method == "GET" and request.body_bytes == LIMIT + 1
    proxy.clear()
    with pytest.raises(UnsafeCheckpointError, match="larger than"):
        storage.load({"t": torch.zeros(8)}, url, filesystem=fs)
    # Never the whole object (counting only this checkpoint's requests, as above).
    got = sum(r.body_bytes for r in _of_metadata(proxy, url) if r.method == "GET")
    assert 0 < got <= 2 * (LIMIT + 1)


def test_a_metadata_within_the_bound_is_read_whole_in_one_get(
    store: tuple[FaultProxy, FileSystemBase, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy, fs, scheme = store
    url, meta = _checkpoint(fs, scheme)
    size = fs.size(meta)
    for limit in (size, fmt.MAX_METADATA_BYTES):  # exactly at the bound, and the default
        monkeypatch.setattr(fmt, "MAX_METADATA_BYTES", limit)
        proxy.clear()
        assert len(committed.read_metadata_bytes(fs, meta)) == size
        (request,) = _of_metadata(proxy, url)
        assert request.method == "GET" and request.body_bytes == size
