"""An incremental save's fingerprints are taken by the threads that write its files:
each item's on the thread writing its file, just before it is written, so one thread's
writes overlap another's fingerprints; the fingerprint recorded is of the bytes written."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, cast

import pytest
import torch

import storage
from storage.checkpoint import data_files, incremental
from storage.checkpoint import storage_format as fmt
from tests.checkpoint.test_incremental import _refs, _state
from tests.support.trees import assert_tree_equal, zeros_like_tree

#: Generous: a gate that opens at all opens within milliseconds.
GATE = 60.0


def _load(path: Path) -> dict[str, Any]:
    out = cast(dict[str, Any], zeros_like_tree(_state(0)))
    storage.load(out, path)
    return out


def _contents(path: Path) -> dict[str, str | None]:
    meta = fmt.load_metadata((path / ".metadata").read_bytes(), str(path))
    return {fmt.item_label(i): fmt.stored_item(s).content for i, s in meta.storage_data.items()}


def _per_item_files_on_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small states get as many writing threads as asked for (one file per item)."""
    monkeypatch.setattr(data_files, "BYTES_PER_THREAD", 1)


def test_fingerprints_taken_on_the_writing_threads_are_those_of_one_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each item keeps its own fingerprint whether its save writes on one thread or
    on several (bytes items among tensors), and the references follow."""
    hashed_on: set[str] = set()
    real = incremental.fingerprint

    def fingerprint(data: Any, transforms: Any) -> incremental.Fingerprint:
        hashed_on.add(threading.current_thread().name)
        return real(data, transforms)

    monkeypatch.setattr(incremental, "fingerprint", fingerprint)
    _per_item_files_on_threads(monkeypatch)
    for threads, root in ((1, tmp_path / "one"), (4, tmp_path / "spread")):
        kw: dict[str, Any] = {"thread_count": threads, "single_file_per_rank": False}
        storage.save(_state(1), root / "step-1", fingerprint=True, **kw)
        storage.save(_state(2), root / "step-2", base=str(root / "step-1"), **kw)
    assert hashed_on == {"dcp-storage-saving"}
    for step in ("step-1", "step-2"):
        one, spread = _contents(tmp_path / "one" / step), _contents(tmp_path / "spread" / step)
        assert one == spread and None not in one.values(), step
    assert _refs(tmp_path / "spread" / "step-2") == _refs(tmp_path / "one" / "step-2")
    assert _refs(tmp_path / "spread" / "step-2")["base.w"] == "step-1"
    assert_tree_equal(_load(tmp_path / "spread" / "step-2"), _state(2))


def test_a_changed_item_is_written_while_another_is_fingerprinted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step's writes overlap its fingerprints: the frozen item's fingerprint is
    held until the changed adapter was written, which another thread does meanwhile.
    Before, every fingerprint was taken before the first write began."""
    storage.save(_state(1), tmp_path / "step-1", fingerprint=True)
    frozen = _state(2)["base.w"]
    written = threading.Event()
    waited: list[bool] = []
    real_fingerprint, real_encode = incremental.fingerprint, data_files.encode_item

    def fingerprint(data: Any, transforms: Any) -> incremental.Fingerprint:
        if isinstance(data, torch.Tensor) and not waited and torch.equal(data, frozen):
            waited.append(written.wait(GATE))
        return real_fingerprint(data, transforms)

    def encode_item(stream: Any, transforms: Any, info: Any, *args: Any) -> Any:
        record = real_encode(stream, transforms, info, *args)
        if info.item == "lora.A":
            written.set()
        return record

    monkeypatch.setattr(incremental, "fingerprint", fingerprint)
    monkeypatch.setattr(data_files, "encode_item", encode_item)
    _per_item_files_on_threads(monkeypatch)
    storage.save(
        _state(2),
        tmp_path / "step-2",
        base=str(tmp_path / "step-1"),
        thread_count=2,
        single_file_per_rank=False,
    )
    assert waited == [True]
    assert _refs(tmp_path / "step-2")["base.w"] == "step-1"
    assert _refs(tmp_path / "step-2")["lora.A"] is None
    assert_tree_equal(_load(tmp_path / "step-2"), _state(2))


def test_an_item_changed_while_it_is_written_records_no_fingerprint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The adapter changes after its fingerprint was taken, as its bytes go out (a
    training step running during the save): the bytes written are not those the
    fingerprint describes, so none is recorded, and the next step, whose adapter holds
    the content first fingerprinted, writes it again. Before, the stale fingerprint was
    recorded and the next step referenced the changed bytes in its place."""
    storage.save(_state(1), tmp_path / "step-1", fingerprint=True)
    real_encode = data_files.encode_item

    def encode_item(stream: Any, transforms: Any, info: Any, data: Any, *args: Any) -> Any:
        if info.item == "lora.A":
            data.add_(1.0)  # the training step, after the fingerprint was taken
        return real_encode(stream, transforms, info, data, *args)

    monkeypatch.setattr(data_files, "encode_item", encode_item)
    changing = _state(2)
    storage.save(changing, tmp_path / "step-2", base=str(tmp_path / "step-1"))
    monkeypatch.setattr(data_files, "encode_item", real_encode)
    assert _contents(tmp_path / "step-2")["lora.A"] is None
    assert_tree_equal(_load(tmp_path / "step-2"), changing)  # the bytes as written

    storage.save(_state(2), tmp_path / "step-3", base=str(tmp_path / "step-2"))
    assert _refs(tmp_path / "step-3")["lora.A"] is None
    assert _contents(tmp_path / "step-3")["lora.A"] is not None
    assert_tree_equal(_load(tmp_path / "step-3"), _state(2))
