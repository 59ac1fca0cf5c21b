"""No step the library chose by number is written through a symbolic link.

A ``step-<N>`` directory that is a link (a shared pretrained checkpoint linked in as
``step-0``) belongs to someone else: a manager's save, a local tier's save, a preemption
save, a drain to the root, a restore from the peers, a heal's send and a folder upload
all refuse it before writing anything, and leave the linked checkpoint byte-identical.
A path the user names itself (``storage.save``, ``dcp.save``, ``cp``) is theirs to link.
A step path that is a plain file is refused with an error naming it. Every test names,
in a comment, what happened before the fix.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import storage
from extensions.errors import IntegrityError, UnsafeCheckpointError
from storage import CheckpointManager, CheckpointWriter, FsspecFileSystem, LocalFileSystem
from storage.checkpoint.committed import open_committed
from storage.cli import main
from storage.integrations.folders import FolderCheckpoints
from tests.support.distributed import gloo_group, spawn
from tests.support.local_disk import snapshot
from tests.support.tiers import blank_state, step_state, tiered


def _backends() -> list[Any]:
    return [
        pytest.param(LocalFileSystem, id="local"),
        pytest.param(lambda: FsspecFileSystem(protocol="file"), id="fsspec-file"),
    ]


def _state(value: float = 1.0) -> dict[str, Any]:
    return {"w": torch.full((16,), value), "step": int(value)}


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """A committed checkpoint of someone else's (the shared pretrained one)."""
    path = tmp_path / "shared" / "pretrained"
    storage.save(_state(1.0), str(path))
    return path


def _link(step_dir: Path, target: Path) -> dict[str, bytes]:
    """Make ``step_dir`` a link to ``target``; the target's files as they are now."""
    step_dir.parent.mkdir(parents=True, exist_ok=True)
    step_dir.symlink_to(target, target_is_directory=True)
    return snapshot(target)


def _pretrained_intact(shared: Path, before: dict[str, bytes]) -> None:
    assert snapshot(shared) == before
    out = {"w": torch.zeros(16), "step": -1}
    storage.load(out, str(shared))
    assert out["step"] == 1


# --- a manager's saves ----------------------------------------------------------------------


@pytest.mark.parametrize("make_fs", _backends())
def test_manager_refuses_to_save_over_a_linked_step(
    tmp_path: Path, shared: Path, make_fs: Any
) -> None:
    # Before: a loop that saves at step 0 wrote its state into the shared pretrained
    # checkpoint linked in as step-0, replaced its metadata and removed its data files
    # through the link; every other run using it then loaded this run's state.
    root = tmp_path / "root"
    before = _link(root / "step-0", shared)
    mgr = CheckpointManager(root, filesystem=make_fs())
    for blocking in (True, False):
        with pytest.raises(UnsafeCheckpointError, match="step-0 is a symbolic link"):
            mgr.save(0, _state(7.0), blocking=blocking)
    _pretrained_intact(shared, before)
    mgr.save(1, _state(2.0))  # other steps save as before
    assert mgr.steps() == [0, 1]


@pytest.mark.parametrize("where", ["local", "root"])
@pytest.mark.parametrize("make_fs", _backends())
def test_tiered_save_refuses_a_step_linked_in_either_tier(
    tmp_path: Path, shared: Path, make_fs: Any, where: str
) -> None:
    # Before: with step-0 linked in the local tier, a tiered save wrote into the shared
    # checkpoint through the link; with step-0 linked at the root, it committed locally
    # and its drain then wrote through the root's link.
    before = _link(tmp_path / ("local" if where == "local" else "durable") / "step-0", shared)
    mgr = tiered(tmp_path, filesystem=make_fs())
    for blocking in (True, False):
        with pytest.raises(UnsafeCheckpointError, match="step-0 is a symbolic link"):
            mgr.save(0, step_state(0), blocking=blocking)
    mgr.wait()
    _pretrained_intact(shared, before)
    other = tmp_path / ("durable" if where == "local" else "local")
    assert not (other / "step-0").exists()  # nothing written in the other tier either
    mgr.save(1, step_state(1))
    mgr.wait()
    assert mgr.durable_steps() == ([1] if where == "local" else [0, 1])


