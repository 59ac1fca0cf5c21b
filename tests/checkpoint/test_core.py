"""DCP writer/reader on one process: round trips, options, interop, errors, commit protocol."""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import ZStandard as TorchZStandard
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import storage
from extensions import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    IntegrityError,
    UnknownTransformError,
    UnsafeCheckpointError,
    ZStandard,
)
from storage.checkpoint import storage_format as fmt
from tests.support.trees import assert_tree_equal, zeros_like_tree

TRANSFORMS = {"none": [], "zstd": [ZStandard(level=3)]}


def _files(path: Path) -> set[str]:
    return set(os.listdir(path))


def _read_metadata(path: Path) -> Any:
    return fmt.load_metadata((path / ".metadata").read_bytes(), str(path))


@pytest.mark.parametrize("chain", list(TRANSFORMS))
def test_round_trip_local_dcp_api(tmp_path: Path, state_dict: dict, chain: str) -> None:
    writer = storage.CheckpointWriter(tmp_path / "ckpt", transforms=TRANSFORMS[chain])
    dcp.save(state_dict, storage_writer=writer)
    target = zeros_like_tree(state_dict)
    dcp.load(target, storage_reader=storage.CheckpointReader(tmp_path / "ckpt"))
    assert_tree_equal(state_dict, target)


@pytest.mark.parametrize("chain", list(TRANSFORMS))
def test_round_trip_memory_backend(state_dict: dict, chain: str) -> None:
    fs = storage.MemoryFileSystem()
    storage.save(state_dict, "run/ckpt", transforms=TRANSFORMS[chain], filesystem=fs)
    target = zeros_like_tree(state_dict)
    storage.load(target, "run/ckpt", filesystem=fs)
    assert_tree_equal(state_dict, target)
    assert fs.ls("run/ckpt")[0] == ".metadata"


@pytest.mark.parametrize(
    "options",
    [
        {"thread_count": 1},
        {"thread_count": 3, "single_file_per_rank": True},
        {"single_file_per_rank": False},
        {"sync_files": False},
    ],
    ids=["1-thread", "3-threads", "file-per-item", "no-sync"],
)
def test_writer_options(tmp_path: Path, state_dict: dict, options: dict) -> None:
    storage.save(state_dict, tmp_path / "c", **options)
    data_files = [n for n in _files(tmp_path / "c") if n.endswith(".distcp")]
    if options.get("single_file_per_rank") is False:
        assert len(data_files) == len(_read_metadata(tmp_path / "c").storage_data)
    target = zeros_like_tree(state_dict)
    storage.load(target, tmp_path / "c", thread_count=2)
    assert_tree_equal(state_dict, target)


def test_every_item_records_checksum_and_layout(tmp_path: Path, state_dict: dict) -> None:
    storage.save(state_dict, tmp_path / "c", transforms=[ZStandard()])
    md = _read_metadata(tmp_path / "c")
    assert md.dcp_storage == {"format": fmt.FORMAT_VERSION, "ranks": 1}  # one process saved
    for index, info in md.storage_data.items():
        extra = getattr(info, fmt.EXTRA)  # as stored
        assert isinstance(extra["crc32c"], int), index
        assert info.transform_descriptors == ["stream.zstd/1"]
        assert info.relative_path.startswith("__0_") and info.relative_path.endswith(".distcp")
        if index.fqn in ("w", "b", "ids"):
            assert extra["data_offset"] > 0


def test_async_save_helper_and_dcp(tmp_path: Path, state_dict: dict) -> None:
    fut = storage.async_save(state_dict, tmp_path / "a", transforms=[ZStandard()])
    assert fut.result(timeout=120) is None
    target = zeros_like_tree(state_dict)
    storage.load(target, tmp_path / "a")
    assert_tree_equal(state_dict, target)

    resp = dcp.async_save(state_dict, storage_writer=storage.CheckpointWriter(tmp_path / "b"))
    getattr(resp, "upload_completion", resp).result()
    target = zeros_like_tree(state_dict)
    storage.load(target, tmp_path / "b")
    assert_tree_equal(state_dict, target)


