"""Storage semantics that torch's own DCP tests check, run against our writer and reader.

Scenarios follow test_file_system_checkpoint(_cpu).py, test_fsspec.py, test_save_load_api.py,
test_state_dict*.py and the ``_save_state_dict`` / ``_load_state_dict`` internals of torch
2.13 (written here, not copied), each over the (writer, reader) pairs where ours is one side:
what works with stock ``FileSystemWriter``/``FileSystemReader`` must work, with the same
values, with ours. test_dropin.py holds the scenarios it already covers (BytesIO values,
overwrite, partial loads into a subset, format_utils, checkpoint_id as reported).
"""

from __future__ import annotations

import copy
import io
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlanner
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import storage
from extensions import ZStandard

# --- the pairs ------------------------------------------------------------------------


@dataclass(frozen=True)
class Pair:
    name: str
    writer: Callable[..., Any]
    reader: Callable[..., Any]


def _ours_zstd(path: Any, **kwargs: Any) -> storage.CheckpointWriter:
    return storage.CheckpointWriter(path, transforms=[ZStandard(level=1)], **kwargs)


PAIRS = [
    Pair("ours", storage.CheckpointWriter, storage.CheckpointReader),
    Pair("ours_zstd", _ours_zstd, storage.CheckpointReader),
    Pair("ours_writes-stock_reads", storage.CheckpointWriter, FileSystemReader),
    Pair("stock_writes-ours_reads", FileSystemWriter, storage.CheckpointReader),
]


@pytest.fixture(params=PAIRS, ids=lambda p: p.name)
def pair(request: pytest.FixtureRequest) -> Pair:
    return request.param  # type: ignore[no-any-return]


def _round_trip(pair: Pair, path: Path, state: dict[str, Any], target: dict[str, Any]) -> None:
    dcp.save(state, storage_writer=pair.writer(path))
    dcp.load(target, storage_reader=pair.reader(path))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN payloads of float8 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    as_bytes = [t.resolve_conj().resolve_neg().contiguous().reshape(-1) for t in (a, b)]
    return torch.equal(as_bytes[0].view(torch.uint8), as_bytes[1].view(torch.uint8))


# --- dtypes ---------------------------------------------------------------------------

_DTYPES = [
    getattr(torch, name)
    for name in (
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex32",
        "complex64",
        "complex128",
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    )
    if hasattr(torch, name)
]


