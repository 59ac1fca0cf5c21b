"""GCSFileSystem against fake-gcs-server: conformance, DCP round trips, commit protocol,
conditional creates, bad input, and transient faults through the proxy."""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import storage
from extensions import ZStandard
from extensions.errors import CheckpointExistsError, CheckpointNotFoundError, IntegrityError
from storage import GCSFileSystem
from storage.backends.base import FileSystemBase
from storage.testing import FileSystemTests
from tests.support.servers import (
    FaultProxy,
    fake_gcs_endpoint,
    gcs_create_bucket,
    gcs_get,
    gcs_list,
    gcs_options,
    gcs_put,
)
from tests.support.trees import assert_tree_equal, zeros_like_tree

BUCKET = "dcp-gcs"


@pytest.fixture(scope="module")
def endpoint() -> str:
    url = fake_gcs_endpoint()
    gcs_create_bucket(url, BUCKET)
    return url


def _url() -> str:
    return f"gs://{BUCKET}/{uuid.uuid4().hex}/ckpt"


def _prefix(url: str) -> str:
    return url.removeprefix(f"gs://{BUCKET}/") + "/"


class TestGCSFileSystem(FileSystemTests):
    @pytest.fixture
    def fs(self, endpoint: str) -> FileSystemBase:
        # 1 MiB chunks, no single request past one: the 5 MiB case goes up as a
        # resumable upload of several chunks.
        return GCSFileSystem(
            storage_options=gcs_options(endpoint), part_size=1 << 20, single_request_size=1 << 20
        )

    @pytest.fixture
    def root(self, fs: FileSystemBase) -> str:
        return fs.init_path(f"gs://{BUCKET}/{uuid.uuid4().hex}")

    @pytest.fixture(autouse=True)
    def _endpoint(self, endpoint: str) -> None:
        self.endpoint = endpoint

    def bypass_write(self, fs: FileSystemBase, path: str, data: bytes) -> None:
        bucket, _, key = path.partition("/")
        gcs_put(self.endpoint, bucket, key, data)

    def bypass_read(self, fs: FileSystemBase, path: str) -> bytes:
        bucket, _, key = path.partition("/")
        return gcs_get(self.endpoint, bucket, key)


class TestGCSFileSystemStreamed(TestGCSFileSystem):
    """The same contract where GETs go through gcsfs's aiohttp session (a client with
    ``session_kwargs`` gets no direct path)."""

    @pytest.fixture
    def fs(self, endpoint: str) -> FileSystemBase:
        options = gcs_options(endpoint, session_kwargs={"trust_env": False})
        return GCSFileSystem(
            storage_options=options, part_size=1 << 20, single_request_size=1 << 20
        )


def test_urls(endpoint: str) -> None:
    for scheme in ("gs", "gcs"):
        fs, path = storage.filesystem_from_url(
            f"{scheme}://{BUCKET}/a/b/", storage_options=gcs_options(endpoint)
        )
        assert isinstance(fs, GCSFileSystem) and path == f"{BUCKET}/a/b"
        assert fs.url(path) == f"gs://{BUCKET}/a/b"


@pytest.mark.parametrize("chain", ["plain", "zstd"])
def test_dcp_round_trip(endpoint: str, state_dict: dict, chain: str) -> None:
    url = _url()
    opts = gcs_options(endpoint)
    transforms = [ZStandard()] if chain == "zstd" else []
    writer = storage.CheckpointWriter(url, transforms=transforms, storage_options=opts)
    dcp.save(state_dict, storage_writer=writer)
    target = zeros_like_tree(state_dict)
    dcp.load(target, storage_reader=storage.CheckpointReader(url, storage_options=opts))
    assert_tree_equal(state_dict, target)
    again = zeros_like_tree(state_dict)
    storage.load(again, url, storage_options=opts)
    assert_tree_equal(state_dict, again)


def test_resumable_upload_round_trip(endpoint: str) -> None:
    url = _url()
    fs = GCSFileSystem(
        storage_options=gcs_options(endpoint), part_size=1 << 20, single_request_size=1 << 20
    )
    state = {"big": torch.randn(1 << 20), "small": torch.arange(5)}  # 4 MiB: 4+ chunks
    storage.save(state, url, filesystem=fs, transforms=[ZStandard()])
    target = {"big": torch.zeros(1 << 20), "small": torch.zeros(5, dtype=torch.int64)}
    storage.load(target, url, storage_options=gcs_options(endpoint))
    assert_tree_equal(state, target)