def test_rank_local_metadata_without_collectives(tmp_path: Path, state_dict: dict) -> None:
    writer = storage.CheckpointWriter(tmp_path / "c")
    dcp.save(state_dict, storage_writer=writer, no_dist=True, use_collectives=False)
    names = _files(tmp_path / "c")
    # torch passes no rank without a process group; the writer falls back to rank 0.
    assert "__0.metadata" in names and ".metadata" not in names
    target = zeros_like_tree(state_dict)
    storage.load(target, tmp_path / "c")  # global metadata missing: torch asks for rank 0's
    assert_tree_equal(state_dict, target)


def test_reused_writer_never_touches_the_committed_files(tmp_path: Path, state_dict: dict) -> None:
    path = tmp_path / "c"
    writer = storage.CheckpointWriter(path, single_file_per_rank=False, thread_count=1)
    dcp.save(state_dict, storage_writer=writer)
    before = {n: (path / n).read_bytes() for n in _files(path)}
    with pytest.raises(BaseException, match="injected failure"):
        dcp.save(state_dict, storage_writer=writer, planner=_FailingPlanner())
    assert {n: (path / n).read_bytes() for n in _files(path)} == before
    state_dict["w"] = state_dict["w"] + 1
    dcp.save(state_dict, storage_writer=writer)
    target = zeros_like_tree(state_dict)
    storage.load(target, path)
    assert_tree_equal(state_dict, target)


def test_load_into_non_contiguous_targets(tmp_path: Path) -> None:
    source = {"m": torch.randn(6, 4), "z": torch.randn(3, 5).to(torch.bfloat16)}
    storage.save(source, tmp_path / "c", transforms=[ZStandard()])
    target = {"m": torch.zeros(4, 6).t(), "z": torch.zeros(3, 10, dtype=torch.bfloat16)[:, ::2]}
    assert not target["m"].is_contiguous() and not target["z"].is_contiguous()
    storage.load(target, tmp_path / "c")
    assert torch.equal(target["m"], source["m"]) and torch.equal(target["z"], source["z"])


class _CastingPlanner(DefaultSavePlanner):
    """Stores a float32 tensor as float16 while the metadata still says float32."""

    def resolve_data(self, write_item: Any) -> Any:
        data = super().resolve_data(write_item)
        return data.half() if isinstance(data, torch.Tensor) else data


def test_stored_dtype_differs_from_metadata(tmp_path: Path) -> None:
    source = {"b": torch.randn(16)}
    dcp.save(
        source, storage_writer=storage.CheckpointWriter(tmp_path / "c"), planner=_CastingPlanner()
    )
    target = {"b": torch.zeros(16)}
    storage.load(target, tmp_path / "c")
    assert torch.equal(target["b"], source["b"].half().float())


def test_writer_and_reader_pickle(tmp_path: Path) -> None:
    writer = storage.CheckpointWriter(tmp_path / "c", transforms=[ZStandard(level=5)])
    clone = pickle.loads(pickle.dumps(writer))
    assert clone.path == writer.path and clone.transforms[0].level == 5
    reader = storage.CheckpointReader(tmp_path / "c", keys={"k": b"x" * 32})
    assert pickle.loads(pickle.dumps(reader)).path == reader.path


# --- interop with stock DCP ---------------------------------------------------------


@pytest.mark.parametrize("chain", list(TRANSFORMS))
def test_stock_reader_loads_ours(tmp_path: Path, state_dict: dict, chain: str) -> None:
    storage.save(state_dict, tmp_path / "c", transforms=TRANSFORMS[chain])
    target = zeros_like_tree(state_dict)
    dcp.load(target, storage_reader=dcp.FileSystemReader(tmp_path / "c"))
    assert_tree_equal(state_dict, target)


@pytest.mark.parametrize("extensions", [None, [TorchZStandard()]], ids=["none", "zstd"])
def test_our_reader_loads_stock(tmp_path: Path, state_dict: dict, extensions: Any) -> None:
    dcp.save(
        state_dict,
        storage_writer=dcp.FileSystemWriter(tmp_path / "c", _extensions=extensions),
    )
    target = zeros_like_tree(state_dict)
    storage.load(target, tmp_path / "c")
    assert_tree_equal(state_dict, target)