def _random_of(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.Size(shape).numel()) * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def _zeros_of(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Zero bytes (torch.zeros has no kernel for some dtypes, e.g. float4)."""
    n = int(torch.Size(shape).numel()) * dtype.itemsize
    return torch.zeros(n, dtype=torch.uint8).view(dtype).reshape(shape)


def test_every_dtype_round_trips(pair: Pair, tmp_path: Path) -> None:
    """test_file_system_checkpoint_cpu's dtypes, and the rest torch has: complex, bool,
    unsigned and float8, each as a matrix, a 0-dim scalar and a zero-size tensor."""
    state: dict[str, Any] = {}
    for i, dtype in enumerate(_DTYPES):
        name = str(dtype).removeprefix("torch.")
        state[name] = _random_of(dtype, (3, 5), i)
        state[f"{name}_scalar"] = _random_of(dtype, (), 100 + i)
        state[f"{name}_empty"] = torch.empty(0, 3, dtype=dtype)
    target = {k: _zeros_of(v.dtype, tuple(v.shape)) for k, v in state.items()}
    _round_trip(pair, tmp_path / "ckpt", state, target)
    for key, value in state.items():
        assert _same_bits(target[key], value), key


# --- layouts --------------------------------------------------------------------------


def _strided_sources() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(6, 8, generator=gen)
    cplx = torch.randn(4, 3, dtype=torch.complex64, generator=gen)
    return {
        "transposed": base.t(),
        "every_other_column": base[:, ::2],
        "rows_with_offset": base[2:5],  # contiguous, storage offset != 0
        "same_base_again": base[1],  # a second view of the same storage
        "expanded": torch.arange(4.0).expand(3, 4),  # stride 0
        "scalar_expanded": torch.tensor(7).expand(5),
        "lone_element_at_stride_2": torch.arange(3.0)[1::2],  # contiguous, stride (2,)
        "lone_element_at_stride_0": torch.tensor(2.5).expand(1),
        "channels_last": torch.randn(2, 3, 4, 5, generator=gen).to(
            memory_format=torch.channels_last
        ),
        "zero_size_view": base[:, 8:],
        "conjugated": cplx.conj(),  # conj bit set, not materialized
        "negative_view": cplx.conj().imag,  # neg bit set
        "parameter": torch.nn.Parameter(torch.randn(3, 3, generator=gen)),
    }


def test_strided_and_lazy_views_round_trip(pair: Pair, tmp_path: Path) -> None:
    """Views, strides, a stride-0 expand, storage offsets and conj/neg bits save their
    values (not their storage) and load back equal."""
    state = _strided_sources()
    expected = {k: v.detach().resolve_conj().resolve_neg().clone() for k, v in state.items()}
    target = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}
    _round_trip(pair, tmp_path / "ckpt", dict(state), target)
    for key, value in expected.items():
        assert torch.equal(target[key], value), key


@pytest.mark.parametrize(
    "staging",
    [
        {"persist": "process"},
        {},  # the default: the worker, else buffers kept in this process
        {"persist": "thread"},
        {"persist": "thread", "cache_staged_state_dict": True},
    ],
    ids=["worker", "default", "thread", "thread_cached"],
)
def test_async_saves_of_strided_and_lazy_views_round_trip(
    staging: dict[str, Any], tmp_path: Path
) -> None:
    """The same layouts through ``dcp.async_save``, every way it stages, twice (the
    second save copies into kept buffers): a conjugate or negative view is staged as its
    values (torch's staging copy kept the storage and dropped the bits: the checkpoint
    held the unconjugated numbers), and a lone element at any stride (contiguous to
    torch) is sent to the persist worker by value (it once failed that save)."""
    state = _strided_sources()
    expected = {k: v.detach().resolve_conj().resolve_neg().clone() for k, v in state.items()}
    writer = storage.CheckpointWriter(tmp_path / "c", **staging)
    for step in ("1", "2"):
        dcp.async_save(dict(state), storage_writer=writer, checkpoint_id=tmp_path / step).result()
        target = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}
        dcp.load(target, storage_reader=storage.CheckpointReader(tmp_path / step))
        for key, value in expected.items():
            assert torch.equal(target[key], value), (step, key)


def test_loads_into_views_parameters_and_lazy_targets(pair: Pair, tmp_path: Path) -> None:
    """Targets that are views into a larger tensor, a Parameter that requires grad and a
    conjugated view: the values land in the memory the caller's tensors share, as stock
    copies into them."""
    gen = torch.Generator().manual_seed(5)
    source = {
        "row_block": torch.randn(2, 8, generator=gen),
        "column": torch.randn(3, generator=gen),
        "param": torch.randn(4, 4, generator=gen),
        "cplx": torch.randn(3, dtype=torch.complex64, generator=gen),
    }
    base = torch.zeros(6, 8)
    plain = torch.zeros(3, dtype=torch.complex64)
    param = torch.nn.Parameter(torch.zeros(4, 4))
    target = {
        "row_block": base[3:5],  # contiguous, at a storage offset
        "column": base[:3, 7],
        "param": param,
        "cplx": plain.conj(),
    }
    _round_trip(pair, tmp_path / "ckpt", source, target)
    assert torch.equal(base[3:5], source["row_block"])
    assert torch.equal(base[:3, 7], source["column"])
    assert torch.count_nonzero(base[:3, :7]) == 0 and torch.count_nonzero(base[5:]) == 0
    assert target["param"] is param and param.requires_grad
    assert torch.equal(param.detach(), source["param"])
    assert torch.equal(plain.conj(), source["cplx"])


# --- values that are not tensors ------------------------------------------------------


class _Blob:
    """A Stateful whose state is raw bytes (test_file_system_checkpoint_cpu's BlobState)."""

    def __init__(self, value: bytes) -> None:
        self.state: dict[str, Any] = {"blob": value}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = state_dict


def test_nested_and_plain_values_round_trip(pair: Pair, tmp_path: Path) -> None:
    state: dict[str, Any] = {
        "blob": _Blob(b"SomeBlobForTesting\x00\xff"),
        "nested": {
            "deep": {"deeper": {"t": torch.arange(6).reshape(2, 3), "none": None}},
            "list": [torch.ones(2), {"k": torch.full((2,), 3.0)}, 5],
            "tuple": (1, "two", 3.0),
        },
        "text": "ünïcødé ✓",
        "big": 2**70,
        "ratio": 0.125,
        "flag": True,
        "cplx": 1 + 2j,
        "raw": b"\x00\x01\x02",
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "ordered": OrderedDict([("b", 1), ("a", 2)]),
        "empty_dict": {},
        "empty_list": [],
    }
    target: dict[str, Any] = {
        "blob": _Blob(b""),
        "nested": {
            "deep": {"deeper": {"t": torch.zeros(2, 3, dtype=torch.int64), "none": 0}},
            "list": [torch.zeros(2), {"k": torch.zeros(2)}, 0],
            "tuple": None,
        },
        "text": "",
        "big": 0,
        "ratio": 0.0,
        "flag": False,
        "cplx": 0j,
        "raw": b"",
        "dtype": None,
        "size": None,
        "ordered": OrderedDict([("b", 0), ("a", 0)]),
        "empty_dict": {},
        "empty_list": [],
    }
    _round_trip(pair, tmp_path / "ckpt", state, target)
    assert target["blob"].state == {"blob": b"SomeBlobForTesting\x00\xff"}
    deep = target["nested"]["deep"]["deeper"]
    assert torch.equal(deep["t"], torch.arange(6).reshape(2, 3)) and deep["none"] is None
    lst = target["nested"]["list"]
    assert torch.equal(lst[0], torch.ones(2)) and torch.equal(lst[1]["k"], torch.full((2,), 3.0))
    assert lst[2] == 5
    assert target["nested"]["tuple"] == (1, "two", 3.0)
    assert list(target["ordered"].items()) == [("b", 1), ("a", 2)]
    for key in ("text", "big", "ratio", "flag", "cplx", "raw", "dtype", "size"):
        assert target[key] == state[key], key
        assert type(target[key]) is type(state[key]), key


def test_awkward_key_names(pair: Pair, tmp_path: Path) -> None:
    """Keys are names in the metadata, never paths: slashes, dots-only, traversal-like,
    spaces and non-ASCII keys store and load like any other."""
    keys = ["a/b", "..", "../../escape", "/abs", "with space", "ключ", "x" * 300, ""]
    state = {k: torch.full((2,), float(i)) for i, k in enumerate(keys)}
    state.update({f"obj:{k}": i for i, k in enumerate(keys)})
    target: dict[str, Any] = {k: torch.zeros(2) for k in keys}
    target.update({f"obj:{k}": -1 for k in keys})
    _round_trip(pair, tmp_path / "ckpt", state, target)
    for i, k in enumerate(keys):
        assert torch.equal(target[k], torch.full((2,), float(i))), k
        assert target[f"obj:{k}"] == i, k
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_empty_and_tensorless_state_dicts(pair: Pair, tmp_path: Path) -> None:
    dcp.save({}, storage_writer=pair.writer(tmp_path / "empty"))
    dcp.load({}, storage_reader=pair.reader(tmp_path / "empty"))
    state = {"epoch": 3, "names": ["a", "b"], "cfg": {"lr": 0.5}}
    target: dict[str, Any] = {"epoch": 0, "names": ["", ""], "cfg": {"lr": 0.0}}
    _round_trip(pair, tmp_path / "plain", state, target)
    assert target == state


def test_model_and_optimizer_state(pair: Pair, tmp_path: Path) -> None:
    """A real model and an Adam step: integer-keyed optimizer state, tuples (betas),
    None and bool options, Parameters as values."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.rand(3, 4)).sum().backward()
    optim.step()
    state = {"model": model.state_dict(keep_vars=True), "optim": optim.state_dict()}
    expected = copy.deepcopy({"model": model.state_dict(), "optim": optim.state_dict()})

    def blank(tree: Any) -> Any:
        if isinstance(tree, torch.Tensor):
            return torch.zeros_like(tree.detach())
        if isinstance(tree, dict):
            return {k: blank(v) for k, v in tree.items()}
        return copy.deepcopy(tree)

    target = blank(expected)
    _round_trip(pair, tmp_path / "ckpt", state, target)
    for k, v in expected["model"].items():
        assert torch.equal(target["model"][k], v), k
    for pid, per_param in expected["optim"]["state"].items():
        for k, v in per_param.items():
            assert torch.equal(target["optim"]["state"][pid][k], v), (pid, k)
    assert target["optim"]["param_groups"] == expected["optim"]["param_groups"]


def test_get_and_set_state_dict(pair: Pair, tmp_path: Path) -> None:
    """test_state_dict's single-process flow: get_state_dict (FQN-keyed optimizer state),
    save, load into a fresh model's, set_state_dict."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    torch.manual_seed(1)
    model, optim = make()
    model(torch.rand(3, 4)).sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, storage_writer=pair.writer(tmp_path / "ckpt"))
    model2, optim2 = make()
    msd2, osd2 = get_state_dict(model2, optim2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, storage_reader=pair.reader(tmp_path / "ckpt"))
    set_state_dict(model2, optim2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    before, after = optim.state_dict()["state"], optim2.state_dict()["state"]
    assert before.keys() == after.keys()
    for pid, per_param in before.items():
        for k, v in per_param.items():
            assert torch.equal(after[pid][k], v), (pid, k)


# --- dtype casts on load (test_file_system_checkpoint_cpu.test_dtype_mismatch_casting) --


def test_dtype_cast_on_load(pair: Pair, tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(7)
    state = {"w": torch.rand(4, 3, generator=gen), "h": torch.rand(5, generator=gen).half()}
    dcp.save(state, storage_writer=pair.writer(tmp_path / "ckpt"))
    narrowed = {"w": torch.zeros(4, 3, dtype=torch.bfloat16), "h": torch.zeros(5)}
    dcp.load(narrowed, storage_reader=pair.reader(tmp_path / "ckpt"))
    assert torch.equal(narrowed["w"], state["w"].to(torch.bfloat16))
    assert torch.equal(narrowed["h"], state["h"].float())


def test_shape_mismatch_fails(pair: Pair, tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(4, 3)}, storage_writer=pair.writer(tmp_path / "ckpt"))
    with pytest.raises(CheckpointException, match="[Ss]ize mismatch"):
        dcp.load({"w": torch.zeros(3, 4)}, storage_reader=pair.reader(tmp_path / "ckpt"))


# --- resharding at the storage level: reads of a region of a stored chunk ------------


class _RegionPlanner(DefaultLoadPlanner):
    """Loads rows ``[start, start + rows)`` of the stored tensor ``fqn`` into
    ``state_dict[fqn]`` (shaped ``(rows, ...)``), as a rank holding that shard would."""

    def __init__(self, fqn: str, start: int) -> None:
        super().__init__()
        self.fqn, self.start = fqn, start

    def create_local_plan(self) -> LoadPlan:
        md: Any = self.metadata.state_dict_metadata[self.fqn]  # type: ignore[union-attr]
        shard = self.state_dict[self.fqn]
        offsets = torch.Size([self.start] + [0] * (shard.dim() - 1))
        chunk = ChunkStorageMetadata(offsets=offsets, sizes=shard.size())
        return LoadPlan(create_read_items_for_chunk_list(self.fqn, md, [chunk]))

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        shard = self.state_dict[self.fqn]
        return narrow_tensor_by_index(shard, read_item.dest_offsets, read_item.lengths)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex64])
