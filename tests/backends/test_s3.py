"""S3FileSystem against moto's S3 server: conformance, DCP round trips, commit protocol.

The conformance suite, the round trips and the commit-protocol checks run against
SeaweedFS too (a real object store, ``weed mini``), marked ``BOTH_SERVERS``."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import threading
import time
import uuid
from typing import IO, Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint._extension import ZStandard as TorchZStandard
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException

import storage
from extensions import StreamTransformExtension, ZStandard
from extensions.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    IntegrityError,
    MissingDependencyError,
)
from storage import S3FileSystem
from storage.backends.base import FileSystemBase
from storage.testing import FileSystemTests
from tests.support.distributed import gloo_group, spawn
from tests.support.servers import (
    FaultProxy,
    boto3_client,
    endpoint_with_bucket,
    list_keys,
    open_uploads,
    s3_options,
)
from tests.support.trees import assert_tree_equal, zeros_like_tree

BUCKET = "dcp-tests"

# Tests marked so run on moto and on SeaweedFS; the others on moto alone.
BOTH_SERVERS = pytest.mark.parametrize("endpoint", ["moto", "seaweedfs"], indirect=True)


@pytest.fixture(scope="module")
def endpoint(request: pytest.FixtureRequest) -> str:
    return endpoint_with_bucket(request, BUCKET)


@pytest.fixture(scope="module")
def s3(endpoint: str) -> Any:
    return boto3_client(endpoint)


@BOTH_SERVERS
class TestS3FileSystem(FileSystemTests):
    @pytest.fixture
    def fs(self, endpoint: str) -> FileSystemBase:
        return S3FileSystem(storage_options=s3_options(endpoint), part_size=5 << 20)

    @pytest.fixture
    def root(self, fs: FileSystemBase) -> str:
        return fs.init_path(f"s3://{BUCKET}/{uuid.uuid4().hex}")

    @pytest.fixture(autouse=True)
    def _client(self, s3: Any) -> None:
        self.s3 = s3

    def bypass_write(self, fs: FileSystemBase, path: str, data: bytes) -> None:
        bucket, _, key = path.partition("/")
        self.s3.put_object(Bucket=bucket, Key=key, Body=data)

    def bypass_read(self, fs: FileSystemBase, path: str) -> bytes:
        bucket, _, key = path.partition("/")
        return bytes(self.s3.get_object(Bucket=bucket, Key=key)["Body"].read())

    def bypass_begin_upload(self, fs: FileSystemBase, path: str) -> None:
        bucket, _, key = path.partition("/")
        self.s3.create_multipart_upload(Bucket=bucket, Key=key)


# --- helpers -------------------------------------------------------------------------


def _url(prefix: str = "ckpt") -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex}/{prefix}"


def _key_prefix(url: str) -> str:
    return url.removeprefix(f"s3://{BUCKET}/") + "/"


class _FailAfter(StreamTransformExtension):
    """Passes bytes through, then raises once ``limit`` bytes went by in total: a save
    that dies in the middle of a multipart upload."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.seen = 0

    @staticmethod
    def registry_name() -> str:
        return "tests.fail_after"

    @staticmethod
    def from_descriptor(version: str) -> StreamTransformExtension:
        return _FailAfter(0)

    def get_descriptor(self) -> str:
        return "tests.fail_after/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        parent = self

        class _Writer(io.RawIOBase):
            def writable(self) -> bool:
                return True

            def write(self, data: Any) -> int:
                n = memoryview(data).nbytes
                parent.seen += n
                if parent.seen > parent.limit:
                    raise RuntimeError("injected failure in the middle of an upload")
                return output.write(data) or n

        return _Writer()  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return input


def _big_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {f"t{i}": torch.randn(1 << 20, generator=gen) for i in range(4)}  # 4 x 4 MiB


# --- round trips ---------------------------------------------------------------------


@BOTH_SERVERS
@pytest.mark.parametrize("chain", ["plain", "zstd"])
def test_dcp_round_trip(endpoint: str, state_dict: dict, chain: str) -> None:
    url = _url()
    opts = s3_options(endpoint)
    transforms = [ZStandard()] if chain == "zstd" else []
    writer = storage.CheckpointWriter(url, transforms=transforms, storage_options=opts)
    dcp.save(state_dict, storage_writer=writer)
    target = zeros_like_tree(state_dict)
    dcp.load(target, storage_reader=storage.CheckpointReader(url, storage_options=opts))
    assert_tree_equal(state_dict, target)


