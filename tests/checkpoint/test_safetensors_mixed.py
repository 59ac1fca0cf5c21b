"""Two saves or exports to one folder at once publish the same Hub names, each file
whole, so the folder can end with files of both under one index. Every write records
one id in its files and its index; the loader and ``verify`` refuse a folder whose files
do not all carry the index's id. Models that record no id (other writers, ours before
ids) keep loading."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import storage
from extensions.errors import CheckpointNotFoundError, IntegrityError
from storage.backends import LocalFileSystem
from storage.checkpoint.safetensors import files, load_safetensors, save_safetensors
from storage.checkpoint.safetensors.header import INDEX_NAME, WRITE_KEY
from storage.checkpoint.safetensors.verify import verify_model
from storage.cli import main
from storage.ops.export import export_safetensors

GOLDEN = Path(__file__).parents[1] / "golden"
SHARD_1 = "model-00001-of-00002.safetensors"
SHARD_2 = "model-00002-of-00002.safetensors"


def _model(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(16, 8, generator=gen),
        "b.weight": torch.randn(8, 8, generator=gen),
    }


def _save(folder: Path, seed: int) -> None:
    save_safetensors(_model(seed), folder, max_shard_size=600)
    assert sorted(p.name for p in folder.iterdir()) == [SHARD_1, SHARD_2, INDEX_NAME]


def _header_meta(path: Path) -> dict[str, str]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    meta: dict[str, str] = json.loads(data[8 : 8 + length])["__metadata__"]
    return meta


def _index_meta(folder: Path) -> dict[str, object]:
    meta: dict[str, object] = json.loads((folder / INDEX_NAME).read_text())["metadata"]
    return meta


def _empty() -> dict[str, torch.Tensor]:
    return {k: torch.empty_like(v) for k, v in _model(0).items()}


def test_every_file_of_a_write_and_its_index_carry_one_id_and_each_write_its_own(
    tmp_path: Path,
) -> None:
    _save(tmp_path / "a", 1)
    _save(tmp_path / "b", 1)
    ids = []
    for folder in (tmp_path / "a", tmp_path / "b"):
        index_id = _index_meta(folder)[WRITE_KEY]
        assert {_header_meta(folder / f)[WRITE_KEY] for f in (SHARD_1, SHARD_2)} == {index_id}
        ids.append(index_id)
    assert ids[0] != ids[1]


def test_load_and_verify_refuse_a_folder_holding_shards_of_two_saves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The second save's shard 2 over the first's: the index and every header are each
    consistent, checksums included; only the write ids tell the mix."""
    first, second = tmp_path / "first", tmp_path / "second"
    _save(first, 1)
    _save(second, 2)
    shutil.copy(second / SHARD_2, first / SHARD_2)
    with pytest.raises(IntegrityError) as exc:
        load_safetensors(_empty(), first)
    message = str(exc.value)
    assert str(first) in message and SHARD_2 in message and "again" in message
    assert SHARD_1 not in message
    with pytest.raises(IntegrityError, match=SHARD_2):
        verify_model(LocalFileSystem(), str(first))
    assert main(["verify", str(first)]) == 1
    err = capsys.readouterr().err
    assert SHARD_2 in err and "another save or export" in err
    # the unmixed folder still loads
    target = _empty()
    load_safetensors(target, second)
    assert all(torch.equal(target[k], v) for k, v in _model(2).items())


def test_load_refuses_shards_of_two_exports(tmp_path: Path) -> None:
    source = tmp_path / "ckpt"
    storage.save(_model(3), source)
    fs = LocalFileSystem()
    for name in ("x", "y"):
        export_safetensors(fs, str(source), fs, str(tmp_path / name), max_shard_size=600)
    shutil.copy(tmp_path / "y" / SHARD_1, tmp_path / "x" / SHARD_1)
    with pytest.raises(IntegrityError, match=f"{SHARD_1}.*another save or export"):
        load_safetensors(_empty(), tmp_path / "x")
    target = _empty()
    load_safetensors(target, tmp_path / "y")
    assert all(torch.equal(target[k], v) for k, v in _model(3).items())


def test_a_shard_without_an_id_under_an_index_with_one_and_the_reverse_are_refused(
    tmp_path: Path,
) -> None:
    """An old (id-less) write mixed with a new one: one side carries an id, so the
    other must carry the same."""
    new, old = tmp_path / "new", tmp_path / "old"
    _save(new, 1)
    model = _model(1)
    old.mkdir()
    save_file({"a.weight": model["a.weight"]}, str(old / SHARD_1), metadata={"format": "pt"})
    save_file({"b.weight": model["b.weight"]}, str(old / SHARD_2), metadata={"format": "pt"})
    weight_map = {"a.weight": SHARD_1, "b.weight": SHARD_2}
    index = {"metadata": {"total_size": 768}, "weight_map": weight_map}
    (old / INDEX_NAME).write_text(json.dumps(index))
    load_safetensors(_empty(), old)  # no id anywhere: not checked
    mixed_new = tmp_path / "mixed-new"
    shutil.copytree(new, mixed_new)
    shutil.copy(old / SHARD_1, mixed_new / SHARD_1)
    with pytest.raises(IntegrityError, match=f"{SHARD_1}.*write id none"):
        load_safetensors(_empty(), mixed_new)
    shutil.copy(new / SHARD_2, old / SHARD_2)
    with pytest.raises(IntegrityError, match=f"{SHARD_2}.*the index's none"):
        load_safetensors(_empty(), old)