def test_region_of_a_stored_tensor(pair: Pair, tmp_path: Path, dtype: torch.dtype) -> None:
    full = _random_of(torch.float32, (10, 6), 11).nan_to_num().to(dtype)
    dcp.save({"w": full}, storage_writer=pair.writer(tmp_path / "ckpt"))
    for start, rows in ((0, 3), (4, 5), (9, 1)):
        shard = {"w": torch.zeros(rows, 6, dtype=dtype)}
        dcp.load(
            shard,
            storage_reader=pair.reader(tmp_path / "ckpt"),
            planner=_RegionPlanner("w", start),
        )
        assert _same_bits(shard["w"], full[start : start + rows]), (start, rows)


# --- partial loads and what a save replaces -------------------------------------------


def test_load_state_dict_from_keys(pair: Pair, tmp_path: Path) -> None:
    """_load_state_dict_from_keys: a new state dict of just the keys asked for."""
    state = {"model": {"w": torch.arange(4.0), "b": torch.ones(2)}, "step": 9, "other": 1}
    dcp.save(state, storage_writer=pair.writer(tmp_path / "ckpt"))
    loaded = _load_state_dict_from_keys(
        keys={"model.w", "step"}, storage_reader=pair.reader(tmp_path / "ckpt")
    )
    assert set(loaded) == {"model", "step"} and set(loaded["model"]) == {"w"}
    assert torch.equal(loaded["model"]["w"], torch.arange(4.0)) and loaded["step"] == 9
    everything = _load_state_dict_from_keys(storage_reader=pair.reader(tmp_path / "ckpt"))
    assert torch.equal(everything["model"]["b"], torch.ones(2)) and everything["other"] == 1


