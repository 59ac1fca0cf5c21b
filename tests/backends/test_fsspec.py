"""FsspecFileSystem on fsspec's in-memory filesystem: conformance and DCP round trips."""

from __future__ import annotations

import pickle
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from fsspec.implementations.memory import MemoryFile
from fsspec.implementations.memory import MemoryFileSystem as FsspecMemory

import storage
from extensions import ZStandard
from storage import FsspecFileSystem
from storage.backends.base import FileSystemBase
from storage.testing import FileSystemTests
from tests.support.trees import assert_tree_equal, zeros_like_tree


class TestFsspecMemory(FileSystemTests):
    @pytest.fixture
    def fs(self) -> FileSystemBase:
        return FsspecFileSystem(protocol="memory")

    @pytest.fixture
    def root(self, fs: FileSystemBase) -> str:
        return fs.init_path(f"memory://{uuid.uuid4().hex}")

    def bypass_write(self, fs: FileSystemBase, path: str, data: bytes) -> None:
        FsspecMemory.store[path] = MemoryFile(None, path, data)

    def bypass_read(self, fs: FileSystemBase, path: str) -> bytes:
        return bytes(FsspecMemory.store[path].getvalue())


def test_paths_and_urls() -> None:
    fs, path = storage.filesystem_from_url("memory://bkt/ckpt")
    assert isinstance(fs, FsspecFileSystem)
    assert path == "/bkt/ckpt"
    assert fs.url(fs.concat_path(path, ".metadata")) == "memory:///bkt/ckpt/.metadata"
    with pytest.raises(ValueError, match="not a memory:// URL"):
        fs.init_path("s3://other/ckpt")
    with pytest.raises(ValueError, match="no protocol"):
        FsspecFileSystem().init_path("relative/path")


def test_storage_options_reach_fsspec() -> None:
    # skip_instance_cache and global_store are MemoryFileSystem's own options: a private
    # store proves the options went to the fsspec class unchanged.
    opts = {"global_store": False, "skip_instance_cache": True}
    fs, path = storage.filesystem_from_url("memory://private/x", storage_options=opts)
    fs.write_atomic(fs.concat_path(path, "obj"), b"data")
    assert fs.read_bytes(fs.concat_path(path, "obj")) == b"data"
    assert "/private/x/obj" not in FsspecMemory.store
    clone = pickle.loads(pickle.dumps(fs))
    assert clone.storage_options == opts


def test_file_protocol(tmp_path: object) -> None:
    fs = FsspecFileSystem()
    root = fs.init_path(f"file://{tmp_path}/ckpt")
    target = fs.concat_path(root, "a/b.bin")
    with fs.create_stream(target, "wb") as stream:
        stream.write(b"0123456789")
    with fs.open_slice(target, 3, 4) as view:
        assert view.read() == b"3456"
    assert fs.ls(root) == ["a"]


@pytest.mark.parametrize("chain", ["plain", "zstd"])
def test_dcp_round_trip(state_dict: dict[str, object], chain: str) -> None:
    url = f"memory://{uuid.uuid4().hex}/ckpt"
    transforms = [ZStandard()] if chain == "zstd" else []
    dcp.save(state_dict, storage_writer=storage.CheckpointWriter(url, transforms=transforms))
    target = zeros_like_tree(state_dict)
    dcp.load(target, storage_reader=storage.CheckpointReader(url))
    assert_tree_equal(target, state_dict)
    again = zeros_like_tree(state_dict)
    storage.load(again, url)
    assert_tree_equal(again, state_dict)


def test_storage_save_load_helpers() -> None:
    url = f"memory://{uuid.uuid4().hex}/ckpt"
    state = {"a": torch.arange(10), "b": torch.ones(3, 3)}
    storage.save(state, url, transforms=[ZStandard()])
    target = {"a": torch.zeros(10, dtype=torch.int64), "b": torch.zeros(3, 3)}
    storage.load(target, url)
    assert_tree_equal(target, state)