def test_a_model_our_writer_saved_before_write_ids_still_loads_and_verifies(
    capsys: pytest.CaptureFixture[str],
) -> None:
    golden = GOLDEN / "safetensors-v1"
    assert WRITE_KEY not in _index_meta(golden)  # regenerated with ids, it guards nothing
    assert all(WRITE_KEY not in _header_meta(golden / f) for f in (SHARD_1, SHARD_2))
    expected = torch.load(GOLDEN / "expected.pt", weights_only=True)
    target = {k: torch.zeros_like(expected[k]) for k in ("layer.weight", "layer.bias", "ids")}
    load_safetensors(target, golden)
    assert all(torch.equal(target[k], expected[k]) for k in target)
    assert main(["verify", str(golden)]) == 0
    assert capsys.readouterr().out.startswith("OK: safetensors model")


def test_an_index_whose_write_id_is_not_a_string_is_refused(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    index["metadata"][WRITE_KEY] = 7
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(IntegrityError, match="not a string"):
        load_safetensors(_empty(), tmp_path)


class _OverlappedAtTheIndex(LocalFileSystem):
    """Runs ``other()`` (another write to the folder, to its end) just before this
    write's index, or just after it (``after``)."""

    def __init__(self, other: Callable[[], object], after: bool) -> None:
        super().__init__()
        self.other: Callable[[], object] | None = other
        self.after = after

    def write_atomic(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        other = self.other if path.endswith(INDEX_NAME) else None
        self.other = None if other is not None else self.other
        if other is not None and not self.after:
            other()
        super().write_atomic(path, data, exclusive=exclusive)
        if other is not None and self.after:
            other()


@pytest.mark.parametrize("how", ["export", "save"])
@pytest.mark.parametrize(
    ("after", "error"),
    [
        (False, "two writes to this folder overlapped"),  # its index over the other's files
        (True, "published its index while this one was written"),  # the other's model
    ],
    ids=["before-its-index", "after-its-index"],
)
def test_a_write_overlapped_by_another_fails_instead_of_saying_it_succeeded(
    tmp_path: Path, how: str, after: bool, error: str
) -> None:
    """Both writes returned, each as if its model were at DEST, while the folder held
    the first's index over the second's files (which every other reader loads) or the
    second's model: the write that publishes its index now reads the folder back."""
    out = tmp_path / "out"
    storage.save(_model(1), str(tmp_path / "one"))
    storage.save(_model(2), str(tmp_path / "two"))
    fs = LocalFileSystem()

    def second() -> None:
        export_safetensors(
            fs, str(tmp_path / "two"), fs, str(out), max_shard_size=600, overwrite=True
        )

    overlapped = _OverlappedAtTheIndex(second, after)
    with pytest.raises(IntegrityError, match=error):
        if how == "export":
            source = str(tmp_path / "one")
            export_safetensors(overlapped, source, overlapped, str(out), max_shard_size=600)
        else:
            writer = storage.SafetensorsWriter(out, max_shard_size=600)
            writer.fs = overlapped
            storage.checkpoint.api.save_with(writer, _model(1))
    if not after:  # the second removed the first's files, replacing its model
        with pytest.raises(CheckpointNotFoundError, match="is missing"):
            load_safetensors(_empty(), out)


@pytest.mark.parametrize("how", ["export", "save"])
def test_a_write_committed_just_after_another_read_its_model_back_is_not_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The first write read its model back; the second then committed its own whole.
    The first removed every model file not its own, found when it removed them: the
    second's files, leaving an index naming files that are gone, and both returned as
    if their model were there. It now removes only what was there before it began,
    and only while the index is still its own."""
    out = tmp_path / "out"
    storage.save(_model(1), str(tmp_path / "one"))
    storage.save(_model(2), str(tmp_path / "two"))
    fs = LocalFileSystem()
    confirm = files._confirm_write
    pending: list[Callable[[], object]] = [
        lambda: export_safetensors(
            fs, str(tmp_path / "two"), fs, str(out), max_shard_size=600, overwrite=True
        )
    ]

    def then_another(fs_: LocalFileSystem, root: str, write_id: str) -> None:
        confirm(fs_, root, write_id)
        if pending:
            pending.pop()()

    monkeypatch.setattr(files, "_confirm_write", then_another)
    with pytest.raises(IntegrityError, match="published its index while this one was written"):
        if how == "export":
            export_safetensors(fs, str(tmp_path / "one"), fs, str(out), max_shard_size=600)
        else:
            storage.save_safetensors(_model(1), out, max_shard_size=600)
    state = _empty()
    load_safetensors(state, out)
    assert all(torch.equal(state[k], v) for k, v in _model(2).items())


@pytest.mark.parametrize(
    ("whole", "error"),
    [
        (False, "published model.safetensors while this one was written"),
        (True, "removed this one's model.safetensors.index.json"),
    ],
    ids=["published", "committed"],
)
def test_a_write_of_several_files_overlapped_by_a_single_file_fails(
    tmp_path: Path, whole: bool, error: str
) -> None:
    """Readers take model.safetensors over an index: a write of several files that
    finds one published meanwhile by another write (which then removes the index, or
    has yet to) would return while every reader loads the other's model; it fails."""
    out = tmp_path / "out"
    _save(out, 0)
    storage.save(_model(1), str(tmp_path / "one"))
    storage.save(_model(2), str(tmp_path / "two"))
    fs = LocalFileSystem()

    def single() -> None:
        if whole:
            export_safetensors(fs, str(tmp_path / "two"), fs, str(out), overwrite=True)
        else:
            files.write_file(fs, str(out / "model.safetensors"), list(_model(2).items()))

    overlapped = _OverlappedAtTheIndex(single, after=True)
    with pytest.raises(IntegrityError, match=error):
        export_safetensors(
            overlapped,
            str(tmp_path / "one"),
            overlapped,
            str(out),
            max_shard_size=600,
            overwrite=True,
        )
    state = _empty()
    load_safetensors(state, out)
    assert all(torch.equal(state[k], v) for k, v in _model(2).items())