# --- bad input ----------------------------------------------------------------------


def _item_file(path: Path, fqn: str) -> tuple[Path, Any]:
    md = _read_metadata(path)
    for index, info in md.storage_data.items():
        if index.fqn == fqn:
            return path / info.relative_path, info
    raise AssertionError(fqn)


@pytest.mark.parametrize("chain", list(TRANSFORMS))
def test_flipped_byte_is_an_integrity_error(tmp_path: Path, state_dict: dict, chain: str) -> None:
    storage.save(state_dict, tmp_path / "c", transforms=TRANSFORMS[chain])
    file, info = _item_file(tmp_path / "c", "w")
    raw = bytearray(file.read_bytes())
    raw[info.offset + info.length // 2] ^= 0x01
    file.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match=r"item 'w'.*checksum") as err:
        storage.load(zeros_like_tree(state_dict), tmp_path / "c")
    assert str(tmp_path / "c") in str(err.value)


def test_truncated_data_file(tmp_path: Path, state_dict: dict) -> None:
    storage.save(state_dict, tmp_path / "c", thread_count=1)
    file, info = _item_file(tmp_path / "c", "w")
    with open(file, "r+b") as f:
        f.truncate(info.offset + 10)
    with pytest.raises(IntegrityError, match="truncated"):
        storage.load(zeros_like_tree(state_dict), tmp_path / "c")


def test_missing_data_file(tmp_path: Path, state_dict: dict) -> None:
    storage.save(state_dict, tmp_path / "c", thread_count=1)
    file, _ = _item_file(tmp_path / "c", "w")
    file.unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"data file .* is missing"):
        storage.load(zeros_like_tree(state_dict), tmp_path / "c")


def test_missing_and_uncommitted_checkpoints(tmp_path: Path, state_dict: dict) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        storage.load(zeros_like_tree(state_dict), tmp_path / "nope")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointNotFoundError, match="not a committed checkpoint"):
        storage.load(zeros_like_tree(state_dict), tmp_path / "dir")


def test_unknown_transform_lists_registered(tmp_path: Path, state_dict: dict) -> None:
    storage.save(state_dict, tmp_path / "c")
    md = _read_metadata(tmp_path / "c")
    for info in md.storage_data.values():
        info.transform_descriptors = ["acme.lz4/1"]
    (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnknownTransformError, match=r"acme\.lz4.*stream\.zstd.*register"):
        storage.load(zeros_like_tree(state_dict), tmp_path / "c")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"thread_count": 0}, "thread_count"),
        ({"thread_count": "2"}, "thread_count"),
        ({"overwrite": "yes"}, "overwrite"),
        ({"transforms": ZStandard()}, "transforms must be a list"),
        ({"transforms": [ZStandard]}, "not the class"),
        ({"storage_options": {"key": "x"}}, "storage_options"),
    ],
)
def test_wrong_option_types(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        storage.CheckpointWriter(tmp_path / "c", **kwargs)


def test_wrong_location_type() -> None:
    with pytest.raises(TypeError, match="path or URL"):
        storage.CheckpointReader(42)  # type: ignore[arg-type]


# --- safe loading -------------------------------------------------------------------


class _Evil:
    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self) -> Any:
        return (open, (self.target, "w"))


def test_metadata_pickle_payload_is_refused(tmp_path: Path, state_dict: dict) -> None:
    storage.save(state_dict, tmp_path / "c")
    victim = tmp_path / "pwned.txt"
    (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(_Evil(str(victim))))
    with pytest.raises(UnsafeCheckpointError, match=r"io\.open.*refusing to load"):
        storage.load(zeros_like_tree(state_dict), tmp_path / "c")
    assert not victim.exists()


