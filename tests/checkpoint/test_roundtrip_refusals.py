"""What stock DCP refuses to save (or we refuse to load), our paths refuse too, with an
error naming the item and the fix rather than a raw exception from deep inside; and the
values the round-trip fuzzing (test_roundtrip_fuzz.py) found we refused where stock
does not."""

from __future__ import annotations

import datetime
import io
import pickle
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

import storage
from storage.checkpoint import persist
from storage.checkpoint.storage_format import load_bytes_io

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


@pytest.fixture(scope="module", autouse=True)
def _close_the_worker() -> Iterator[None]:
    """The persist worker and its staging segments are the process's: close what these
    tests started, so later modules find none."""
    yield
    persist.worker().close()


# --- empty BytesIO values --------------------------------------------------------------


@pytest.mark.parametrize("writer", ["stock", "ours"])
def test_an_empty_bytes_io_value_round_trips(writer: str, tmp_path: Path) -> None:
    """DCP pickles an empty ``io.BytesIO`` with ``bytes()`` where one with content has
    latin-1 text; stock loads both. Before: ours refused the empty one as not plain
    data."""
    state = {"blob": io.BytesIO(), "full": io.BytesIO(b"\x00\xff")}
    if writer == "stock":
        dcp.save(state, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    else:
        storage.save(state, tmp_path)
    target: dict[str, Any] = {"blob": io.BytesIO(b"old"), "full": io.BytesIO()}
    storage.load(target, tmp_path)
    assert target["blob"].getvalue() == b"" and target["full"].getvalue() == b"\x00\xff"


class _BytesOf:
    def __init__(self, n: int) -> None:
        self.n = n

    def __reduce__(self) -> tuple[Any, ...]:
        return (bytes, (self.n,))  # unpickled: bytes(n), n zero bytes


def test_the_bytes_io_loader_builds_no_bytes_from_a_count() -> None:
    """``bytes()`` is allowed for an empty BytesIO, but never ``bytes(n)``, which would
    allocate what the checkpoint says."""
    archive = io.BytesIO()
    torch.save(io.BytesIO(), archive)
    empty = load_bytes_io(archive.getvalue())
    assert empty is not None and empty.getvalue() == b""
    for hostile in (_BytesOf(1 << 40), [io.BytesIO(), _BytesOf(3)]):
        archive = io.BytesIO()
        torch.save(hostile, archive, pickle_protocol=2)
        assert load_bytes_io(archive.getvalue()) is None
    archive = io.BytesIO()
    torch.save(_BytesOf(1 << 40), archive, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    assert load_bytes_io(archive.getvalue()) is None


# --- what stock refuses to save ---------------------------------------------------------


def _unpicklable() -> Any:
    return lambda: 1


# name -> (the refused value, the key it sits under, words of the fix in our error)
REFUSED: dict[str, tuple[Callable[[], Any], str, str]] = {
    "sparse_coo": (lambda: torch.eye(3).to_sparse(), "w", "to_dense()"),
    "sparse_csr": (lambda: torch.eye(3).to_sparse_csr(), "w", "to_dense()"),
    "meta": (lambda: torch.empty(3, device="meta"), "w", "meta"),
    "unpicklable": (_unpicklable, "fn", "pickle"),
}


def _refused_state(name: str) -> dict[str, Any]:
    make, key, _ = REFUSED[name]
    return {"ok": torch.arange(4.0), "layer": {key: make()}}


def _stock_refuses(state: dict[str, Any], path: Path) -> None:
    with pytest.raises(CheckpointException):
        dcp.save(state, storage_writer=FileSystemWriter(path), no_dist=True)


def _save(state: dict[str, Any], path: Path) -> None:
    storage.save(state, path)


def _async(persist: str) -> Callable[[dict[str, Any], Path], None]:
    def save(state: dict[str, Any], path: Path) -> None:
        storage.async_save(state, path, persist=persist).result(timeout=120)

    return save


def _managed(state: dict[str, Any], path: Path) -> None:
    manager = storage.CheckpointManager(path, keep_last=1)
    manager.save(1, state)


SAVES: dict[str, Callable[[dict[str, Any], Path], None]] = {
    "save": _save,
    "async-thread": _async("thread"),
    "async-process": _async("process"),
    "manager": _managed,
}


@pytest.mark.parametrize("save", sorted(SAVES))
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_stock_cannot_save_is_refused_naming_the_item(
    name: str, save: str, tmp_path: Path
) -> None:
    """Before: a raw error from deep inside (``unsupported memory format option``,
    ``Cannot copy out of meta tensor``, a pickler's ``Can't pickle <function>``), naming
    neither the item nor what to do."""
    state = _refused_state(name)
    _stock_refuses(state, tmp_path / "stock")
    with pytest.raises(TypeError) as caught:
        SAVES[save](state, tmp_path / "ours")
    message = str(caught.value)
    key, fix = REFUSED[name][1:]
    assert f"layer.{key}" in message and fix in message, message
    assert not (tmp_path / "ours" / ".metadata").exists()


@pytest.mark.parametrize("state", [
    {"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}},
    {1: torch.ones(2), "1": torch.zeros(2)},
], ids=["dotted", "int-and-str"])  # fmt: skip
@pytest.mark.parametrize("save", sorted(SAVES))
def test_keys_that_collide_once_flattened_are_refused_naming_them(
    state: dict[Any, Any], save: str, tmp_path: Path
) -> None:
    """Stock and ours refuse two keys that DCP flattens to one name (torch's own
    ValueError, which names it)."""
    _stock_refuses(state, tmp_path / "stock")
    with pytest.raises(ValueError, match="duplicated flatten key (a.b|1)"):
        SAVES[save](state, tmp_path / "ours")


# --- what we deliberately refuse to load -------------------------------------------------


@pytest.mark.parametrize(
    ("value", "allow"),
    [
        (datetime.datetime(2020, 1, 2), datetime.datetime),
        (frozenset({"a"}), frozenset),
        (range(3), range),
        (slice(1, 5, 2), slice),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, type) else "",
)
def test_a_value_that_is_not_plain_data_is_refused_naming_the_item_and_the_fix(
    value: Any, allow: type, tmp_path: Path
) -> None:
    """Stock loads any pickle (``weights_only=False``); ours loads what torch's
    ``weights_only`` unpickler does (plain data: not even ``frozenset``, ``range`` or
    ``slice``) and the classes the user allowed, never running code from the
    checkpoint."""
    state = {"meta": {"when": value}}
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    target: dict[str, Any] = {"meta": {"when": None}}
    dcp.load(target, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    assert target == state
    with pytest.raises(storage.UnsafeCheckpointError) as caught:
        storage.load({"meta": {"when": None}}, tmp_path)
    assert "meta.when" in str(caught.value) and "add_safe_globals" in str(caught.value)
    with torch.serialization.safe_globals([allow]):
        target = {"meta": {"when": None}}
        storage.load(target, tmp_path)
    assert target == state


@pytest.mark.parametrize("name", ["sparse_coo", "sparse_csr", "meta"])
def test_safetensors_refuses_what_no_checkpoint_holds_naming_the_item(
    name: str, tmp_path: Path
) -> None:
    """The safetensors writer resolves its items on its own path: the same refusal."""
    with pytest.raises(TypeError) as caught:
        storage.save_safetensors(_refused_state(name), tmp_path)
    key, fix = REFUSED[name][1:]
    assert f"layer.{key}" in str(caught.value) and fix in str(caught.value)


# --- load targets both refuse ------------------------------------------------------------


def _expanded_target() -> dict[str, Any]:
    return {"layer": {"w": torch.zeros(1, 3).expand(4, 3)}}


@pytest.mark.parametrize("fmt", ["dcp", "dcp-read-once", "safetensors"])
def test_an_expanded_load_target_is_refused_naming_the_item(fmt: str, tmp_path: Path) -> None:
    """A target whose elements share memory (``expand``) cannot be filled; stock and
    torch's copy refuse it with no item named. Before: that raw RuntimeError."""
    state = {"layer": {"w": torch.randn(4, 3)}}
    if fmt == "safetensors":
        storage.save_safetensors(state, tmp_path)
        with pytest.raises(ValueError, match="'layer.w'.*expanded view.*clone()"):
            storage.load_safetensors(_expanded_target(), tmp_path)
        return
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    with pytest.raises(CheckpointException, match="more than one element"):
        dcp.load(_expanded_target(), storage_reader=FileSystemReader(tmp_path), no_dist=True)
    read_once = {"read_once": True} if fmt == "dcp-read-once" else {}
    with pytest.raises(ValueError, match="'layer.w'.*expanded view.*clone()"):
        storage.load(_expanded_target(), tmp_path, **read_once)
    target = {"layer": {"w": torch.zeros(1, 3).expand(4, 3).clone()}}  # the fix works
    storage.load(target, tmp_path)
    assert torch.equal(target["layer"]["w"], state["layer"]["w"])


@pytest.mark.parametrize("writer", ["stock", "ours"])
def test_top_level_keys_of_mixed_types_are_refused_on_load_with_the_fix(
    writer: str, tmp_path: Path
) -> None:
    """Both save ``{1: ..., "a": ...}``; dcp.load sorts the top-level keys and fails with
    a bare ``'<' not supported``. Before: ours passed that on; now it says which keys and
    that loading with ``str`` keys (the names the checkpoint has) works."""
    state: dict[Any, Any] = {1: torch.arange(3.0), "a": torch.ones(2)}
    if writer == "stock":
        dcp.save(state, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    else:
        storage.save(state, tmp_path)
    stock_reader = FileSystemReader(tmp_path)
    with pytest.raises(TypeError, match="not supported"):
        dcp.load(
            {1: torch.zeros(3), "a": torch.zeros(2)}, storage_reader=stock_reader, no_dist=True
        )
    with pytest.raises(TypeError, match=r"mix types \(int, str: \[1, 'a'\]\).*str\(k\)"):
        storage.load({1: torch.zeros(3), "a": torch.zeros(2)}, tmp_path)
    target = {"1": torch.zeros(3), "a": torch.zeros(2)}
    storage.load(target, tmp_path)
    assert torch.equal(target["1"], state[1]) and torch.equal(target["a"], state["a"])