def test_failed_resumable_write_leaves_nothing(endpoint: str) -> None:
    fs = GCSFileSystem(
        storage_options=gcs_options(endpoint), part_size=1 << 20, single_request_size=1 << 20
    )
    path = fs.init_path(_url()) + "/obj"
    with pytest.raises(RuntimeError, match="boom"), fs.create_stream(path, "wb") as stream:
        stream.write(b"x" * (3 << 20))  # a resumable session is open by now
        raise RuntimeError("boom")
    assert gcs_list(endpoint, BUCKET, path.partition("/")[2]) == []


def test_overwrite_false_and_conditional_create(endpoint: str, state_dict: dict) -> None:
    url = _url()
    opts = gcs_options(endpoint)
    storage.save(state_dict, url, storage_options=opts, overwrite=False)
    before = gcs_list(endpoint, BUCKET, _prefix(url))
    with pytest.raises(CheckpointExistsError, match="overwrite=False"):
        storage.save(state_dict, url, storage_options=opts, overwrite=False)
    assert gcs_list(endpoint, BUCKET, _prefix(url)) == before
    # fake-gcs-server enforces ifGenerationMatch=0 on simple uploads (the emulator
    # gcp-storage-emulator would silently overwrite): the server refuses the create.
    fs = GCSFileSystem(storage_options=opts)
    path = fs.init_path(url) + "/.metadata"
    committed = gcs_get(endpoint, BUCKET, path.partition("/")[2])
    with pytest.raises(FileExistsError):
        fs.write_atomic(path, b"other", exclusive=True)
    assert gcs_get(endpoint, BUCKET, path.partition("/")[2]) == committed


def test_missing_bucket(endpoint: str, state_dict: dict) -> None:
    url = "gs://no-such-gcs-bucket/ckpt"
    opts = gcs_options(endpoint)
    with pytest.raises(FileNotFoundError, match="no-such-gcs-bucket.*does not exist"):
        storage.save(state_dict, url, storage_options=opts)
    with pytest.raises(FileNotFoundError, match=f"no checkpoint at {url}"):
        storage.load(zeros_like_tree(state_dict), url, storage_options=opts)


def test_not_a_checkpoint(endpoint: str, state_dict: dict) -> None:
    url = _url()
    gcs_put(endpoint, BUCKET, _prefix(url) + "notes.txt", b"hello")
    with pytest.raises(CheckpointNotFoundError, match=f"{url} is not a committed checkpoint"):
        storage.load(zeros_like_tree(state_dict), url, storage_options=gcs_options(endpoint))


def _data_key(url: str, opts: dict, fqn: str) -> tuple[str, Any]:
    md = storage.CheckpointReader(url, storage_options=opts).read_metadata()
    for index, info in md.storage_data.items():
        if index.fqn == fqn:
            return _prefix(url) + info.relative_path, info
    raise AssertionError(fqn)


def test_missing_and_truncated_data_objects(endpoint: str, state_dict: dict) -> None:
    url = _url()
    opts = gcs_options(endpoint)
    storage.save(state_dict, url, storage_options=opts, thread_count=1)
    key, info = _data_key(url, opts, "w")
    data = gcs_get(endpoint, BUCKET, key)
    gcs_put(endpoint, BUCKET, key, data[: info.offset + 10])
    with pytest.raises(IntegrityError, match=rf"{url}: item 'w'.*truncated"):
        storage.load(zeros_like_tree(state_dict), url, storage_options=opts)
    quoted = urllib.request.quote(key, safe="")
    req = urllib.request.Request(f"{endpoint}/storage/v1/b/{BUCKET}/o/{quoted}", method="DELETE")
    urllib.request.urlopen(req).read()
    with pytest.raises(CheckpointNotFoundError, match=rf"{url}: data file .* is missing"):
        storage.load(zeros_like_tree(state_dict), url, storage_options=opts)


@pytest.fixture
def gcs_proxy(endpoint: str) -> Iterator[FaultProxy]:
    with FaultProxy(endpoint, seed=7) as proxy:
        yield proxy


def test_transient_faults_are_retried(gcs_proxy: FaultProxy, state_dict: dict) -> None:
    url = _url()
    opts = gcs_options(gcs_proxy.url)
    uploads = gcs_proxy.add("gcs503", method="POST", path=r"/upload/", count=1)
    reads = gcs_proxy.add("truncate", method="GET", path=r"alt=media", count=1)
    storage.save(state_dict, url, storage_options=opts, transforms=[ZStandard()])
    target = zeros_like_tree(state_dict)
    storage.load(target, url, storage_options=opts)
    assert_tree_equal(state_dict, target)
    assert uploads.hits == 1 and reads.hits == 1