@pytest.mark.parametrize("bad", ["../outside.distcp", "/etc/passwd", "s3://b/x", "sub/x.distcp"])
def test_traversal_paths_are_refused(tmp_path: Path, state_dict: dict, bad: str) -> None:
    storage.save(state_dict, tmp_path / "c")
    md = _read_metadata(tmp_path / "c")
    next(iter(md.storage_data.values())).relative_path = bad
    (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeCheckpointError, match="not a file inside"):
        storage.load(zeros_like_tree(state_dict), tmp_path / "c")


class _Pickled:
    """A non-tensor value whose unpickling would create a file."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self) -> Any:
        return (open, (self.target, "w"))


def test_non_tensor_payload_that_runs_code_is_refused(tmp_path: Path) -> None:
    victim = tmp_path / "pwned.txt"
    storage.save({"x": _Pickled(str(victim)), "t": torch.ones(2)}, tmp_path / "c")
    assert not victim.exists()
    with pytest.raises(UnsafeCheckpointError, match=r"item 'x'.*not plain data"):
        storage.load({"x": None, "t": torch.zeros(2)}, tmp_path / "c")
    assert not victim.exists()


# --- commit protocol ----------------------------------------------------------------


class _FailingPlanner(DefaultSavePlanner):
    """Raises while resolving the second item: after the first data file is written."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def resolve_data(self, write_item: Any) -> Any:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("injected failure after the first data file")
        return super().resolve_data(write_item)