@pytest.mark.parametrize("chain", ["plain", "zstd"])
def test_save_load_helpers_multipart(endpoint: str, s3: Any, chain: str) -> None:
    url = _url()
    fs = S3FileSystem(storage_options=s3_options(endpoint), part_size=5 << 20)
    state = _big_state()
    transforms = [ZStandard()] if chain == "zstd" else []
    writer = storage.CheckpointWriter(url, transforms=transforms, filesystem=fs, thread_count=2)
    dcp.save(state, storage_writer=writer)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    storage.load(target, url, storage_options=s3_options(endpoint))
    assert_tree_equal(state, target)
    assert open_uploads(s3, BUCKET, _key_prefix(url)) == []


def test_sync_files_never_syncs_this_machine(
    endpoint: str, state_dict: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Stock DCP calls os.sync() for fsspec paths: a whole-machine flush for nothing.
    def forbidden(*args: object) -> None:
        raise AssertionError("os.sync/os.fsync called while saving to S3")

    monkeypatch.setattr(os, "sync", forbidden)
    monkeypatch.setattr(os, "fsync", forbidden)
    url = _url()
    storage.save(state_dict, url, storage_options=s3_options(endpoint), sync_files=True)
    monkeypatch.undo()
    target = zeros_like_tree(state_dict)
    storage.load(target, url, storage_options=s3_options(endpoint))
    assert_tree_equal(state_dict, target)


def test_filesystem_from_url_and_pickle(endpoint: str) -> None:
    for scheme in ("s3", "s3a"):
        fs, path = storage.filesystem_from_url(
            f"{scheme}://{BUCKET}/a/b/", storage_options=s3_options(endpoint)
        )
        assert isinstance(fs, S3FileSystem) and path == f"{BUCKET}/a/b"
        assert fs.url(path) == f"s3://{BUCKET}/a/b"
    clone = pickle.loads(pickle.dumps(fs))
    assert clone.part_size == fs.part_size and clone.storage_options == fs.storage_options
    assert S3FileSystem.validate_checkpoint_id("s3://b/x")
    assert not S3FileSystem.validate_checkpoint_id("/tmp/x")


@BOTH_SERVERS
def test_failed_multipart_write_aborts_upload(endpoint: str, s3: Any) -> None:
    fs = S3FileSystem(storage_options=s3_options(endpoint), part_size=5 << 20)
    path = fs.init_path(_url())
    with pytest.raises(RuntimeError, match="boom"), fs.create_stream(path, "wb") as stream:
        stream.write(b"x" * (12 << 20))  # two parts already on their way
        raise RuntimeError("boom")
    prefix = path.partition("/")[2]
    assert open_uploads(s3, BUCKET, prefix) == []
    assert list_keys(s3, BUCKET, prefix) == []


_UPLOAD_40_MIB = """
import sys, tracemalloc
from storage import S3FileSystem
opts = {"endpoint_url": sys.argv[1], "key": "testing", "secret": "testing"}
fs = S3FileSystem(storage_options=opts, part_size=5 << 20, max_concurrency=3)
chunk = bytes(range(256)) * 4096
fs.exists(sys.argv[2])  # the client and its service model are loaded before counting
tracemalloc.start()
with fs.create_stream(sys.argv[2], "wb") as stream:
    for _ in range(40):
        stream.write(chunk)
print(tracemalloc.get_traced_memory()[1])
"""


def test_parts_upload_concurrently_in_bounded_memory(endpoint: str, s3: Any) -> None:
    path = S3FileSystem().init_path(_url())
    with FaultProxy(endpoint) as proxy:
        # Part uploads are held until three are in flight (before: each was delayed
        # 0.3 s, and a loaded machine could keep the writer from getting a third one out
        # within that): parts would pile up in memory now if nothing bounded them.
        release = threading.Event()
        proxy.add("delay", method="PUT", path=r"partNumber=", delay=300, release=release)

        def open_at_three() -> None:
            deadline = time.monotonic() + 120  # bounds a failure only
            while not release.is_set() and time.monotonic() < deadline:
                parts = [t for m, t in proxy.arrivals if m == "PUT" and "partNumber=" in t]
                if len(parts) >= 3:
                    # A fourth would arrive now were the uploads not bounded.
                    release.wait(0.5)
                    break
                release.wait(0.01)
            release.set()

        opener = threading.Thread(target=open_at_three, daemon=True)
        opener.start()
        # A separate process: moto and the proxy live in this one and would be counted.
        try:
            out = subprocess.run(
                [sys.executable, "-c", _UPLOAD_40_MIB, proxy.url, path],
                capture_output=True,
                text=True,
                check=True,
                timeout=300,
            )
        finally:
            release.set()
            opener.join(60)
        assert proxy.max_concurrent("PUT", "partNumber=") == 3
    peak = int(out.stdout.split()[-1])
    bucket, _, key = path.partition("/")
    assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == bytes(range(256)) * 4096 * 40
    # part_size x (max_concurrency + the buffer being filled) = 20 MiB of a 40 MiB object.
    print("peak client memory", peak)
    assert peak < 26 << 20, peak


_BAD_DIGEST = r"uploading part 2 failed.*(BadDigest|did not match what we received)"


@pytest.mark.parametrize("endpoint", ["seaweedfs"], indirect=True)  # moto checks no CRC32C
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "s3fs"])
def test_corrupted_part_is_refused_by_the_store(endpoint: str, s3: Any, direct: bool) -> None:
    # Payloads are not SHA-256-signed: the CRC32C each upload carries is what lets
    # the store refuse a body changed on the wire.
    path = S3FileSystem().init_path(_url())
    with FaultProxy(endpoint) as proxy:
        proxy.add("corrupt", method="PUT", path=r"partNumber=2", count=1)
        opts = s3_options(proxy.url)
        fs = S3FileSystem(storage_options=opts, part_size=5 << 20, direct=direct)
        with pytest.raises(OSError, match=_BAD_DIGEST), fs.create_stream(path, "wb") as stream:
            stream.write(b"x" * (12 << 20))
    prefix = path.partition("/")[2]
    assert list_keys(s3, BUCKET, prefix) == []
    assert open_uploads(s3, BUCKET, prefix) == []


