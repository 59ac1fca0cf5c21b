"""The one commit transaction (``commit.commit_checkpoint``) that the writer, ``cp``, the
drain and the tiers' local commit share, the writer's ``publish=False``, and the "may have
landed" verdict travelling to every rank of a tier."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from extensions.errors import CheckpointNotFoundError
from storage.backends._local import LocalFileSystem
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.api import load, save_with
from storage.checkpoint.commit import commit_checkpoint, commit_may_have_landed
from storage.checkpoint.layout import is_committed
from storage.checkpoint.writer import CheckpointWriter
from storage.ops._peers import Group, gather_errors


def _state(step: int = 3) -> dict[str, Any]:
    return {"w": torch.arange(4096, dtype=torch.float32) * step, "step": step}


def _loaded(path: Path) -> dict[str, Any]:
    target: dict[str, Any] = {"w": torch.zeros(4096), "step": 0}
    load(target, path)
    return target


class _Publish(LocalFileSystem):
    """Local disk whose metadata publish fails: ``"refused"`` before it lands,
    ``"lost"`` after (the answer lost)."""

    how: str | None = None

    def write_atomic(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        if self.how == "refused" and path.endswith(".metadata"):
            raise ConnectionResetError("refused before the metadata landed")
        super().write_atomic(path, data, exclusive=exclusive)
        if self.how == "lost" and path.endswith(".metadata"):
            raise ConnectionResetError("response lost after the metadata landed")


def _unpublished(
    fs: LocalFileSystem, path: Path, step: int = 3, **options: Any
) -> tuple[Any, bytes, set[str]]:
    """A save of ``_state(step)`` written with ``publish=False``: its metadata, payload
    and the data files it wrote."""
    before = {p.name for p in path.iterdir()} if path.exists() else set()
    writer = CheckpointWriter(path, filesystem=fs, publish=False, **options)
    save_with(writer, _state(step))
    assert writer.published is None and writer.unpublished is not None
    meta, payload = writer.unpublished
    return meta, payload, {p.name for p in path.iterdir()} - before


def _commit(fs: LocalFileSystem, path: Path, meta: Any, payload: bytes) -> None:
    commit_checkpoint(
        fs,
        str(path),
        ".metadata",
        payload,
        save_id=meta.storage_meta.save_id,
        infos=meta.storage_data.values(),
        overwrite=True,
        sync=True,
    )


def test_an_unpublished_save_is_committed_by_the_transaction(tmp_path: Path) -> None:
    fs = LocalFileSystem()
    meta, payload, files = _unpublished(fs, tmp_path / "c")
    assert files and not is_committed(fs, str(tmp_path / "c"))  # data only, no metadata
    _commit(fs, tmp_path / "c", meta, payload)
    target = _loaded(tmp_path / "c")
    assert torch.equal(target["w"], _state()["w"]) and target["step"] == 3


def test_a_refused_commit_removes_the_new_files(tmp_path: Path) -> None:
    fs = _Publish()
    meta, payload, _ = _unpublished(fs, tmp_path / "c")
    fs.how = "refused"
    with pytest.raises(ConnectionResetError) as raised:
        _commit(fs, tmp_path / "c", meta, payload)
    assert not commit_may_have_landed(raised.value)
    assert not any((tmp_path / "c").iterdir())


def test_a_commit_that_landed_and_raised_keeps_the_files_and_says_so(tmp_path: Path) -> None:
    fs = _Publish()
    meta, payload, files = _unpublished(fs, tmp_path / "c")
    fs.how = "lost"
    with pytest.raises(ConnectionResetError) as raised:
        _commit(fs, tmp_path / "c", meta, payload)
    assert commit_may_have_landed(raised.value)  # every rank keeps its files
    assert files <= {p.name for p in (tmp_path / "c").iterdir()}
    assert torch.equal(_loaded(tmp_path / "c")["w"], _state()["w"])


def test_a_refused_overwrite_leaves_the_committed_checkpoint_intact(tmp_path: Path) -> None:
    fs = _Publish()
    save_with(CheckpointWriter(tmp_path / "c", filesystem=fs), _state(1))
    committed = {p.name: p.read_bytes() for p in (tmp_path / "c").iterdir()}
    meta, payload, new = _unpublished(fs, tmp_path / "c", step=2)
    assert new and not new & set(committed)  # the new save's files sit beside the old
    fs.how = "refused"
    with pytest.raises(ConnectionResetError):
        _commit(fs, tmp_path / "c", meta, payload)
    # Rolled back: the new files are gone, the committed checkpoint is byte for byte
    # what it was (metadata and data files) and still loads step 1.
    assert {p.name: p.read_bytes() for p in (tmp_path / "c").iterdir()} == committed
    assert _loaded(tmp_path / "c")["step"] == 1


def test_a_base_that_lost_a_file_fails_the_commit_before_it_publishes(tmp_path: Path) -> None:
    fs = LocalFileSystem()
    save_with(CheckpointWriter(tmp_path / "step-1", filesystem=fs, fingerprint=True), _state())
    save_with(CheckpointWriter(tmp_path / "step-2", filesystem=fs), _state(1))
    committed = {p.name: p.read_bytes() for p in (tmp_path / "step-2").iterdir()}
    # Step 2 again, incremental against step 1: "w" is unchanged, so it is a reference.
    meta, payload, new = _unpublished(fs, tmp_path / "step-2", base=str(tmp_path / "step-1"))
    assert any(fmt.stored_item(i).ref for i in meta.storage_data.values())
    for data in (tmp_path / "step-1").glob("*.distcp"):
        data.unlink()  # a gc, say, removed the base's bytes meanwhile
    with pytest.raises(CheckpointNotFoundError, match="step-1"):
        _commit(fs, tmp_path / "step-2", meta, payload)
    assert {p.name: p.read_bytes() for p in (tmp_path / "step-2").iterdir()} == committed
    assert _loaded(tmp_path / "step-2")["step"] == 1


class _TwoRanks(Group):
    """Rank 0 of two, hearing ``theirs`` from rank 1 (no process group needed)."""

    def __init__(self, theirs: tuple[str | None, bool]) -> None:
        super().__init__(rank=0, world=2, nodes=[[0], [1]])
        self.theirs = theirs

    def all_gather(self, obj: Any, *, pg: Any = None) -> list[Any]:
        return [obj, self.theirs]


def test_every_rank_hears_that_a_commit_may_have_landed() -> None:
    # Before: gather_errors passed on only the text of another rank's error, so the
    # ranks of a tier whose node leader's local publish may have landed removed their
    # data files under it.
    with pytest.raises(RuntimeError, match="failed on rank 1") as raised:
        gather_errors(_TwoRanks(("OSError: lost", True)), None, "committing step 1")
    assert commit_may_have_landed(raised.value)
    own = ValueError("this rank's own")
    with pytest.raises(ValueError) as raised_own:
        gather_errors(_TwoRanks(("OSError: lost", True)), own, "committing step 1")
    assert raised_own.value is own and commit_may_have_landed(own)
    with pytest.raises(RuntimeError) as plain:
        gather_errors(_TwoRanks(("OSError: refused", False)), None, "committing step 1")
    assert not commit_may_have_landed(plain.value)