@pytest.fixture
def sigterm() -> Iterator[None]:
    """SIGTERM's handler as it was, put back after the test."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("where", ["local", "root"])
def test_preemption_save_refuses_a_linked_step(
    tmp_path: Path, shared: Path, sigterm: None, where: str
) -> None:
    # Before: SIGTERM at step 3, with step-3 linked, saved the job's state into the
    # linked checkpoint (local tier), or committed it locally for a drain through the
    # root's link: the preemption save went around the manager's refusal.
    before = _link(tmp_path / ("local" if where == "local" else "durable") / "step-3", shared)
    mgr = tiered(tmp_path)
    guard = mgr.save_on_signal(lambda: step_state(3))
    os.kill(os.getpid(), signal.SIGTERM)
    assert guard.should_stop(3)
    assert guard.saved is None and isinstance(guard.error, UnsafeCheckpointError)
    assert "step-3 is a symbolic link" in str(guard.error)
    mgr.wait()
    _pretrained_intact(shared, before)


# --- the drain ------------------------------------------------------------------------------


def test_drain_leaves_a_step_linked_at_the_root_local_and_drains_the_others(
    tmp_path: Path, shared: Path
) -> None:
    # Before: a step committed locally whose root directory became a link (linked while
    # the root was down, say) was drained through the link into the shared checkpoint,
    # and a drain that failed there stopped every later step from draining; one already
    # linked counted as durable, so it was never drained and keep_local deleted it.
    (tmp_path / "durable").write_text("down")
    crashed = tiered(tmp_path)
    crashed.save(7, step_state(7))
    _quietly(crashed.wait)
    _quietly(crashed.save, 8, step_state(8))
    _quietly(crashed.wait)
    (tmp_path / "durable").unlink()  # the root is back, step-7 linked in meanwhile
    before = _link(tmp_path / "durable" / "step-7", shared)
    restarted = tiered(tmp_path, keep_local=1)  # 7 is not durable: never pruned
    with pytest.raises(UnsafeCheckpointError, match="step-7 is a symbolic link") as refused:
        restarted.wait()
    assert "stays in the local tier" in str(refused.value)
    _pretrained_intact(shared, before)
    assert (tmp_path / "local" / "step-7" / ".metadata").is_file()  # the local copy stays
    assert (tmp_path / "durable" / "step-8" / ".metadata").is_file()  # the others drain
    target = blank_state()
    assert restarted.load(target, 8) == 8 and target["meta"]["step"] == 8


def test_drain_copies_the_bytes_a_linked_root_step_holds_rather_than_reference_it(
    tmp_path: Path,
) -> None:
    # Before: the root's step-1, drained, then moved to a shared place and linked back,
    # held the same bytes as the local base of step 2: the drain recorded step 2's
    # unchanged items as references into the link, so the job's durable step 2 broke
    # once the link's owner deleted their checkpoint.
    frozen = torch.arange(4096, dtype=torch.float32)
    mgr = tiered(tmp_path, incremental=True)
    mgr.save(1, {"frozen": frozen.clone(), **step_state(1)})
    mgr.wait()
    shared = tmp_path / "shared" / "step-1"
    shared.parent.mkdir()
    shutil.move(tmp_path / "durable" / "step-1", shared)
    before = _link(tmp_path / "durable" / "step-1", shared)
    mgr.save(2, {"frozen": frozen.clone(), **step_state(2)})
    with pytest.raises(UnsafeCheckpointError, match="step-1 is a symbolic link"):
        mgr.wait()  # step 1 stays local; step 2 drains
    local = open_committed(LocalFileSystem(), str(tmp_path / "local" / "step-2"))
    assert local.references() == {"step-1"}  # an incremental save in the local tier
    assert (
        open_committed(LocalFileSystem(), str(tmp_path / "durable" / "step-2")).references()
        == set()
    )
    assert snapshot(shared) == before
    shutil.rmtree(shared)  # the owner deletes theirs: the job's durable step 2 still loads
    target = {"frozen": torch.zeros(4096), **blank_state()}
    storage.load(target, str(tmp_path / "durable" / "step-2"))
    assert torch.equal(target["frozen"], frozen) and target["meta"]["step"] == 2


def _quietly(call: Any, *args: Any) -> None:
    try:
        call(*args)
    except OSError:
        pass  # the root is down: the drain fails, the step stays local


# --- a tiered load ---------------------------------------------------------------------------


def test_tiered_load_prefers_the_local_step_over_a_linked_root_step(tmp_path: Path) -> None:
    # Before: the job's own step-3, local only (the root was down), next to a root step-3
    # linked in meanwhile to another run's checkpoint: the save ids differ, so the load
    # took the root's copy and restored the other run's state as the job's step 3.
    (tmp_path / "durable").write_text("down")
    crashed = tiered(tmp_path)
    crashed.save(3, step_state(3))
    _quietly(crashed.wait)
    (tmp_path / "durable").unlink()
    CheckpointManager(tmp_path / "elsewhere").save(3, step_state(30))
    _link(tmp_path / "durable" / "step-3", tmp_path / "elsewhere" / "step-3")
    for step in (3, None):
        target = blank_state()
        mgr = tiered(tmp_path)
        loaded = mgr.load(target, step)
        assert (loaded, loaded.tier, target["meta"]["step"]) == (3, "local", 3)  # type: ignore[attr-defined]
        assert "symbolic link to a checkpoint elsewhere" in loaded.note  # type: ignore[attr-defined]
        with pytest.raises(UnsafeCheckpointError, match="step-3 is a symbolic link"):
            mgr.wait()  # the drain pass the load queued leaves it local, as before
    # The local copy damaged: the load fails rather than take the linked step instead.
    data = next((tmp_path / "local" / "step-3").glob("*.distcp"))
    data.write_bytes(bytes(b ^ 0xFF for b in data.read_bytes()))
    target = blank_state()
    with pytest.raises(IntegrityError):
        tiered(tmp_path).load(target, 3)
    assert target["meta"]["step"] != 30


# --- a restore from the peers ----------------------------------------------------------------


def _restore_worker(rank: int, store: str, base: str) -> None:
    import torch.distributed as dist

    with gloo_group(rank, 2, store):
        node = Path(base, f"node{rank}")
        mgr = CheckpointManager(f"{base}/durable", local=node, replicate=True)
        mgr.save(5, {f"rank{rank}": torch.full((64,), float(rank))})
        mgr.wait()
        dist.barrier()
        if rank == 1:  # node 1's step-5 becomes a link to a copy that lacks rank 1's file
            shared = Path(base, "shared", "step-5")
            shutil.move(node / "step-5", shared)
            for f in shared.glob("__1_*.distcp"):
                f.unlink()
            before = _link(node / "step-5", shared)
        dist.barrier()
        target = {f"rank{rank}": torch.zeros(64)}
        step = CheckpointManager(f"{base}/durable", local=node, replicate=True).load(target, 5)
        assert torch.equal(target[f"rank{rank}"], torch.full((64,), float(rank)))
        assert step.tier == "durable"  # type: ignore[attr-defined]
        if rank == 1:
            assert step.note is not None and "symbolic link" in step.note  # type: ignore[attr-defined]
            assert snapshot(shared) == before


def test_restore_never_fetches_into_a_linked_local_step(tmp_path: Path) -> None:
    # Before: a node whose step-5 was a link to a copy missing a file received that file
    # from its peer through the link, writing into the linked checkpoint.
    spawn(_restore_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)


# --- heals and folder uploads ----------------------------------------------------------------


def test_transport_send_refuses_a_linked_step(tmp_path: Path, shared: Path) -> None:
    # Before: a replica's send at step 3 wrote through root/replica-0/step-3, a link.
    before = _link(tmp_path / "ft" / "replica-0" / "step-3", shared)
    transport = storage.StorageTransport(tmp_path / "ft", rank=0)
    try:
        with pytest.raises(UnsafeCheckpointError, match="step-3 is a symbolic link"):
            transport.send_checkpoint([1], 3, _state(3.0), timedelta(seconds=60))
    finally:
        transport.shutdown()
    _pretrained_intact(shared, before)


def test_transport_receive_refuses_a_linked_step(tmp_path: Path, shared: Path) -> None:
    # Before: a receiver healing from replica 0's step 3 loaded whatever checkpoint a
    # link planted at root/replica-0/step-3 pointed at (here someone else's), which no
    # send writes (a send refuses the link).
    before = _link(tmp_path / "ft" / "replica-0" / "step-3", shared)
    transport = storage.StorageTransport(tmp_path / "ft", rank=1)
    try:
        with pytest.raises(UnsafeCheckpointError, match="step-3 is a symbolic link"):
            transport.recv_checkpoint(0, transport.metadata(), 3, timedelta(seconds=60))
    finally:
        transport.shutdown()
    _pretrained_intact(shared, before)


def test_folder_upload_refuses_a_linked_step(tmp_path: Path, shared: Path) -> None:
    # Before: FolderCheckpoints.save(folder, 0) uploaded into the linked step-0.
    before = _link(tmp_path / "bucket" / "step-0", shared)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "model.bin").write_bytes(b"weights")
    ckpts = FolderCheckpoints(tmp_path / "bucket", blocking=True)
    with pytest.raises(UnsafeCheckpointError, match="step-0 is a symbolic link"):
        ckpts.save(tmp_path / "run", 0)
    _pretrained_intact(shared, before)


# --- paths the user names, and plain files --------------------------------------------------


def test_a_linked_path_the_user_names_is_written(tmp_path: Path, shared: Path) -> None:
    # Explicit destinations are the user's: dcp.save with our writer at a linked
    # directory writes the target (keeping the files it replaced), like storage.save
    # and cp --overwrite (test_links.py).
    link = tmp_path / "mine"
    data = [f for f in shared.iterdir() if f.suffix == ".distcp"]
    _link(link, shared)
    dcp.save(_state(5.0), storage_writer=CheckpointWriter(str(link), overwrite=True))
    out = {"w": torch.zeros(16), "step": -1}
    storage.load(out, str(shared))
    assert out["step"] == 5
    assert all(f.is_file() for f in data)


def test_saving_or_copying_into_a_linked_path_the_user_names_leaves_no_heartbeat(
    tmp_path: Path, shared: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A save or ``cp`` into a checkpoint path the user named that is their own link to
    a directory (scratch space reached through a link) removes its heartbeat marker from
    the directory the link resolves to: removals never go through the link itself,
    which left a ``.heartbeat-*`` behind after every save, with a warning."""
    (tmp_path / "real").mkdir()
    (tmp_path / "copied").mkdir()
    _link(tmp_path / "mine", tmp_path / "real")
    _link(tmp_path / "copy", tmp_path / "copied")
    storage.save(_state(2.0), str(tmp_path / "mine"))
    assert main(["cp", str(shared), str(tmp_path / "copy")]) == 0
    for target in ("real", "copied"):
        assert not [p for p in (tmp_path / target).iterdir() if p.name.startswith(".heartbeat")]
    assert "could not remove" not in caplog.text
    out = {"w": torch.zeros(16), "step": -1}
    storage.load(out, str(tmp_path / "mine"))
    assert out["step"] == 2