def test_filesystems_with_the_same_options_share_a_client(endpoint: str) -> None:
    a = S3FileSystem(storage_options=s3_options(endpoint))
    b = S3FileSystem(storage_options=s3_options(endpoint), part_size=8 << 20)
    c = S3FileSystem(storage_options=s3_options(endpoint, config_kwargs={"read_timeout": 5}))
    assert a.fs is b.fs and a.fs is not c.fs
    assert a.client is not b.client  # upload slots stay per filesystem


def test_missing_s3fs_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "s3fs", None)  # what an absent package looks like
    monkeypatch.delitem(sys.modules, "storage.backends.s3")
    monkeypatch.delitem(sys.modules, "storage.backends.s3._filesystem")
    with pytest.raises(MissingDependencyError, match=r"pip install 'dcp-storage\[s3\]'"):
        storage.filesystem_from_url("s3://bucket/ckpt")


# --- commit protocol -----------------------------------------------------------------


@BOTH_SERVERS
def test_failed_save_keeps_committed_checkpoint(endpoint: str, s3: Any) -> None:
    url = _url()
    opts = s3_options(endpoint)
    state = _big_state()
    storage.save(state, url, storage_options=opts)
    prefix = _key_prefix(url)
    before = {
        k: s3.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in list_keys(s3, BUCKET, prefix)
    }
    changed = {k: v + 1 for k, v in state.items()}
    with FaultProxy(endpoint) as proxy:  # no faults: it only shows the requests made
        fs = S3FileSystem(storage_options=s3_options(proxy.url), part_size=5 << 20)
        # Two 8 MiB files in parallel; dies after 13 MiB, with a multipart upload open.
        writer = storage.CheckpointWriter(
            url, filesystem=fs, transforms=[_FailAfter(13 << 20)], thread_count=2
        )
        with pytest.raises(CheckpointException):  # torch.save reports a zip-writer error
            dcp.save(changed, storage_writer=writer)
        requests = [(m, t) for m, t in proxy.arrivals]
    assert any(m == "POST" and t.endswith("?uploads") for m, t in requests)
    assert any(m == "DELETE" and "uploadId=" in t for m, t in requests)
    after = {
        k: s3.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in list_keys(s3, BUCKET, prefix)
    }
    assert after == before
    assert open_uploads(s3, BUCKET, prefix) == []
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    storage.load(target, url, storage_options=opts)
    assert_tree_equal(state, target)


