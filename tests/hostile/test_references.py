"""Deleting a base that a kept step still needs.

References are found through every metadata of a step (rank-local ones too), a base is
recorded by its canonical name (never an alias), and a step whose metadata cannot be read
keeps everything it might reference. Every test names, in a comment, what happened before
the fix.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import storage
from extensions.errors import CheckpointInUseError
from storage import CheckpointManager, LocalFileSystem
from storage.cli import main
from storage.ops.describe import describe
from tests.support.subprocess_jobs import start_script, wait_for_mark

FROZEN = torch.arange(4096.0)


def _state(step: int) -> dict[str, Any]:
    return {"frozen": FROZEN.clone(), "w": torch.full((8,), float(step)), "step": step}


def _assert_loads(path: Path, step: int) -> None:
    out = {"frozen": torch.zeros(4096), "w": torch.zeros(8), "step": -1}
    storage.load(out, str(path))
    assert torch.equal(out["frozen"], FROZEN) and out["step"] == step


def _refs(path: Path) -> set[str | None]:
    return {r.ref for r in describe(LocalFileSystem(), str(path)).items}


# --- 3. rank-local metadata references too --------------------------------------------------


@pytest.fixture
def rank_local_user(tmp_path: Path) -> Path:
    """``root/step-1`` (full) and ``root/step-2``, committed only by ``__0.metadata``
    (``use_collectives=False``), whose frozen item references step-1."""
    root = tmp_path / "root"
    storage.save(_state(1), str(root / "step-1"), fingerprint=True)
    writer = storage.CheckpointWriter(root / "step-2", base=str(root / "step-1"))
    dcp.save(_state(2), storage_writer=writer, no_dist=True, use_collectives=False)
    names = os.listdir(root / "step-2")
    assert "__0.metadata" in names and ".metadata" not in names
    assert _refs(root / "step-2") == {"step-1", None}
    return root


def test_delete_and_rm_see_rank_local_references(
    rank_local_user: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: reference discovery read only .metadata, so mgr.delete(1) and `rm` went
    # ahead and step-2 no longer loaded.
    root = rank_local_user
    with pytest.raises(CheckpointInUseError, match="step-2"):
        CheckpointManager(root).delete(1)
    assert main(["rm", str(root / "step-1")]) == 1
    assert "step-2" in capsys.readouterr().err
    _assert_loads(root / "step-2", 2)


def test_gc_keeps_a_base_of_a_rank_local_step(rank_local_user: Path) -> None:
    # Before: `gc --keep-last 1` deleted step-1, the base of the kept step-2.
    root = rank_local_user
    assert main(["gc", str(root), "--keep-last", "1"]) == 0
    assert CheckpointManager(root).steps() == [1, 2]
    _assert_loads(root / "step-2", 2)


def test_saving_over_a_base_of_a_rank_local_step_is_refused(rank_local_user: Path) -> None:
    # Before: the save over step-1 published and removed step-1's old files, which
    # step-2 references.
    root = rank_local_user
    with pytest.raises(CheckpointInUseError, match="overwrite"):
        storage.save(_state(9), str(root / "step-1"))
    _assert_loads(root / "step-1", 1)
    _assert_loads(root / "step-2", 2)


# --- 4. a base given through an alias --------------------------------------------------------


@pytest.fixture
def aliased(tmp_path: Path) -> Path:
    """``root/step-5`` and ``root/latest -> step-5``."""
    root = tmp_path / "root"
    storage.save(_state(5), str(root / "step-5"), fingerprint=True)
    (root / "latest").symlink_to("step-5", target_is_directory=True)
    return root


def test_a_base_alias_is_recorded_by_its_canonical_name(aliased: Path) -> None:
    # Before: step-6 recorded its references as "latest"; retention did not know that
    # step-6 needs step-5 and deleted it, and step-6 no longer loaded.
    root = aliased
    storage.save(_state(6), str(root / "step-6"), base=str(root / "latest"))
    assert _refs(root / "step-6") == {"step-5", None}
    assert main(["gc", str(root), "--keep-last", "1"]) == 0
    assert CheckpointManager(root).steps() == [5, 6]
    _assert_loads(root / "step-6", 6)


def test_a_base_that_is_the_checkpoint_being_written_is_refused(aliased: Path) -> None:
    # Before: re-saving step-5 with base=root/latest pointed its unchanged items at
    # step-5's own old files and deleted them after publishing: the save reported
    # success and step-5 no longer loaded.
    root = aliased
    with pytest.raises(ValueError, match="is the checkpoint being written.*latest resolves"):
        storage.save(_state(5), str(root / "step-5"), base=str(root / "latest"))
    with pytest.raises(ValueError, match="is the checkpoint being written"):
        storage.save(_state(5), str(root / "step-5"), base=str(root / "step-5"))
    _assert_loads(root / "step-5", 5)


def test_a_base_linking_outside_the_directory_is_refused(aliased: Path) -> None:
    # Before: a link to a checkpoint elsewhere was recorded by the link's name, so the
    # references broke as soon as the link was removed or changed.
    root = aliased
    storage.save(_state(1), str(root.parent / "elsewhere" / "pretrained"), fingerprint=True)
    (root / "pretrained").symlink_to(root.parent / "elsewhere" / "pretrained")
    with pytest.raises(ValueError, match="outside"):
        storage.save(_state(6), str(root / "step-6"), base=str(root / "pretrained"))
    assert not (root / "step-6" / ".metadata").exists()


def test_manager_never_bases_on_a_linked_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A shared checkpoint linked in as step-0 resolves outside the root, so it can be no
    # base (it used to be recorded by the link's name): the next save is a full one
    # rather than a save refused for its base.
    caplog.set_level(logging.INFO, logger="storage.ops.manager")
    root = tmp_path / "root"
    storage.save(_state(0), str(tmp_path / "shared" / "pretrained"), fingerprint=True)
    root.mkdir()
    (root / "step-0").symlink_to(tmp_path / "shared" / "pretrained")
    mgr = CheckpointManager(root, incremental=True)
    mgr.save(1, _state(1))
    assert _refs(root / "step-1") == {None}
    assert "step 0 is no base (it is a symbolic link)" in caplog.text
    _assert_loads(root / "step-1", 1)


def test_saving_or_copying_over_a_base_through_an_alias_elsewhere_is_refused(
    tmp_path: Path,
) -> None:
    # Before: the check for checkpoints that reference the one being replaced listed the
    # siblings of the alias (tmp/alias, beside nothing), not those of step-1 it resolves
    # to: saving or copying over the alias published, removed step-1's files, and step-2
    # (which references them) no longer loaded.
    root = tmp_path / "root"
    mgr = CheckpointManager(root, incremental=True)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    assert _refs(root / "step-2") == {"step-1", None}
    alias = tmp_path / "alias"
    alias.symlink_to(root / "step-1", target_is_directory=True)
    with pytest.raises(CheckpointInUseError, match="overwrite .*step-1.*step-2 beside it"):
        storage.save(_state(9), str(alias), overwrite=True)
    storage.save(_state(7), str(tmp_path / "other"))
    assert main(["cp", str(tmp_path / "other"), str(alias), "--overwrite"]) == 1
    _assert_loads(root / "step-1", 1)
    _assert_loads(root / "step-2", 2)
    assert len([n for n in os.listdir(root / "step-1") if n.endswith(".distcp")]) == 1


# --- 5. a step whose metadata cannot be read fails closed -----------------------------------


class _FlakyDisk(LocalFileSystem):
    """Local disk whose reads of ``failing`` raise EIO while ``failing`` is set."""

    failing: str | None = None

    def read_bytes(self, path: str, *, limit: int | None = None) -> bytes:
        if self.failing is not None and path == self.failing:
            raise OSError(errno.EIO, "Input/output error", path)
        return super().read_bytes(path, limit=limit)


@pytest.fixture
def flaky(tmp_path: Path) -> tuple[Path, _FlakyDisk]:
    """Incremental ``step-1`` (full) and ``step-2`` (references step-1), on a disk whose
    reads of step-2's metadata fail."""
    root = tmp_path / "root"
    mgr = CheckpointManager(root, incremental=True)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    assert _refs(root / "step-2") == {"step-1", None}
    fs = _FlakyDisk()
    fs.failing = str(root / "step-2" / ".metadata")
    return root, fs