def test_overwrite_with_fewer_keys(pair: Pair, tmp_path: Path) -> None:
    """A save over a checkpoint replaces it whole: a key only the first save had is gone
    (a load that asks for it fails; allow_partial_load leaves it untouched)."""
    path = tmp_path / "ckpt"
    dcp.save({"a": torch.ones(3), "b": torch.ones(3)}, storage_writer=pair.writer(path))
    dcp.save({"a": torch.full((3,), 2.0)}, storage_writer=pair.writer(path))
    with pytest.raises(CheckpointException, match="b"):
        dcp.load({"a": torch.zeros(3), "b": torch.zeros(3)}, storage_reader=pair.reader(path))
    target = {"a": torch.zeros(3), "b": torch.zeros(3)}
    dcp.load(
        target,
        storage_reader=pair.reader(path),
        planner=DefaultLoadPlanner(allow_partial_load=True),
    )
    assert torch.equal(target["a"], torch.full((3,), 2.0))
    assert torch.equal(target["b"], torch.zeros(3))


def test_overwrite_false_into_an_existing_directory(pair: Pair, tmp_path: Path) -> None:
    """test_fsspec.test_overwrite: overwrite=False saves into an existing directory with no
    checkpoint in it (files of the user's beside it are kept), and refuses the second time."""
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    dcp.save({"r": torch.ones(2)}, storage_writer=pair.writer(path, overwrite=False))
    with pytest.raises(CheckpointException, match="Checkpoint already exists"):
        dcp.save({"r": torch.zeros(2)}, storage_writer=pair.writer(path, overwrite=False))
    target = {"r": torch.zeros(2)}
    dcp.load(target, storage_reader=pair.reader(path))
    assert torch.equal(target["r"], torch.ones(2))
    assert (path / "notes.txt").read_text() == "mine"