def test_failed_overwrite_keeps_committed_checkpoint(tmp_path: Path, state_dict: dict) -> None:
    path = tmp_path / "c"
    storage.save(state_dict, path, transforms=[ZStandard()])
    before = {n: (path / n).read_bytes() for n in _files(path)}
    changed = {
        k: (v + 1 if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
        for k, v in state_dict.items()
    }
    writer = storage.CheckpointWriter(path, single_file_per_rank=False, thread_count=1)
    with pytest.raises(BaseException, match="injected failure"):
        dcp.save(changed, storage_writer=writer, planner=_FailingPlanner())
    assert {n: (path / n).read_bytes() for n in _files(path)} == before
    target = zeros_like_tree(state_dict)
    storage.load(target, path)
    assert_tree_equal(state_dict, target)


def test_successful_overwrite_replaces_old_files(tmp_path: Path, state_dict: dict) -> None:
    path = tmp_path / "c"
    storage.save(state_dict, path)
    old = _files(path)
    state_dict["w"] = state_dict["w"] * 2
    storage.save(state_dict, path)
    new = _files(path)
    assert not (old - {".metadata"}) & new  # old data files gone, new ones are fresh names
    target = zeros_like_tree(state_dict)
    storage.load(target, path)
    assert_tree_equal(state_dict, target)


def test_overwrite_false_refuses_before_writing(tmp_path: Path, state_dict: dict) -> None:
    path = tmp_path / "c"
    storage.save(state_dict, path)
    before = _files(path)
    with pytest.raises(CheckpointExistsError, match="overwrite=False"):
        storage.save(state_dict, path, overwrite=False)
    assert _files(path) == before
    storage.save(state_dict, tmp_path / "fresh", overwrite=False)


def test_failed_save_into_new_location_leaves_nothing(tmp_path: Path, state_dict: dict) -> None:
    path = tmp_path / "c"
    writer = storage.CheckpointWriter(path, single_file_per_rank=False, thread_count=1)
    with pytest.raises(BaseException, match="injected failure"):
        dcp.save(state_dict, storage_writer=writer, planner=_FailingPlanner())
    assert _files(path) == set()


def test_sync_files_fsyncs_data_then_metadata(
    tmp_path: Path, state_dict: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    order: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.startswith(str(tmp_path)):  # not a thread an earlier test left running
            order.append(path)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    storage.save(state_dict, tmp_path / "c", thread_count=1)
    data = [i for i, p in enumerate(order) if p.endswith(".distcp")]
    meta = [i for i, p in enumerate(order) if ".metadata" in p]
    directory = [i for i, p in enumerate(order) if p == str(tmp_path / "c")]
    assert data and meta and directory
    assert max(data) < min(directory) < min(meta)
    assert not [n for n in _files(tmp_path / "c") if ".tmp" in n]


def test_golden_checkpoints_keep_loading() -> None:
    golden = Path(__file__).parents[1] / "golden"
    expected = torch.load(golden / "expected.pt", weights_only=True)
    names = sorted(p.name for p in golden.iterdir() if p.is_dir())
    assert {"v1-none", "v1-zstd", "stock-none", "stock-zstd"} <= set(names)
    for name in names:
        # their own sets: test_encryption, test_weights, test_safetensors_mixed
        if name in (
            "transforms",
            "transforms-aes2",
            "transforms-aes3",
            "weights",
            "weights-3",
            "safetensors-v1",
        ):
            continue
        target = zeros_like_tree(expected)
        storage.load(target, golden / name)
        assert_tree_equal(expected, target)


def test_slice_view_cannot_escape() -> None:
    from extensions.streams import SliceView

    def base() -> io.BytesIO:
        return io.BytesIO(b"A" * 10 + b"0123456789" + b"B" * 10)

    view = SliceView(base(), 10, 10)
    assert view.seek(-3, os.SEEK_END) == 7
    assert view.read() == b"789"
    with pytest.raises(ValueError):
        view.seek(-11, os.SEEK_END)
    view.seek(4)
    assert view.seek(2, os.SEEK_CUR) == 6
    assert view.read(100) == b"6789"
    view.seek(50)
    assert view.read() == b""


class _ConfigSpyPlanner(DefaultSavePlanner):
    """Records torch's process-wide archive CRC setting while items are written."""

    seen: list[bool] = []

    def resolve_data(self, write_item: Any) -> Any:
        from torch.utils.serialization import config

        self.seen.append(config.save.compute_crc32)
        return super().resolve_data(write_item)


def test_saving_leaves_torchs_global_crc_setting_alone(tmp_path: Path, state_dict: dict) -> None:
    from torch.utils.serialization import config

    assert config.save.compute_crc32 is True
    spy = _ConfigSpyPlanner()
    dcp.save(state_dict, storage_writer=storage.CheckpointWriter(tmp_path / "c"), planner=spy)
    assert spy.seen and all(spy.seen)  # other threads' torch.save keep their CRCs


def _archive(tensor: torch.Tensor, *, framed: bool) -> bytes:
    from storage.checkpoint import encode

    out = io.BytesIO()
    if framed:
        encode._write_archive(out, tensor)
    else:
        encode.save_tensor_archive(tensor, out)
    return out.getvalue()


_FRAMED = [
    torch.randn(7, 3),
    torch.randn(3, 1, 4).to(torch.bfloat16),
    torch.tensor(2.5, dtype=torch.float64),  # 0-dim
    torch.arange(6, dtype=torch.int64),
    torch.tensor([True, False, True]),
    torch.randn(4, dtype=torch.complex64),
    torch.randn(5).to(torch.float8_e4m3fn),
    torch.empty_strided((1, 5), (7, 1)).copy_(torch.randn(1, 5)),  # contiguous, odd stride
]


@pytest.mark.parametrize("tensor", _FRAMED, ids=lambda t: f"{t.dtype}-{tuple(t.shape)}")
def test_small_tensor_archives_are_torchs_own_bytes(tensor: torch.Tensor) -> None:
    """A small tensor's archive, written as torch's records around its bytes, is byte
    for byte what torch.save writes for it (a second tensor of that signature too), and
    torch.load reads it back."""
    from storage.checkpoint import encode

    assert encode.archive_frame(tensor) is not None
    other = tensor.clone()
    other.reshape(-1).view(torch.uint8).copy_(torch.randint(0, 256, (other.nbytes,)))
    for t in (tensor, other):
        framed = _archive(t, framed=True)
        assert framed == _archive(t, framed=False)
        back = torch.load(io.BytesIO(framed))
        assert back.dtype == t.dtype and back.shape == t.shape and back.stride() == t.stride()
        assert torch.equal(back.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


class _Tagged(torch.Tensor):
    pass


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_tensors_torch_pickles_more_of_keep_torchs_archive() -> None:
    """A subclass, a tensor with attributes, one that requires grad, a quantized or an
    empty one, or a view, is archived by torch itself, never framed as a plain tensor."""
    from storage.checkpoint import encode

    attributed = torch.randn(3)
    attributed.note = "kept"  # type: ignore[attr-defined]
    special = [
        torch.randn(3).as_subclass(_Tagged),
        attributed,
        torch.randn(3, requires_grad=True),
        torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8),
        torch.empty(0),
        torch.randn(8)[2:6],  # a view: torch.save writes its whole storage
        torch.randn(4, 4).t(),
    ]
    for tensor in special:
        assert encode.archive_frame(tensor) is None
    back = torch.load(io.BytesIO(_archive(attributed, framed=True)), weights_only=False)
    assert back.note == "kept"


def test_a_torch_whose_archive_depends_on_the_values_gets_no_frame(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Framing is checked against two archives torch built: where they differ outside
    the tensor's bytes (here torch.save with its record CRCs on), archives are torch's."""
    from storage.checkpoint import encode

    encode._frame.cache_clear()
    monkeypatch.setattr(encode, "save_tensor_archive", torch.save)
    try:
        tensor = torch.randn(5, 5)
        assert encode.archive_frame(tensor) is None
        out = io.BytesIO()
        encode._write_archive(out, tensor)
        assert out.getvalue() == _archive(tensor, framed=False)  # torch.save's own
    finally:
        encode._frame.cache_clear()


def test_a_lone_element_with_a_zero_stride_is_saved(tmp_path: Path) -> None:
    """A one-element tensor broadcast from a scalar (``torch.tensor(x).expand(1)``) is
    contiguous with a stride of 0: its archive is torch's bytes, framed or not, and the
    save stores and loads it (building its frame once failed the whole save)."""
    lone = torch.broadcast_to(torch.tensor(3.5), (1,))
    assert lone.stride() == (0,) and lone.is_contiguous()
    assert _archive(lone, framed=True) == _archive(lone, framed=False)
    dcp.save({"lone": lone}, storage_writer=storage.CheckpointWriter(tmp_path / "c"))
    out = {"lone": torch.zeros(1)}
    dcp.load(out, storage_reader=storage.CheckpointReader(tmp_path / "c"))
    assert out["lone"].tolist() == [3.5]


def test_a_framed_archive_follows_a_storage_alignment_set_later() -> None:
    """torch's storage alignment is a setting a process may change between saves: a
    tensor framed before the change is framed after it as torch.save now writes it."""
    from torch.utils.serialization import config

    tensor = torch.randn(4)
    before = _archive(tensor, framed=True)
    # torch's own patch: pytest's monkeypatch leaves this config without the setting
    with config.patch({"save.storage_alignment": 4096}):
        assert _archive(tensor, framed=True) == _archive(tensor, framed=False) != before
    assert _archive(tensor, framed=True) == before


class _LostResponseFS(storage.MemoryFileSystem):
    """Publishes the metadata, then fails as if the response had been lost."""

    def write_atomic(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        super().write_atomic(path, data, exclusive=exclusive)
        raise ConnectionResetError("response lost after the metadata landed")


def test_commit_that_landed_but_raised_keeps_its_files(state_dict: dict) -> None:
    fs = _LostResponseFS()
    with pytest.raises(ConnectionResetError):
        storage.save(state_dict, "run/c", filesystem=fs)
    target = zeros_like_tree(state_dict)
    storage.load(target, "run/c", filesystem=fs)  # the published checkpoint is whole
    assert_tree_equal(state_dict, target)


_BROKEN_STREAM = """
import contextlib, gc, io, sys
import torch, storage

class Breaks(io.RawIOBase):
    def __init__(self):
        self.n = 0
    def writable(self):
        return True
    def write(self, b):
        self.n += memoryview(b).nbytes
        if self.n > 3 << 20:
            raise ConnectionResetError("upload broke")
        return memoryview(b).nbytes

class FS(storage.MemoryFileSystem):
    @contextlib.contextmanager
    def create_stream(self, path, mode, *, sync=False):
        yield Breaks()

try:
    storage.save({"w": torch.randn(4 << 20)}, "x/c", filesystem=FS(), thread_count=1)
except ConnectionResetError:
    pass
gc.collect()  # an unfinalized archive writer would abort the process here
print("OK")
"""


def test_stream_failing_mid_tensor_raises_cleanly() -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _BROKEN_STREAM], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]


def test_writer_settings_are_the_writer_options() -> None:
    """``WriterSettings`` holds every keyword option of ``CheckpointWriter`` with its
    default: the manager and the Lightning plug-in accept exactly these (they used to
    read them off the writer's signature), so an option added to the writer and not
    to the settings would be refused there."""
    import dataclasses
    import inspect

    from storage.checkpoint.options import WriterSettings

    params = inspect.signature(storage.CheckpointWriter.__init__).parameters
    # ``_extensions`` is torch's name for ``transforms``, an alias, not a setting.
    located = {"self", "path", "transforms", "_extensions", "storage_options", "filesystem"}
    defaults = {n: p.default for n, p in params.items() if n not in located}
    assert {f.name: f.default for f in dataclasses.fields(WriterSettings)} == defaults
    assert WriterSettings().writer_kwargs() == defaults


@pytest.mark.parametrize(
    "kwargs",
    [
        {"thread_count": 0},
        {"overwrite": "yes"},
        {"publish": 1},
        {"timeout": -1},
        {"key_prefixes": -1},
        {"persist": "elsewhere"},
        {"persist": "thread", "max_bandwidth": 10},
        {"base": 3},
        {"serialization_format": "safetensors"},
    ],
)
def test_writer_settings_refuse_what_the_writer_refuses(tmp_path: Path, kwargs: dict) -> None:
    """One check per option: the settings a manager or plug-in builds at once raise
    the error (type and message) the writer raises for the same value."""
    from storage.checkpoint.options import WriterSettings

    with pytest.raises((TypeError, ValueError)) as by_writer:
        storage.CheckpointWriter(tmp_path / "c", **kwargs)
    with pytest.raises(type(by_writer.value), match=f"^{re.escape(str(by_writer.value))}$"):
        WriterSettings.from_kwargs(kwargs, owner="CheckpointWriter")


def test_writer_settings_refuse_unknown_options() -> None:
    from storage.checkpoint.options import WriterSettings

    with pytest.raises(TypeError) as refused:
        WriterSettings.from_kwargs({"thread_cont": 2, "base": "x"}, owner="Mine", refuse=["base"])
    message = str(refused.value)
    assert message.startswith("unknown Mine option(s) ['base', 'thread_cont']; writer options are")
    assert "'thread_count'" in message and "'base'" not in message.split("are")[1]


def test_small_items_share_one_file_and_large_ones_spread_by_size() -> None:
    """Items below a MiB cost their per-item work, under the GIL: they go to one file
    (written on one thread), the large ones over the other files by size. Spread over
    four threads, 20,000 items of 4 KB saved 40% slower than stock's one thread."""
    from storage.checkpoint import data_files

    state: dict[str, Any] = {f"norm.{i}": torch.zeros(1024) for i in range(300)}
    state.update({f"big.{i}": torch.zeros((i + 1) << 20) for i in range(6)})  # 4-24 MB
    state["step"] = 7  # an opaque value
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    items = planner.create_local_plan().items
    files, threads = data_files.split_into_files(
        items, rank=0, save_id="s", thread_count=8, single_file_per_rank=True, key_prefixes=0
    )
    assert threads == 2  # 84 MB at 32 MB per thread
    names = [[i.index.fqn for i in file_items] for _, file_items in files]
    small = {f"norm.{i}" for i in range(300)} | {"step"}
    assert set(names[0]) >= small and all(not small & set(n) for n in names[1:])
    assert sorted(n for file_names in names for n in file_names) == sorted(state)
    # The six large ones: the small file weighs 301 x 256 KiB = 75 MB, so the first
    # large ones go to the other file until it outweighs the small one.
    assert set(names[1]) == {f"big.{i}" for i in range(6)} - set(names[0])
    assert len(names[1]) >= 4