def test_retention_keeps_every_step_while_one_cannot_be_read(
    flaky: tuple[Path, _FlakyDisk], caplog: pytest.LogCaptureFixture
) -> None:
    # Before: retention took the unreadable step-2 for a step referencing nothing and
    # deleted its base, step-1: once the disk recovered, step-2 no longer loaded.
    root, fs = flaky
    assert CheckpointManager(root, keep_last=1, filesystem=fs).apply_retention() == []
    assert "cannot be read" in caplog.text and "Input/output error" in caplog.text
    fs.failing = None
    assert CheckpointManager(root).steps() == [1, 2]
    _assert_loads(root / "step-2", 2)


def test_delete_refuses_while_a_sibling_cannot_be_read(flaky: tuple[Path, _FlakyDisk]) -> None:
    # Before: mgr.delete(1) read step-2's metadata, failed, treated it as referencing
    # nothing and deleted step-1.
    root, fs = flaky
    with pytest.raises(CheckpointInUseError, match="step-2 beside it cannot be read"):
        CheckpointManager(root, filesystem=fs).delete(1)
    fs.failing = None
    _assert_loads(root / "step-2", 2)


class _ListingMissesMetadata(LocalFileSystem):
    """Local disk whose listing of ``lagging`` misses its ``.metadata`` (a listing that
    lags behind the store, or misses an object); reads by name work."""

    lagging: str | None = None

    def ls(self, path: str) -> list[str]:
        names = super().ls(path)
        return [n for n in names if n != ".metadata"] if path == self.lagging else names