@BOTH_SERVERS
def test_overwrite_false(endpoint: str, s3: Any, state_dict: dict) -> None:
    url = _url()
    opts = s3_options(endpoint)
    storage.save(state_dict, url, storage_options=opts, overwrite=False)
    before = list_keys(s3, BUCKET, _key_prefix(url))
    with pytest.raises(CheckpointExistsError, match="overwrite=False"):
        storage.save(state_dict, url, storage_options=opts, overwrite=False)
    assert list_keys(s3, BUCKET, _key_prefix(url)) == before


@BOTH_SERVERS
def test_exclusive_publish_uses_if_none_match(endpoint: str, s3: Any) -> None:
    # Published behind the backend's back between its check and its PUT: only a
    # conditional create on the server can refuse the second writer.
    fs = S3FileSystem(storage_options=s3_options(endpoint))
    path = fs.init_path(_url())
    s3.put_object(Bucket=BUCKET, Key=path.partition("/")[2], Body=b"theirs")
    with pytest.raises(FileExistsError, match="already exists"):
        fs.write_atomic(path, b"ours", exclusive=True)
    assert s3.get_object(Bucket=BUCKET, Key=path.partition("/")[2])["Body"].read() == b"theirs"


# --- two ranks -----------------------------------------------------------------------


def _rank_worker(rank: int, store: str, url: str, opts: dict) -> None:
    with gloo_group(rank, 2, store):
        gen = torch.Generator().manual_seed(rank)
        state = {f"r{rank}": torch.randn(1000, generator=gen), "shared": torch.arange(10)}
        storage.save(state, url, storage_options=opts, transforms=[ZStandard()])


def test_two_rank_gloo_save_loads_on_one(endpoint: str, tmp_path: Any) -> None:
    url = _url()
    opts = s3_options(endpoint)
    spawn(_rank_worker, args=(str(tmp_path / "store"), url, opts), nprocs=2, join=True)
    target = {
        "r0": torch.zeros(1000),
        "r1": torch.zeros(1000),
        "shared": torch.zeros(10, dtype=torch.int64),
    }
    storage.load(target, url, storage_options=opts)
    for rank in (0, 1):
        expected = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
        assert torch.equal(target[f"r{rank}"], expected)
    assert torch.equal(target["shared"], torch.arange(10))


# --- interop with stock DCP ----------------------------------------------------------


@pytest.mark.parametrize("chain", ["plain", "zstd"])
def test_stock_fsspec_reader_loads_ours(endpoint: str, state_dict: dict, chain: str) -> None:
    url = _url()
    opts = s3_options(endpoint)
    storage.save(
        state_dict, url, storage_options=opts, transforms=[ZStandard()] if chain == "zstd" else []
    )
    target = zeros_like_tree(state_dict)
    dcp.load(target, storage_reader=FsspecReader(url, **opts))
    assert_tree_equal(state_dict, target)


@pytest.mark.parametrize("ext", [None, "zstd"])
def test_our_reader_loads_stock_fsspec_writer(endpoint: str, state_dict: dict, ext: Any) -> None:
    url = _url()
    opts = s3_options(endpoint)
    extensions = [TorchZStandard()] if ext else None
    dcp.save(state_dict, storage_writer=FsspecWriter(url, _extensions=extensions, **opts))
    target = zeros_like_tree(state_dict)
    storage.load(target, url, storage_options=opts)
    assert_tree_equal(state_dict, target)


# --- bad input -----------------------------------------------------------------------


def test_missing_bucket(endpoint: str, state_dict: dict) -> None:
    url = "s3://no-such-bucket-here/ckpt"
    opts = s3_options(endpoint)
    with pytest.raises(FileNotFoundError, match="no-such-bucket-here.*does not exist"):
        storage.save(state_dict, url, storage_options=opts)
    with pytest.raises(FileNotFoundError, match="no checkpoint at s3://no-such-bucket-here/ckpt"):
        storage.load(zeros_like_tree(state_dict), url, storage_options=opts)