@pytest.mark.parametrize("make_fs", _backends())
@pytest.mark.parametrize("local", [False, True])
def test_saving_a_step_whose_path_is_a_file_names_it(
    tmp_path: Path, make_fs: Any, local: bool
) -> None:
    # Before: a bare `FileExistsError: [Errno 17] File exists: '.../step-3'`.
    place = tmp_path / ("local" if local else "durable")
    place.mkdir()
    (place / "step-3").write_bytes(b"notes")
    mgr = tiered(tmp_path, filesystem=make_fs()) if local else CheckpointManager(place)
    with pytest.raises(FileExistsError, match="step-3 is a file, not a checkpoint directory"):
        mgr.save(3, step_state(3))
    assert (place / "step-3").read_bytes() == b"notes"


def test_copying_onto_a_file_names_it(
    tmp_path: Path, shared: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: `cp` onto a plain file failed with a bare FileExistsError.
    (tmp_path / "notes").write_bytes(b"notes")
    assert main(["cp", str(shared), str(tmp_path / "notes")]) == 1
    assert "is a file, not a checkpoint directory" in capsys.readouterr().err
    assert (tmp_path / "notes").read_bytes() == b"notes"


def test_copying_over_a_checkpoint_whose_metadata_is_a_directory_names_it(
    tmp_path: Path, shared: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: `cp --overwrite` onto a directory whose `.metadata` is a directory (planted,
    # or a tool's mistake) failed with `Is a directory: .../.metadata.tmp-<id>`, naming a
    # temporary file of its own that no longer existed, and no fix.
    (tmp_path / "dst" / ".metadata").mkdir(parents=True)
    assert main(["cp", "--overwrite", str(shared), str(tmp_path / "dst")]) == 1
    err = capsys.readouterr().err
    assert f"{str(tmp_path / 'dst' / '.metadata')!r} is a directory, so no file can" in err
    assert ".tmp-" not in err.splitlines()[-1]
    assert (tmp_path / "dst" / ".metadata").is_dir()


@pytest.mark.parametrize("alias", ["link", "file-url", "dot"])
def test_a_local_tier_that_is_the_root_under_another_name_is_refused(
    tmp_path: Path, alias: str
) -> None:
    # Before: `local=` naming the root through a symbolic link (or as file://..., or
    # with a `.` in it) passed the check that the two differ; the manager then took the
    # root's steps for its local copies, durable ones, and keep_local=1 deleted every
    # durable step but the newest from the root.
    root = tmp_path / "run"
    saver = CheckpointManager(root)
    for step in (1, 2, 3):
        saver.save(step, step_state(step))
    local: Any = {
        "link": tmp_path / "alias",
        "file-url": f"file://{root}",
        "dot": f"{tmp_path}/./run",
    }[alias]
    (tmp_path / "alias").symlink_to(root)
    with pytest.raises(ValueError, match="are one directory"):
        CheckpointManager(root, local=local, keep_local=1)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
        "step-1",
        "step-2",
        "step-3",
    ]