# --- one writer / reader for many checkpoints -----------------------------------------


def test_one_writer_and_reader_for_many_checkpoint_ids(pair: Pair, tmp_path: Path) -> None:
    """dcp.save(checkpoint_id=...) resets the same writer for each save; dcp.load the
    same reader for each load, in any order."""
    writer = pair.writer(tmp_path / "unused")
    for step in range(3):
        dcp.save(
            {"w": torch.full((4,), float(step)), "step": step},
            checkpoint_id=tmp_path / f"step-{step}",
            storage_writer=writer,
        )
    assert not (tmp_path / "unused").exists()
    reader = pair.reader(tmp_path / "step-0")
    for step in (2, 0, 1):
        target: dict[str, Any] = {"w": torch.zeros(4), "step": -1}
        dcp.load(target, checkpoint_id=tmp_path / f"step-{step}", storage_reader=reader)
        assert torch.equal(target["w"], torch.full((4,), float(step))) and target["step"] == step
    # No checkpoint_id: the location the last reset chose, twice.
    for _ in range(2):
        target = {"w": torch.zeros(4), "step": -1}
        dcp.load(target, storage_reader=reader)
        assert target["step"] == 1


def test_reused_writer_without_reset_overwrites(pair: Pair, tmp_path: Path) -> None:
    writer = pair.writer(tmp_path / "ckpt")
    for step in range(3):
        dcp.save({"w": torch.full((4,), float(step))}, storage_writer=writer)
    target = {"w": torch.zeros(4)}
    dcp.load(target, storage_reader=pair.reader(tmp_path / "ckpt"))
    assert torch.equal(target["w"], torch.full((4,), 2.0))


# --- what _save_state_dict hands the planner and writes -------------------------------