def test_a_referencing_step_whose_listing_misses_its_metadata_still_keeps_its_base(
    flaky: tuple[Path, _FlakyDisk],
) -> None:
    # Before: the reference check opened each sibling from its listing alone: step-2,
    # whose listing missed its .metadata, looked uncommitted, so delete(1), retention
    # and `rm` removed step-1, which step-2 references.
    root, _ = flaky
    fs = _ListingMissesMetadata()
    fs.lagging = str(root / "step-2")
    mgr = CheckpointManager(root, keep_last=1, filesystem=fs)
    with pytest.raises(CheckpointInUseError, match="step-2"):
        mgr.delete(1)
    assert mgr.apply_retention() == []
    _assert_loads(root / "step-1", 1)
    _assert_loads(root / "step-2", 2)


# --- two processes on one root: a deletion racing an incremental save of the base ---------


class _Gate(LocalFileSystem):
    """Holds the first call of ``op`` whose path ends with ``suffix`` until ``go`` is set
    (``parked`` says it arrived): a kill or race point that needs no sleep. The waits
    only bound a failure: a loaded machine may hold the other side for seconds."""

    def __init__(self, op: str, suffix: str) -> None:
        super().__init__()
        self.op, self.suffix = op, suffix
        self.parked, self.go = threading.Event(), threading.Event()

    def _hold(self, op: str, path: str) -> None:
        if op == self.op and path.endswith(self.suffix) and not self.parked.is_set():
            self.parked.set()
            assert self.go.wait(300), "the test never released the gate"

    def write_atomic(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        self._hold("publish", path)
        super().write_atomic(path, data, exclusive=exclusive)

    def rename_in(self, directory: str, name: str, new_name: str) -> None:
        self._hold("rename", os.path.join(directory, name))
        super().rename_in(directory, name, new_name)


def _two_steps(root: Path) -> CheckpointManager:
    """An incremental manager with steps 9 and 10 whose frozen item lives in step 9."""
    saver = CheckpointManager(str(root), incremental=True, persist="thread")
    saver.save(9, _state(9))
    saver.save(10, _state(10))
    return saver


def _run(target: Any) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def body() -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, errors


def test_a_base_deleted_between_a_saves_check_and_its_publish_withdraws_the_save(
    tmp_path: Path,
) -> None:
    """Another manager on the root (a second job, a zombie of this one) prunes step 9
    while this manager's incremental save of step 11, which references it, sits between
    its check of the bases and the publish of its metadata. Before, step 11 was
    committed anyway and every load of it failed: `item 'frozen' is stored in base
    checkpoint .../step-9, which is missing`. Now the save checks its bases again once
    its metadata landed, withdraws it and fails; the root keeps only loadable steps and
    the next save of step 11 (a full one) succeeds."""
    root = tmp_path / "root"
    _two_steps(root)
    gate = _Gate("publish", "step-11/.metadata")
    saver = CheckpointManager(str(root), incremental=True, persist="thread", filesystem=gate)
    thread, errors = _run(lambda: saver.save(11, _state(11)))
    assert gate.parked.wait(120)
    pruner = CheckpointManager(str(root), keep_last=1, persist="thread")
    pruner.save(12, _state(12))  # prunes 9 and 10: step 11 is not committed yet
    gate.go.set()
    thread.join(120)
    assert not thread.is_alive()
    assert len(errors) == 1 and "withdrawn" in str(errors[0]), errors
    assert "step-9" in str(errors[0]) and "step-11" in str(errors[0])
    assert pruner.steps() == [12]
    saver.save(11, _state(11))
    _assert_loads(root / "step-11", 11)
    _assert_loads(root / "step-12", 12)


def test_a_deletion_that_decided_before_a_save_chose_its_base_keeps_the_base(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another manager's retention reads the root (steps 9 and 10, nothing references
    9) and decides to delete step 9; before it does, this manager's incremental save of
    step 11 commits, referencing step 9. Before, the retention deleted step 9 anyway and
    step 11 did not load. Now the deletion moves step 9's metadata aside, looks again
    for steps that reference it, finds step 11 and puts the metadata back."""
    root = tmp_path / "root"
    saver = _two_steps(root)
    gate = _Gate("rename", "step-9/.metadata")
    pruner = CheckpointManager(str(root), keep_last=1, persist="thread", filesystem=gate)
    thread, errors = _run(lambda: pruner.save(12, _state(12)))
    assert gate.parked.wait(120)  # step 10 is gone, step 9 is next
    saver.save(11, _state(11))  # its base is step 9 (10 is gone), still committed
    with caplog.at_level(logging.WARNING, logger="storage"):
        gate.go.set()
        thread.join(120)
    assert not thread.is_alive() and not errors, errors
    assert "step-11" in caplog.text and "reference" in caplog.text
    assert pruner.steps() == [9, 11, 12]
    assert not [n for n in os.listdir(root / "step-9") if ".tmp-" in n]
    _assert_loads(root / "step-9", 9)
    _assert_loads(root / "step-11", 11)
    assert _refs(root / "step-11") >= {"step-9"}


def test_rm_that_decided_before_a_save_chose_its_base_keeps_the_base(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dcp-storage rm root/step-9` finds nothing referencing step 9; before it deletes,
    a manager's incremental save of step 10 commits with step 9 as its base. Before,
    `rm` deleted step 9 anyway and step 10 did not load. Now `rm` looks again once the
    metadata is moved aside, puts it back and refuses, naming step 10."""
    root = tmp_path / "root"
    saver = CheckpointManager(str(root), incremental=True, persist="thread")
    saver.save(9, _state(9))
    gate = _Gate("rename", "step-9/.metadata")
    rename_in = LocalFileSystem.rename_in

    def held(self: LocalFileSystem, directory: str, name: str, new_name: str) -> None:
        gate._hold("rename", os.path.join(directory, name))  # the CLI makes its own backend
        rename_in(self, directory, name, new_name)

    monkeypatch.setattr(LocalFileSystem, "rename_in", held)
    codes: list[int] = []
    thread, errors = _run(lambda: codes.append(main(["rm", str(root / "step-9")])))
    assert gate.parked.wait(120)
    saver.save(10, _state(10))
    gate.go.set()
    thread.join(120)
    assert not thread.is_alive() and not errors and codes == [1], (codes, errors)
    assert "step-10" in capsys.readouterr().err
    assert saver.steps() == [9, 10]
    _assert_loads(root / "step-10", 10)


_PRUNE_KILLED_AFTER_THE_MOVE = """
import os, sys, time
from storage import CheckpointManager, LocalFileSystem
root, decided, go, moved = sys.argv[1:5]
rename_in = LocalFileSystem.rename_in
def wait_for(path):
    deadline = time.monotonic() + 300
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
def held(self, directory, name, new_name):
    if os.path.join(directory, name).endswith("step-9/.metadata"):
        open(decided, "w").close()  # nothing referenced step 9 when it looked
        wait_for(go)
        rename_in(self, directory, name, new_name)
        open(moved, "w").close()  # killed here, before it looks again
        wait_for(go + ".never")
    rename_in(self, directory, name, new_name)
LocalFileSystem.rename_in = held
CheckpointManager(root, keep_last=1, persist="thread").apply_retention()
"""


def test_cleanup_puts_back_a_base_whose_deletion_was_killed_before_it_looked_again(
    tmp_path: Path,
) -> None:
    """A pruning process decides to delete step 9 (nothing references it), an
    incremental save of step 10 then commits with step 9 as its base, and the pruning
    is killed with kill -9 right after moving step 9's metadata aside, before it looks
    again for references. Step 9 is then an interrupted save on disk; before, `cleanup`
    (and `gc`) removed it as one and step 10 never loaded again. Now `cleanup` sees that
    step 10 references it and moves the metadata back."""
    root = tmp_path / "root"
    saver = CheckpointManager(str(root), incremental=True, persist="thread")
    saver.save(9, _state(9))
    CheckpointManager(str(root), persist="thread").save(12, _state(12))  # full
    decided, go, moved = tmp_path / "decided", tmp_path / "go", tmp_path / "moved"
    args = [str(root), str(decided), str(go), str(moved)]
    proc = start_script(_PRUNE_KILLED_AFTER_THE_MOVE, args)
    try:
        wait_for_mark(proc, decided, "the pruning's decision")
        saver.save(10, _state(10))
        assert _refs(root / "step-10") >= {"step-9"}
        go.touch()
        wait_for_mark(proc, moved, "the move of step 9's metadata")
    finally:
        proc.kill()
        proc.wait(10)
    assert saver.steps() == [10, 12]  # step 9 is not a checkpoint while moved aside
    assert saver.cleanup(grace_seconds=0) == []
    assert saver.steps() == [9, 10, 12]
    _assert_loads(root / "step-9", 9)
    _assert_loads(root / "step-10", 10)