def test_unreachable_endpoint_is_named(state_dict: dict) -> None:
    # Before: a reader given no (or a wrong) endpoint_url failed with the
    # client's bare connection error, which never said which endpoint it tried or why.
    import socket

    # A port bound here and never listened on: a connection is refused at once, and
    # while the socket is held no other process can bind the port and answer instead.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
        opts = s3_options(dead)
        opts["config_kwargs"] = {"retries": {"total_max_attempts": 1, "mode": "standard"}}
        with pytest.raises(
            ConnectionError, match=f"cannot reach the S3 endpoint {dead}.*endpoint_url"
        ):
            storage.load(zeros_like_tree(state_dict), "s3://bucket/ckpt", storage_options=opts)


def test_wrong_credentials(endpoint: str, state_dict: dict) -> None:
    import moto.settings

    url = _url()
    storage.save(state_dict, url, storage_options=s3_options(endpoint))
    bad = s3_options(endpoint, key="AKIAWRONGWRONGWRONG0", secret="wrong")
    # The server, not the client, refuses: moto checks credentials once IAM auth is on.
    old = moto.settings.INITIAL_NO_AUTH_ACTION_COUNT
    moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
    try:
        with pytest.raises(PermissionError, match=f"{url}.*check the credentials"):
            storage.load(zeros_like_tree(state_dict), url, storage_options=bad)
    finally:
        moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = old


def test_not_a_checkpoint(endpoint: str, s3: Any, state_dict: dict) -> None:
    url = _url()
    s3.put_object(Bucket=BUCKET, Key=_key_prefix(url) + "notes.txt", Body=b"hello")
    with pytest.raises(CheckpointNotFoundError, match=f"{url} is not a committed checkpoint"):
        storage.load(zeros_like_tree(state_dict), url, storage_options=s3_options(endpoint))


def _data_key(s3: Any, url: str, fqn: str) -> tuple[str, Any]:
    reader = storage.CheckpointReader(url, storage_options=s3_options(s3.meta.endpoint_url))
    md = reader.read_metadata()
    for index, info in md.storage_data.items():
        if index.fqn == fqn:
            return _key_prefix(url) + info.relative_path, info
    raise AssertionError(fqn)


def test_deleted_data_object(endpoint: str, s3: Any, state_dict: dict) -> None:
    url = _url()
    opts = s3_options(endpoint)
    storage.save(state_dict, url, storage_options=opts, thread_count=1)
    key, _ = _data_key(s3, url, "w")
    s3.delete_object(Bucket=BUCKET, Key=key)
    missing = rf"{url}: data file '__0_0-.*distcp' \(item '.*'\) is missing"
    with pytest.raises(CheckpointNotFoundError, match=missing):
        storage.load(zeros_like_tree(state_dict), url, storage_options=opts)


def test_object_deleted_mid_load(endpoint: str, s3: Any) -> None:
    url = _url()
    opts = s3_options(endpoint)
    state = {f"t{i:02d}": torch.full((1000,), float(i)) for i in range(20)}
    storage.save(state, url, storage_options=opts, thread_count=1)
    target = {k: torch.zeros_like(v) for k, v in state.items()}

    class DeleteAfterFirst(DefaultLoadPlanner):
        def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
            super().commit_tensor(read_item, tensor)
            for key in list_keys(s3, BUCKET, _key_prefix(url)):
                if key.endswith(".distcp"):
                    s3.delete_object(Bucket=BUCKET, Key=key)

    reader = storage.CheckpointReader(url, storage_options=opts, thread_count=1)
    # Coalescing would fetch everything in one GET; one item per request instead.
    with pytest.MonkeyPatch.context() as mpatch:
        mpatch.setattr("storage.checkpoint.fetch.COALESCE_LIMIT", 1)
        with pytest.raises(CheckpointException, match="is missing"):
            dcp.load(target, storage_reader=reader, planner=DeleteAfterFirst())


def test_truncated_object(endpoint: str, s3: Any, state_dict: dict) -> None:
    url = _url()
    opts = s3_options(endpoint)
    storage.save(state_dict, url, storage_options=opts, thread_count=1)
    key, info = _data_key(s3, url, "w")
    data = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    s3.put_object(Bucket=BUCKET, Key=key, Body=data[: info.offset + 10])
    with pytest.raises(IntegrityError, match=rf"{url}: item 'w'.*truncated"):
        storage.load(zeros_like_tree(state_dict), url, storage_options=opts)
