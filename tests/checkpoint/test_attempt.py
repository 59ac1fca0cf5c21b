"""``SaveAttempt``: the one owner of what a save wrote, which the writer, its data files,
the persist worker's return path, ``cp``, the drain and the tiers' commit all use."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path

import pytest

from extensions.errors import CheckpointStorageError
from storage.backends._local import LocalFileSystem
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.attempt import SaveAttempt
from storage.checkpoint.commit import commit_checkpoint, mark_may_have_landed
from storage.checkpoint.deadline import Budget

#: Generous: only a broken removal waits this long.
DEADLINE = 60.0


class _StalledRemoval(LocalFileSystem):
    """Local disk whose removals hang until ``release`` is set (a stalled store)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.removing = threading.Event()
        self.removed = threading.Event()

    def rm_file_in(self, directory: str, name: str) -> None:
        self.removing.set()
        assert self.release.wait(DEADLINE), "the removal was never released"
        super().rm_file_in(directory, name)
        self.removed.set()


def _files(path: Path, *names: str) -> list[str]:
    for name in names:
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(b"x")
    return list(names)


def _attempt(path: Path, fs: LocalFileSystem | None = None, **kw: float) -> SaveAttempt:
    budget = Budget(kw.get("timeout"))
    return SaveAttempt(fs or LocalFileSystem(), str(path), "abc123", budget)


def test_abort_removes_what_was_recorded_and_nothing_else(tmp_path: Path) -> None:
    """The recorded files go; a file the save did not record stays; a name recorded
    before its stream opened and never created is no error."""
    attempt = _attempt(tmp_path)
    for name in _files(tmp_path, "__0_0-abc123.distcp", "0a/__0_1-abc123.distcp"):
        assert attempt.record(name) == str(tmp_path / name)
    attempt.record("__0_2-abc123.distcp")  # planned, never created
    _files(tmp_path, "__0_0-other.distcp")
    attempt.abort()
    assert not (tmp_path / "__0_0-abc123.distcp").exists()
    assert not (tmp_path / "0a" / "__0_1-abc123.distcp").exists()
    assert (tmp_path / "__0_0-other.distcp").exists()


def test_nothing_is_removed_once_the_commit_landed(tmp_path: Path) -> None:
    attempt = _attempt(tmp_path)
    attempt.record(_files(tmp_path, "__0_0-abc123.distcp")[0])
    attempt.landed()
    attempt.abort(RuntimeError("a later step failed"))
    assert (tmp_path / "__0_0-abc123.distcp").exists()


def test_nothing_is_removed_when_the_error_says_the_commit_may_have_landed(
    tmp_path: Path,
) -> None:
    """Another rank's verdict (the error handed to abort) and this rank's own failed
    commit (``commit_failed``) both keep the files."""
    error = ConnectionResetError("the answer to the publish was lost")
    mark_may_have_landed(error)
    theirs, ours = _attempt(tmp_path), _attempt(tmp_path)
    theirs.record(_files(tmp_path, "__0_0-abc123.distcp")[0])
    ours.record(_files(tmp_path, "__1_0-abc123.distcp")[0])
    theirs.abort(error)
    ours.commit_failed(error)
    ours.abort()
    assert (tmp_path / "__0_0-abc123.distcp").exists()
    assert (tmp_path / "__1_0-abc123.distcp").exists()


def test_a_clean_commit_failure_removes_the_files(tmp_path: Path) -> None:
    attempt = _attempt(tmp_path)
    attempt.record(_files(tmp_path, "__0_0-abc123.distcp")[0])
    attempt.commit_failed(ConnectionResetError("refused before the metadata landed"))
    attempt.abort()
    assert not (tmp_path / "__0_0-abc123.distcp").exists()