class _SeeingPlanner(DefaultSavePlanner):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    def set_up_planner(
        self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        self.seen.append(copy.copy(storage_meta))
        super().set_up_planner(state_dict, storage_meta, is_coordinator)


def test_storage_meta_seen_by_the_planner_is_the_one_saved(tmp_path: Path) -> None:
    """The StorageMeta a save planner is set up with (writer.storage_meta(), asked before
    set_up_storage_writer) names the save the checkpoint's metadata records, as stock's."""
    for make in (FileSystemWriter, storage.CheckpointWriter):
        path = tmp_path / make.__name__
        writer = make(path)
        saved = []
        for _ in range(2):  # a reused writer: each save its own id
            planner = _SeeingPlanner()
            metadata = dcp.save({"w": torch.ones(2)}, storage_writer=writer, planner=planner)
            assert planner.seen[0].save_id == metadata.storage_meta.save_id, make
            on_disk = storage.CheckpointReader(path).read_metadata().storage_meta
            assert on_disk.save_id == metadata.storage_meta.save_id, make
            assert os.fspath(on_disk.checkpoint_id) == os.fspath(path), make
            saved.append(metadata.storage_meta.save_id)
        assert saved[0] != saved[1] or make is FileSystemWriter


@pytest.fixture
def plan_cache() -> Iterator[str]:
    """A key of torch's class-level save-plan cache for this test alone, cleared after."""
    key = f"test-plan-cache-{os.getpid()}-{id(object())}"
    yield key
    _drop_cached_plans(key)


def _drop_cached_plans(key: str) -> None:
    for cache in (
        SavePlanner._cached_save_plan,
        SavePlanner._cached_all_plans,
        SavePlanner._cached_global_plan,
        SavePlanner._cached_metadata,
        SavePlanner._cached_final_save_plan,
    ):
        cache.pop(key, None)


def test_plan_caching_planner(pair: Pair, tmp_path: Path, plan_cache: str) -> None:
    """DefaultSavePlanner(enable_plan_caching=True): from the second save on, the writer
    is handed unusable (empty) local and global plans and the planner finishes with the
    plan it cached; the writer must still write every item of the cached plan."""
    writer = pair.writer(tmp_path / "unused")
    for step in range(3):
        planner = DefaultSavePlanner(enable_plan_caching=True)
        planner._cached_plans_key = plan_cache
        state = {"w": torch.full((8,), float(step)), "b": torch.arange(3) + step, "n": step}
        dcp.save(
            state,
            checkpoint_id=tmp_path / f"step-{step}",
            storage_writer=writer if step != 1 else pair.writer(tmp_path / "x"),
            planner=planner,
        )
    for step in range(3):
        target: dict[str, Any] = {"w": torch.zeros(8), "b": torch.zeros(3, dtype=torch.int64)}
        target["n"] = -1
        dcp.load(target, storage_reader=pair.reader(tmp_path / f"step-{step}"))
        assert torch.equal(target["w"], torch.full((8,), float(step))), step
        assert torch.equal(target["b"], torch.arange(3) + step) and target["n"] == step


def test_without_collectives_single_process(pair: Pair, tmp_path: Path) -> None:
    """use_collectives=False and no_dist=True: a rank-local metadata file, loaded back by
    dcp.load's fallback to it."""
    path = tmp_path / "ckpt"
    state = {"w": torch.arange(5.0), "s": "x"}
    dcp.save(state, storage_writer=pair.writer(path), no_dist=True, use_collectives=False)
    assert "__0.metadata" in os.listdir(path) and ".metadata" not in os.listdir(path)
    target: dict[str, Any] = {"w": torch.zeros(5), "s": ""}
    dcp.load(target, storage_reader=pair.reader(path), no_dist=True)
    assert torch.equal(target["w"], state["w"]) and target["s"] == "x"


# --- validate_checkpoint_id (test_save_load_api.test_auto_detect) ---------------------


def test_validate_checkpoint_id(tmp_path: Path) -> None:
    """Ours serves local paths and every URL it has a backend for; like stock's writers
    and readers, it says no to a URL of a protocol nothing serves."""
    for cls in (storage.CheckpointWriter, storage.CheckpointReader):
        assert cls.validate_checkpoint_id(tmp_path / "ckpt")
        assert cls.validate_checkpoint_id(str(tmp_path / "ckpt"))
        assert cls.validate_checkpoint_id(f"file://{tmp_path}/ckpt")
        assert cls.validate_checkpoint_id("memory://bucket/ckpt")
        assert cls.validate_checkpoint_id("s3://bucket/ckpt")
        assert cls.validate_checkpoint_id("gs://bucket/ckpt")
        assert not cls.validate_checkpoint_id("abc://abc.abc")
        assert not cls.validate_checkpoint_id(42)  # type: ignore[arg-type]
    for cls in (FileSystemWriter, FileSystemReader):  # what stock says, for reference
        assert not cls.validate_checkpoint_id("abc://abc.abc")


# --- async_save -----------------------------------------------------------------------


@pytest.mark.parametrize("persist", ["thread", "process"])
def test_async_save_thread_executor_many_ids(tmp_path: Path, persist: str) -> None:
    """dcp.async_save with the thread executor through one writer, a checkpoint_id per
    save: each checkpoint holds the values at its call, whatever training does after."""
    writer = storage.CheckpointWriter(tmp_path / "unused", persist=persist)
    state: dict[str, Any] = {"w": torch.zeros(64), "nested": {"step": 0, "t": torch.zeros(2)}}
    try:
        for step in range(3):
            state["w"].fill_(float(step))
            state["nested"]["t"].fill_(float(-step))
            state["nested"]["step"] = step
            response = dcp.async_save(
                state,
                checkpoint_id=tmp_path / f"step-{step}",
                storage_writer=writer,
                async_checkpointer_type=AsyncCheckpointerType.THREAD,
            )
            state["w"].add_(100)  # training goes on
            getattr(response, "upload_completion", response).result()
    finally:
        writer.close()
    for step in range(3):
        target: dict[str, Any] = {"w": torch.zeros(64), "nested": {"step": -1, "t": torch.zeros(2)}}
        dcp.load(target, storage_reader=FileSystemReader(tmp_path / f"step-{step}"))
        assert torch.equal(target["w"], torch.full((64,), float(step))), step
        assert torch.equal(target["nested"]["t"], torch.full((2,), float(-step)))
        assert target["nested"]["step"] == step


@pytest.mark.parametrize("persist", ["thread", "process"])
@pytest.mark.parametrize("async_staging", [False, True])
def test_async_save_with_a_callers_stager(
    tmp_path: Path, persist: str, async_staging: bool
) -> None:
    """dcp.async_save(async_stager=...) stages with the caller's stager, not the writer's
    (with use_async_staging, dcp.async_save answers an AsyncSaveResponse)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(False, False, async_staging, False))
    state = {"w": torch.arange(16.0), "blob": io.BytesIO(b"opaque")}
    writer = storage.CheckpointWriter(tmp_path / "ckpt", persist=persist)
    try:
        response = dcp.async_save(state, storage_writer=writer, async_stager=stager)
        if async_staging:
            response.staging_completion.result()
        state["w"].zero_()
        getattr(response, "upload_completion", response).result()
    finally:
        stager.close()
        writer.close()
    target = {"w": torch.zeros(16), "blob": io.BytesIO()}
    dcp.load(target, storage_reader=storage.CheckpointReader(tmp_path / "ckpt"))
    assert torch.equal(target["w"], torch.arange(16.0))
    assert target["blob"].getvalue() == b"opaque"


# --- reusing a writer or reader after a failure ---------------------------------------


def test_reader_and_writer_reused_after_a_failure(pair: Pair, tmp_path: Path) -> None:
    """A failed load (shape mismatch, missing checkpoint) or save (overwrite=False over a
    checkpoint) leaves the reader or writer usable for the next, as stock's are."""
    dcp.save({"w": torch.ones(4)}, storage_writer=pair.writer(tmp_path / "a"))
    reader = pair.reader(tmp_path / "a")
    with pytest.raises(CheckpointException):
        dcp.load({"w": torch.zeros(5)}, storage_reader=reader)
    with pytest.raises(CheckpointException):
        dcp.load({"w": torch.zeros(4)}, checkpoint_id=tmp_path / "missing", storage_reader=reader)
    target = {"w": torch.zeros(4)}
    dcp.load(target, checkpoint_id=tmp_path / "a", storage_reader=reader)
    assert torch.equal(target["w"], torch.ones(4))
    writer = pair.writer(tmp_path / "a", overwrite=False)
    with pytest.raises(CheckpointException, match="already exists"):
        dcp.save({"w": torch.zeros(4)}, storage_writer=writer)
    dcp.save({"w": torch.full((4,), 3.0)}, checkpoint_id=tmp_path / "b", storage_writer=writer)
    dcp.load(target, storage_reader=pair.reader(tmp_path / "b"))
    assert torch.equal(target["w"], torch.full((4,), 3.0))
    dcp.load(target, storage_reader=pair.reader(tmp_path / "a"))
    assert torch.equal(target["w"], torch.ones(4))


# --- resharding ShardedTensors on two ranks (TestDistributedReshardOnLoad) ------------

_FULL = torch.arange(200, dtype=torch.float32).reshape(10, 20)
# (layout saved, layout loaded): rows to an uneven row split, that to columns, ...
_RESHARDS = [("rows", "uneven"), ("uneven", "cols"), ("four", "rows"), ("cols", "four")]


def _specs() -> dict[str, Any]:
    from torch.distributed._shard.sharding_spec import (
        ChunkShardingSpec,
        EnumerableShardingSpec,
        ShardMetadata,
    )

    r0, r1 = "rank:0/cpu", "rank:1/cpu"
    uneven = [([0, 0], [2, 20], r0), ([2, 0], [1, 20], r1), ([3, 0], [3, 20], r0)]
    uneven += [([6, 0], [3, 20], r1), ([9, 0], [1, 20], r0)]
    return {
        "rows": ChunkShardingSpec(dim=0, placements=[r0, r1]),
        "four": ChunkShardingSpec(dim=0, placements=[r0, r1, r1, r0]),
        "cols": ChunkShardingSpec(dim=1, placements=[r0, r1]),
        "uneven": EnumerableShardingSpec([ShardMetadata(o, s, p) for o, s, p in uneven]),
    }


def _sharded(spec: Any, *, fill: bool) -> Any:
    from torch.distributed._shard import sharded_tensor

    st = sharded_tensor.zeros(spec, *_FULL.shape, init_rrefs=False)
    if fill:
        for shard in st.local_shards():
            (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            shard.tensor.copy_(_FULL[r : r + h, c : c + w])
    return st


def _reshard_worker(rank: int, store: str, root: str) -> None:
    from tests.support.distributed import gloo_group

    with gloo_group(rank, 2, store):
        specs = _specs()
        for i, (saved, loaded) in enumerate(_RESHARDS):
            for side in PAIRS:
                path = os.path.join(root, f"{i}-{side.name}")
                dcp.save(
                    {"st": _sharded(specs[saved], fill=True)}, storage_writer=side.writer(path)
                )
                target = {"st": _sharded(specs[loaded], fill=False)}
                dcp.load(target, storage_reader=side.reader(path))
                for shard in target["st"].local_shards():
                    (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    expected = _FULL[r : r + h, c : c + w]
                    assert torch.equal(shard.tensor, expected), (saved, loaded, side.name)


def test_sharded_tensor_reshard_on_load(tmp_path: Path) -> None:
    """Saved in one layout on two ranks, loaded in another: each rank's shards are read
    from the stored chunks they overlap, in part."""
    from tests.support.distributed import spawn

    spawn(_reshard_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)


def _plan_cache_worker(rank: int, store: str, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tests.support.distributed import gloo_group

    with gloo_group(rank, 2, store):
        mesh = init_device_mesh("cpu", (2,))
        # The cache is torch's, per class and key: each writer its own key, as a stock
        # writer cannot finish with a plan our writer prepared (and the reverse).
        keys = [f"test-plan-cache-2-ranks-{os.getpid()}-{side.name}" for side in PAIRS]
        try:
            for key, side in zip(keys, PAIRS, strict=True):
                writer = side.writer(os.path.join(root, "unused"))
                for step in range(3):
                    planner = DefaultSavePlanner(enable_plan_caching=True)
                    planner._cached_plans_key = key
                    full = torch.arange(32.0).reshape(8, 4) + step
                    state = {
                        "w": distribute_tensor(full, mesh, [Shard(0)]),
                        "bias": torch.full((3,), float(step)),
                        "step": step,
                    }
                    path = os.path.join(root, f"{side.name}-{step}")
                    dcp.save(state, checkpoint_id=path, storage_writer=writer, planner=planner)
                for step in range(3):
                    path = os.path.join(root, f"{side.name}-{step}")
                    target = {
                        "w": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(1)]),
                        "bias": torch.zeros(3),
                        "step": -1,
                    }
                    dcp.load(target, storage_reader=side.reader(path))
                    expected = torch.arange(32.0).reshape(8, 4) + step
                    assert torch.equal(target["w"].full_tensor(), expected), (side.name, step)
                    assert torch.equal(target["bias"], torch.full((3,), float(step)))
                    assert target["step"] == step
        finally:
            for key in keys:
                _drop_cached_plans(key)


def test_plan_caching_on_two_ranks(tmp_path: Path) -> None:
    """enable_plan_caching where it pays: two ranks, the second and later saves send no
    plans and finish with the cached ones; each rank's writer writes its cached items."""
    from tests.support.distributed import spawn

    spawn(_plan_cache_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)


# --- torch's own extension keywords (TestDistributedStateDictSaveLoadRot13/ZStandard) ---


@pytest.mark.parametrize("thread_count", [1, 2])
@pytest.mark.parametrize("extension", ["rot13", "zstd"])
def test_torch_extension_keywords(tmp_path: Path, thread_count: int, extension: str) -> None:
    """FileSystemWriter(_extensions=[...]) and FileSystemReader(_extension_registry=...)
    are what torch's tests and stock-DCP code pass: ours takes them as transforms and
    registry, and each side reads what the other wrote."""
    from torch.distributed.checkpoint._extension import ZStandard as TorchZStandard
    from torch.testing._internal.distributed.checkpoint_utils import (
        Rot13Example,
        get_test_extension_registry,
    )

    def transform() -> Any:
        return Rot13Example() if extension == "rot13" else TorchZStandard()

    torch.manual_seed(2)
    state = {"model": torch.nn.Linear(5, 5).state_dict(), "blob": _Blob(b"SomeBlobForTesting")}
    sides = [
        (storage.CheckpointWriter, storage.CheckpointReader),
        (storage.CheckpointWriter, FileSystemReader),
        (FileSystemWriter, storage.CheckpointReader),
    ]
    for i, (make_writer, make_reader) in enumerate(sides):
        path = tmp_path / str(i)
        writer = make_writer(path=path, thread_count=thread_count, _extensions=[transform()])
        dcp.save(state, storage_writer=writer)
        target = {"model": torch.nn.Linear(5, 5).state_dict(), "blob": _Blob(b"")}
        dcp.load(
            target,
            storage_reader=make_reader(
                path=path, _extension_registry=get_test_extension_registry()
            ),
        )
        for k, v in state["model"].items():
            assert torch.equal(target["model"][k], v), (i, k)
        assert target["blob"].state == {"blob": b"SomeBlobForTesting"}, i
    with pytest.raises(TypeError, match="not both"):
        storage.CheckpointWriter(tmp_path, transforms=[transform()], _extensions=[transform()])
    with pytest.raises(TypeError, match="not both"):
        storage.CheckpointReader(
            tmp_path,
            registry=get_test_extension_registry(),
            _extension_registry=get_test_extension_registry(),
        )