def test_abort_past_the_deadline_returns_and_removes_in_the_background(tmp_path: Path) -> None:
    """A stalled store does not hold the save's error back: with the deadline spent the
    abort returns at once, and the removal completes once the store answers."""
    fs = _StalledRemoval()
    attempt = _attempt(tmp_path, fs, timeout=30.0)
    attempt.budget.spent = 30.0
    attempt.record(_files(tmp_path, "__0_0-abc123.distcp")[0])
    attempt.abort()  # returns while the removal hangs
    assert fs.removing.wait(DEADLINE)
    assert (tmp_path / "__0_0-abc123.distcp").exists()
    fs.release.set()
    assert fs.removed.wait(DEADLINE)
    assert not (tmp_path / "__0_0-abc123.distcp").exists()


def test_abort_is_idempotent_and_later_records_are_refused(tmp_path: Path) -> None:
    """The second abort removes nothing (a file of that name made since stays), and a
    writing thread that outlived the save opens no new file."""
    attempt = _attempt(tmp_path)
    attempt.record(_files(tmp_path, "__0_0-abc123.distcp")[0])
    attempt.abort()
    _files(tmp_path, "__0_0-abc123.distcp")
    attempt.abort()
    assert (tmp_path / "__0_0-abc123.distcp").exists()
    with pytest.raises(CheckpointStorageError, match="aborted"):
        attempt.record("__0_1-abc123.distcp")


def test_abort_never_removes_through_a_linked_prefix_directory(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    _files(elsewhere, "__0_0-abc123.distcp")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "0a").symlink_to(elsewhere)
    attempt = _attempt(ckpt)
    attempt.record("0a/__0_0-abc123.distcp")
    attempt.abort()
    assert (elsewhere / "__0_0-abc123.distcp").exists()


def test_records_from_many_threads_are_all_removed(tmp_path: Path) -> None:
    attempt = _attempt(tmp_path)
    names = _files(tmp_path, *(f"__0_{n}-abc123.distcp" for n in range(64)))
    threads = [threading.Thread(target=attempt.record, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(attempt.names) == sorted(names)
    attempt.abort()
    assert not list(tmp_path.iterdir())


def test_what_a_worker_reports_is_adopted_with_its_spent_deadline(tmp_path: Path) -> None:
    """The copy the persist worker ran records there; the training process's attempt
    adopts the names it reports and the deadline it spent."""
    attempt = _attempt(tmp_path, timeout=30.0)
    attempt.record("__0_0-abc123.distcp")
    there = pickle.loads(pickle.dumps(attempt))
    there.record(_files(tmp_path, "__0_1-abc123.distcp")[0])
    attempt.adopt(there.names, 12.5)
    assert attempt.names == ["__0_0-abc123.distcp", "__0_1-abc123.distcp"]
    assert attempt.budget.left() == 17.5
    attempt.abort()
    assert not (tmp_path / "__0_1-abc123.distcp").exists()


def test_a_lost_writer_is_swept_by_its_save_id(tmp_path: Path) -> None:
    """When the process writing died, what carries the save id goes too, recorded or
    not; other saves' files stay."""
    attempt = _attempt(tmp_path)
    _files(tmp_path, "__0_3-abc123.distcp", "__0_0-other.distcp")
    attempt.lost()
    attempt.abort()
    assert [p.name for p in tmp_path.iterdir()] == ["__0_0-other.distcp"]


def test_a_failed_commit_never_removes_through_a_linked_prefix_directory(tmp_path: Path) -> None:
    """The commit's rollback removed the new files by path, so a data file under a key
    prefix directory that is a symbolic link was deleted in the link's target."""
    elsewhere = tmp_path / "elsewhere"
    _files(elsewhere, "__0_0-abc123.distcp")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "0a").symlink_to(elsewhere)

    def payload() -> bytes:
        raise RuntimeError("serializing the metadata failed")

    info = fmt.new_storage_info(fmt.StoredItem("0a/__0_0-abc123.distcp", 0, 1))
    with pytest.raises(RuntimeError, match="serializing"):
        commit_checkpoint(
            LocalFileSystem(),
            str(ckpt),
            ".metadata",
            payload,
            save_id="abc123",
            infos=[info],
            overwrite=True,
            sync=False,
        )
    assert (elsewhere / "__0_0-abc123.distcp").exists()
