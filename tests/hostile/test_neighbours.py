"""Another user (or job) on the same host who can write the directory a save writes into.

A shared ``/scratch``, a group-writable root of checkpoints or the tiered manager's local
tier let a neighbour put a link, a FIFO or a file of their own at a name a save is about
to write: the next data file of a save is named after its first (``__0_1-<id>.distcp``
follows ``__0_0-<id>.distcp``), a temporary name can be guessed. Every test names, in a
comment, what happened before the fix.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import stat
import subprocess
import sys
import threading
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import torch

import storage
from extensions.errors import UnsafeCheckpointError
from storage import CheckpointManager, LocalFileSystem
from storage.backends import _local_files
from storage.backends.base import FileSystemBase

_VICTIM_TEXT = b"someone else's file\n"


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file the saving user can write but must never touch (their ~/.bashrc)."""
    path = tmp_path / "home" / ".bashrc"
    path.parent.mkdir()
    path.write_bytes(_VICTIM_TEXT)
    return path


class _Neighbour(LocalFileSystem):
    """Local disk, and a neighbour who watches the checkpoint directory: when the first
    data file of a save appears, they put ``plant(path)`` at the name of the next one."""

    plant: Any = None

    @contextlib.contextmanager
    def create_stream(self, path: str, mode: str, *, sync: bool = False) -> Iterator[IO[bytes]]:
        first = re.fullmatch(r"(.*/__0_)0(-[0-9a-f]+\.distcp)", path)
        if mode == "wb" and first and self.plant is not None:
            self.plant(f"{first.group(1)}1{first.group(2)}")
        with super().create_stream(path, mode, sync=sync) as stream:
            yield stream


def _two_files() -> dict[str, Any]:
    return {"a": torch.ones(8), "b": torch.full((8,), 2.0)}


def test_save_never_writes_through_a_link_planted_at_its_next_data_file(
    tmp_path: Path, victim: Path
) -> None:
    # Before: the save opened `__0_1-<id>.distcp` with open(path, "wb"), which followed
    # the neighbour's link and overwrote their chosen target (here the user's ~/.bashrc)
    # with checkpoint bytes.
    fs = _Neighbour()
    fs.plant = lambda name: os.symlink(victim, name)
    ckpt = tmp_path / "ck"
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        storage.save(_two_files(), str(ckpt), filesystem=fs, single_file_per_rank=False)
    assert victim.read_bytes() == _VICTIM_TEXT
    assert not (ckpt / ".metadata").exists()


def test_save_refuses_a_fifo_planted_at_its_next_data_file(tmp_path: Path) -> None:
    # Before: open(path, "wb") on the neighbour's FIFO blocked until someone read it: the
    # save (and the training loop waiting on it) hung for good.
    fs, fifos = _Neighbour(), []

    def plant(name: str) -> None:
        os.mkfifo(name)
        fifos.append(name)

    fs.plant = plant
    errors: list[BaseException] = []

    def save() -> None:
        try:
            storage.save(
                _two_files(), str(tmp_path / "ck"), filesystem=fs, single_file_per_rank=False
            )
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=save, daemon=True)
    worker.start()
    worker.join(120)  # generous: the fixed save fails at once
    hung = worker.is_alive()
    if hung:  # free the old code's blocked open so the thread ends
        with contextlib.suppress(OSError):
            os.close(os.open(fifos[0], os.O_RDONLY | os.O_NONBLOCK))
        worker.join(60)
    assert not hung, "the save blocked on a FIFO at its data file's name"
    assert len(errors) == 1 and isinstance(errors[0], UnsafeCheckpointError), errors
    assert "FIFO" in str(errors[0])


def test_write_refuses_a_link_at_the_name(tmp_path: Path, victim: Path) -> None:
    # Before: create_stream(path, "wb") on a link truncated and wrote its target; the
    # heartbeat of a save is rewritten every 30 s under a name anyone listing the
    # directory sees, so a neighbour could swap it for a link between two beats.
    link = tmp_path / "beat"
    link.symlink_to(victim)
    with (
        pytest.raises(UnsafeCheckpointError, match="refusing to write"),
        LocalFileSystem().create_stream(str(link), "wb") as out,
    ):
        out.write(b"{}")
    assert victim.read_bytes() == _VICTIM_TEXT
    assert link.is_symlink()


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="needs root to own a file as another user",
)
def test_write_refuses_a_file_of_another_users_at_the_name(tmp_path: Path) -> None:
    # Before: the save wrote its bytes into the neighbour's file, which stayed theirs:
    # once committed, they could rewrite our checkpoint's data at will.
    planted = tmp_path / "__0_0-abc.distcp"
    planted.write_bytes(b"")
    planted.chmod(0o666)
    os.chown(planted, 65534, 65534)
    with (
        pytest.raises(UnsafeCheckpointError, match="user id 65534"),
        LocalFileSystem().create_stream(str(planted), "wb") as out,
    ):
        out.write(b"checkpoint bytes")
    assert planted.read_bytes() == b""


def test_a_rewrite_of_our_own_file_still_works(tmp_path: Path) -> None:
    # The heartbeat and a copy over a data file write over a file of ours in place.
    path = tmp_path / "beat"
    fs = LocalFileSystem()
    for body in (b"first, longer", b"second"):
        with fs.create_stream(str(path), "wb") as out:
            out.write(body)
    assert path.read_bytes() == b"second"


# --- every backend that writes local disk ----------------------------------------------


def _local_writers() -> list[Any]:
    """The backends whose writes land on local disk, each as (make, name) where
    ``make(directory)`` gives the backend and its path for ``directory``."""

    def plain(directory: Path) -> tuple[FileSystemBase, str]:
        fs = LocalFileSystem()
        return fs, fs.init_path(str(directory))

    def fsspec_file(directory: Path) -> tuple[FileSystemBase, str]:
        fs = storage.FsspecFileSystem()
        return fs, fs.init_path(f"file://{directory}")

    def torch_local(directory: Path) -> tuple[FileSystemBase, str]:
        from torch.distributed.checkpoint.filesystem import FileSystem

        fs = storage.TorchFileSystem(FileSystem())
        return fs, fs.init_path(str(directory))

    def torch_fsspec_file(directory: Path) -> tuple[FileSystemBase, str]:
        from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

        fs = storage.TorchFileSystem(FileSystem())
        return fs, fs.init_path(f"file://{directory}")

    return [
        pytest.param(plain, id="path"),
        pytest.param(fsspec_file, id="fsspec-file"),
        pytest.param(torch_local, id="torch-local"),
        pytest.param(torch_fsspec_file, id="torch-fsspec-file"),
    ]


_LOCAL_WRITERS = _local_writers()


@pytest.mark.parametrize("make", _LOCAL_WRITERS)
def test_no_local_backend_writes_through_a_link_at_the_name(
    tmp_path: Path, victim: Path, make: Any
) -> None:
    # Before (fsspec on file://, TorchFileSystem over torch's local or file:// one): the
    # write opened the name with open(path, "wb"), which followed a neighbour's link and
    # overwrote its target (here the user's ~/.bashrc) with checkpoint bytes.
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "__0_1-abc.distcp").symlink_to(victim)
    fs, root = make(tmp_path / "ck")
    with (
        pytest.raises(UnsafeCheckpointError, match="symbolic link"),
        fs.create_stream(fs.concat_path(root, "__0_1-abc.distcp"), "wb") as out,
    ):
        out.write(b"checkpoint bytes")
    assert victim.read_bytes() == _VICTIM_TEXT
    assert (tmp_path / "ck" / "__0_1-abc.distcp").is_symlink()


@pytest.mark.parametrize("make", _LOCAL_WRITERS)
def test_no_local_backend_blocks_on_a_fifo_at_the_name(tmp_path: Path, make: Any) -> None:
    # Before (the same backends): open(path, "wb") on a neighbour's FIFO blocked until
    # someone read it, and the save with it, for good.
    fifo = tmp_path / "__0_1-abc.distcp"
    os.mkfifo(fifo)
    fs, root = make(tmp_path)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            with fs.create_stream(fs.concat_path(root, fifo.name), "wb") as out:
                out.write(b"checkpoint bytes")
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=write, daemon=True)
    worker.start()
    worker.join(120)  # generous: the fixed write fails at once
    hung = worker.is_alive()
    if hung:  # free the old code's blocked open so the thread ends
        with contextlib.suppress(OSError):
            reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
            worker.join(60)
            os.close(reader)
    assert not hung, "the write blocked on a FIFO at its name"
    assert len(errors) == 1 and isinstance(errors[0], UnsafeCheckpointError), errors
    assert "FIFO" in str(errors[0])


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="needs root to own a file as another user",
)
@pytest.mark.parametrize("make", _LOCAL_WRITERS)
def test_no_local_backend_writes_into_another_users_file_at_the_name(
    tmp_path: Path, make: Any
) -> None:
    # Before (the same backends): the save wrote into the neighbour's file, which stayed
    # theirs to rewrite once it held our committed checkpoint.
    planted = tmp_path / "__0_1-abc.distcp"
    planted.write_bytes(b"")
    planted.chmod(0o666)
    os.chown(planted, 65534, 65534)
    fs, root = make(tmp_path)
    with (
        pytest.raises(UnsafeCheckpointError, match="user id 65534"),
        fs.create_stream(fs.concat_path(root, planted.name), "wb") as out,
    ):
        out.write(b"checkpoint bytes")
    assert planted.read_bytes() == b""


@pytest.mark.parametrize("exclusive", [False, True], ids=["replace", "exclusive"])
@pytest.mark.parametrize("make", _LOCAL_WRITERS)
def test_no_local_backend_publishes_through_a_link_at_the_name(
    tmp_path: Path, victim: Path, make: Any, exclusive: bool
) -> None:
    # Before (fsspec on file://): write_atomic wrote `.metadata` or the `.dcp-latest`
    # pointer with pipe_file, in place through a neighbour's link at that name: the
    # link's target got the bytes. A link there is now replaced (or, exclusive, refused).
    pointer = tmp_path / ".dcp-latest"
    pointer.symlink_to(victim)
    fs, root = make(tmp_path)
    target = fs.concat_path(root, pointer.name)
    if exclusive:
        with pytest.raises(FileExistsError):
            fs.write_atomic(target, b"step-2\n", exclusive=True)
    else:
        fs.write_atomic(target, b"step-2\n")
        assert not pointer.is_symlink() and pointer.read_bytes() == b"step-2\n"
    assert victim.read_bytes() == _VICTIM_TEXT


@pytest.mark.parametrize("make", _LOCAL_WRITERS)
def test_a_save_through_each_local_backend_still_round_trips(tmp_path: Path, make: Any) -> None:
    # The guarded open is every write of these backends now: a whole save and load.
    fs, root = make(tmp_path / "ck")
    storage.save(_two_files(), root, filesystem=fs)
    state = {"a": torch.zeros(8), "b": torch.zeros(8)}
    storage.load(state, root, filesystem=fs)
    assert torch.equal(state["b"], torch.full((8,), 2.0))


def _guessed_uuid(guess: str) -> types.SimpleNamespace:
    """``uuid`` as the local backend sees it, whose first random name is ``guess``."""
    draws = iter([uuid.UUID(hex=guess.ljust(32, "0"))])
    return types.SimpleNamespace(uuid4=lambda: next(draws, None) or uuid.uuid4())


@pytest.mark.parametrize("exclusive", [False, True], ids=["replace", "exclusive"])
def test_atomic_write_never_goes_through_a_link_at_its_guessed_temporary_name(
    tmp_path: Path, victim: Path, monkeypatch: pytest.MonkeyPatch, exclusive: bool
) -> None:
    # Before: write_atomic (`.metadata`, the `.dcp-latest` pointer) opened
    # `<path>.tmp-<12 hex>` with open(tmp, "wb"): a neighbour who guessed (or raced) the
    # name had the pointer written into the link's target, then the link itself renamed
    # to `.dcp-latest` (or hard-linked to `.metadata`).
    guess = "0123456789ab"
    pointer = tmp_path / ".dcp-latest"
    (tmp_path / f".dcp-latest.tmp-{guess}").symlink_to(victim)
    monkeypatch.setattr(_local_files, "uuid", _guessed_uuid(guess))
    LocalFileSystem().write_atomic(str(pointer), b"step-2\n", exclusive=exclusive)
    assert victim.read_bytes() == _VICTIM_TEXT
    assert not pointer.is_symlink() and pointer.read_bytes() == b"step-2\n"
    assert (tmp_path / f".dcp-latest.tmp-{guess}").is_symlink()  # the neighbour's, kept


def test_saved_files_follow_the_umask(tmp_path: Path) -> None:
    # A private umask keeps every file and directory of a root private: the data files,
    # the metadata, the latest-step pointer (nothing is created world-writable either).
    old = os.umask(0o077)
    try:
        CheckpointManager(tmp_path / "root", key_prefixes=2).save(1, _two_files())
    finally:
        os.umask(old)
    paths = [tmp_path / "root", *(tmp_path / "root").rglob("*")]
    assert len(paths) > 4
    for path in paths:
        assert stat.S_IMODE(path.lstat().st_mode) & 0o077 == 0, path


# --- a process killed in the middle of a save -------------------------------------------

_KILLED_SAVE = """
import os, sys, torch, storage
real = os.replace
def replace(src, dst, *args, **kwargs):
    if os.path.basename(dst) == sys.argv[2]:  # a path, or a name inside a directory handle
        os._exit(9)  # kill -9 right before the rename that publishes it
    return real(src, dst, *args, **kwargs)
os.replace = replace
storage.save({"w": torch.full((8,), 2.0)}, sys.argv[1], overwrite=True)
"""


def _kill_save(path: Path, at: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_SAVE, str(path), at], timeout=300, check=False
    )
    assert done.returncode == 9, "the save was not killed where the test meant"


def _value(root: Path, step: int) -> float:
    state = {"w": torch.zeros(8)}
    CheckpointManager(root).load(state, step)
    return float(state["w"][0])


def test_a_save_killed_before_its_metadata_lands_keeps_the_old_checkpoint_and_gc_sweeps_it(
    tmp_path: Path,
) -> None:
    # Before: the killed save's `.metadata.tmp-<id>` (a whole metadata file) stayed
    # beside the committed one for good: gc removed only unnamed data files there.
    root = tmp_path / "root"
    CheckpointManager(root).save(1, {"w": torch.full((8,), 1.0)})
    kept = sorted(p.name for p in (root / "step-1").iterdir())
    _kill_save(root / "step-1", ".metadata")
    assert _value(root, 1) == 1.0  # the old checkpoint, whole
    assert any(".metadata.tmp-" in p.name for p in (root / "step-1").iterdir())
    CheckpointManager(root).cleanup(0)
    assert sorted(p.name for p in (root / "step-1").iterdir()) == kept


def test_a_pointer_half_written_by_a_killed_save_is_swept_by_gc(tmp_path: Path) -> None:
    # Before: the `.dcp-latest.tmp-<id>` of a process killed while it updated the pointer
    # stayed in the root for good.
    root = tmp_path / "root"
    CheckpointManager(root).save(1, {"w": torch.full((8,), 1.0)})
    _kill_save(root / "step-2", ".dcp-latest")
    assert _value(root, 2) == 2.0  # committed before the pointer
    assert any(p.name.startswith(".dcp-latest.tmp-") for p in root.iterdir())
    CheckpointManager(root).cleanup(0)
    assert sorted(p.name for p in root.iterdir()) == [".dcp-latest", "step-1", "step-2"]


# --- the tiered manager's local tier ----------------------------------------------------


def _plant_step(tier: Path, step: int) -> None:
    """The neighbour's own committed checkpoint, named like a step of ours."""
    storage.save({"w": torch.full((8,), -666.0)}, str(tier / f"step-{step}"))


def test_a_step_planted_in_a_world_writable_local_tier_is_never_loaded_or_drained(
    tmp_path: Path,
) -> None:
    # Before: a manager whose local tier anyone could write (a `chmod 777` scratch
    # directory on the node) listed the neighbour's step-999 as its newest step, loaded
    # it on restart and drained it to the durable root as its own.
    tier, root = tmp_path / "scratch" / "tier", tmp_path / "root"
    tier.mkdir(parents=True)
    tier.chmod(0o777)
    _plant_step(tier, 999)
    with pytest.raises(UnsafeCheckpointError, match="writable by every user"):
        CheckpointManager(root, local=tier)
    assert not (root / "step-999").exists()


def test_a_local_tier_under_a_directory_anyone_can_rename_in_is_refused(tmp_path: Path) -> None:
    # Before: a private tier under a world-writable directory without the sticky bit was
    # used, though anyone could move it away and put a tier of theirs in its place.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafeCheckpointError, match="no sticky"):
        CheckpointManager(tmp_path / "root", local=shared / "tier")


def test_a_private_local_tier_under_a_sticky_shared_directory_is_used(tmp_path: Path) -> None:
    # /dev/shm and /tmp are world-writable with the sticky bit: a tier of one's own there
    # is private (nobody else may rename or remove it), so it works as before.
    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    manager = CheckpointManager(tmp_path / "root", local=shm / "tier")
    manager.save(1, {"w": torch.ones(8)})
    manager.wait()
    assert (tmp_path / "root" / "step-1" / ".metadata").is_file()


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="needs root to own a file as another user",
)
def test_a_local_tier_of_another_users_is_refused(tmp_path: Path) -> None:
    # Before: a tier directory someone else made (and may rewrite at will) was used.
    tier = tmp_path / "tier"
    tier.mkdir()
    os.chown(tier, 65534, 65534)
    with pytest.raises(UnsafeCheckpointError, match="user id 65534"):
        CheckpointManager(tmp_path / "root", local=tier)


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="needs root to own a link as another user",
)
@pytest.mark.parametrize("where", ["tier", "above"])
def test_a_local_tier_reached_through_another_users_link_is_refused(
    tmp_path: Path, where: str
) -> None:
    # Before: the neighbour's link /dev/shm/tier, made before ours in the sticky shared
    # directory, pointed at a private directory of ours (or their /dev/shm/jobs, above
    # the tier, at a sticky directory of theirs), and the checks looked only at where the
    # link led. The link stays theirs: once the manager was running they pointed it at a
    # tier of their own, and it listed their step-999 as its newest, loaded it and
    # drained it to the root as its own.
    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    theirs = shm / "theirs"  # a sticky directory of theirs, where we may make a tier
    theirs.mkdir()
    theirs.chmod(0o1777)
    os.chown(theirs, 65534, 65534)
    ours = tmp_path / "ours"  # a private directory of ours
    ours.mkdir()
    link = shm / ("tier" if where == "tier" else "jobs")
    link.symlink_to(ours if where == "tier" else theirs)
    os.lchown(link, 65534, 65534)
    tier = link if where == "tier" else link / "tier"
    with pytest.raises(UnsafeCheckpointError, match=r"symbolic link of user id 65534"):
        CheckpointManager(tmp_path / "root", local=tier)
    os.lchown(link, os.geteuid(), os.getegid())  # a link of one's own is fine
    CheckpointManager(tmp_path / "root", local=tier).save(1, {"w": torch.ones(8)})
    fixed = tmp_path / "fixed"  # and so is another user's where they cannot replace it
    fixed.mkdir()
    (fixed / "tier").symlink_to(tier)
    os.lchown(fixed / "tier", 65534, 65534)
    CheckpointManager(tmp_path / "root", local=fixed / "tier").save(2, {"w": torch.ones(8)})


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="needs root to own a link as another user",
)
@pytest.mark.parametrize("failure", ["permission", "not-a-directory"])
def test_a_tier_through_another_users_link_that_cannot_be_made_is_refused_as_such(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    # Before: the neighbour's link led where the tier directory could not be made (a
    # directory of theirs we may not write, or a file), and the manager failed with the
    # bare error of that mkdir, never saying that the path goes through their link.
    from storage.ops import local_save

    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    (tmp_path / "file").write_text("theirs")
    link = shm / "jobs"
    link.symlink_to(tmp_path / "file")
    os.lchown(link, 65534, 65534)
    if failure == "permission":  # root may write anywhere: the mkdir is refused here

        def refused(fs: Any, path: str) -> None:
            raise PermissionError(errno.EACCES, "Permission denied", path)

        monkeypatch.setattr(local_save, "make_directory", refused)
    with pytest.raises(UnsafeCheckpointError) as caught:
        CheckpointManager(tmp_path / "root", local=link / "tier")
    message = str(caught.value)
    assert f"{str(link)!r}, a symbolic link of user id 65534" in message
    assert "Make it yours and private" in message


def test_a_local_tier_is_made_before_anyone_can_take_its_name(tmp_path: Path) -> None:
    # Before: a tier that did not exist yet was checked, then left for the first save
    # to make, minutes later; meanwhile a neighbour could put their link at its name
    # in the sticky shared directory (/dev/shm/run -> a tier of theirs), which that save
    # followed, and the manager then loaded and drained their steps as its own.
    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    CheckpointManager(tmp_path / "root", local=shm / "run" / "tier")
    made = shm / "run" / "tier"
    assert made.is_dir() and not made.is_symlink() and not (shm / "run").is_symlink()
    assert made.stat().st_uid == os.geteuid()
    (tmp_path / "file").write_text("not a tier")
    with pytest.raises(FileExistsError, match="file, not a checkpoint directory; nothing was"):
        CheckpointManager(tmp_path / "root", local=tmp_path / "file")


def test_a_local_tier_draining_to_another_root_is_refused(tmp_path: Path) -> None:
    # Before: two jobs of one user given the same local tier (a copied config's
    # /dev/shm/run) drained each other's steps: job B's step 7 landed in job A's root,
    # which then resumed from it, a model it never trained, and A's step 2 in B's root.
    shm = tmp_path / "shm"
    a = CheckpointManager(tmp_path / "rootA", local=shm, keep_local=1)
    a.save(1, {"w": torch.full((8,), 1.0)})
    a.wait()
    with pytest.raises(ValueError, match=r"drains to another root, .*rootA.*a local directory of"):
        CheckpointManager(tmp_path / "rootB", local=shm, keep_local=1)
    assert not (tmp_path / "rootB").exists()
    a.save(2, {"w": torch.full((8,), 2.0)})  # A goes on
    a.wait()
    again = CheckpointManager(tmp_path / "rootA", local=shm)  # A restarted: its own tier
    assert again.steps() == [1, 2]


def test_a_world_writable_root_is_used_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: a manager on a root anyone could write said nothing, though a neighbour's
    # step-999 there is what load() takes as the newest step. Warned, not refused: a
    # team's root may be a shared disk whose mode bits say little (a FUSE mount).
    root = tmp_path / "root"
    root.mkdir()
    root.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="storage.ops.manager"):
        CheckpointManager(root)
    assert "writable by every user (mode 0777)" in caplog.text
    assert str(root) in caplog.text


def _read_each_way(fs: FileSystemBase, path: str) -> list[tuple[str, BaseException | None]]:
    """Every read a load makes of a data or metadata file, each tried on its own."""

    def stream() -> None:
        with fs.create_stream(path, "rb") as src:
            src.read()

    def window() -> None:
        with fs.open_slice(path, 0, 4) as src:
            src.read()

    outcomes: list[tuple[str, BaseException | None]] = []
    for name, read in (
        ("stream", stream),
        ("slice", window),
        ("bytes", lambda: fs.read_bytes(path)),
    ):
        try:
            read()
        except BaseException as exc:  # noqa: BLE001 - the outcome is what is asserted
            outcomes.append((name, exc))
        else:
            outcomes.append((name, None))
    return outcomes


@pytest.mark.parametrize("make", _LOCAL_WRITERS)
def test_no_local_backend_reads_through_a_link_at_a_checkpoints_name(
    tmp_path: Path, victim: Path, make: Any
) -> None:
    # Before (fsspec on file://, TorchFileSystem over torch's local or file:// one): a
    # load opened the name with open(path, "rb"), which followed a neighbour's link and
    # read whatever file of the user's it pointed at, where the plain-path backend refused.
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "__0_0-abc.distcp").symlink_to(victim)
    fs, root = make(tmp_path / "ck")
    for way, error in _read_each_way(fs, fs.concat_path(root, "__0_0-abc.distcp")):
        assert isinstance(error, UnsafeCheckpointError), (way, error)
        assert "symbolic link" in str(error), way


@pytest.mark.parametrize("make", _LOCAL_WRITERS)
def test_no_local_backend_blocks_reading_a_fifo_at_a_checkpoints_name(
    tmp_path: Path, make: Any
) -> None:
    # Before (the same backends): open(path, "rb") of a neighbour's FIFO blocked until
    # someone wrote to it, and the load with it, for good.
    fifo = tmp_path / "__0_0-abc.distcp"
    os.mkfifo(fifo)
    fs, root = make(tmp_path)
    outcomes: list[tuple[str, BaseException | None]] = []
    reader = threading.Thread(
        target=lambda: outcomes.extend(_read_each_way(fs, fs.concat_path(root, fifo.name))),
        daemon=True,
    )
    reader.start()
    reader.join(120)  # generous: the fixed reads fail at once
    hung = reader.is_alive()
    while reader.is_alive():  # free the old code's blocked opens so the thread ends
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(1)
    assert not hung, "a read blocked on a FIFO at a checkpoint's name"
    for way, error in outcomes:
        assert isinstance(error, UnsafeCheckpointError), (way, error)
        assert "FIFO" in str(error), way


@pytest.mark.parametrize("make", _LOCAL_WRITERS)
def test_no_local_backend_renames_into_a_directory_planted_at_the_new_name(
    tmp_path: Path, make: Any
) -> None:
    # Before (fsspec on file://, TorchFileSystem over torch's fsspec file:// one): the
    # rename was fsspec's mv, which moved the file into a directory a neighbour made at
    # the new name and reported success: the file sat in the neighbour's directory, and
    # nothing was at the name the caller published.
    fs, root = make(tmp_path)
    src, dst = fs.concat_path(root, "part.tmp"), fs.concat_path(root, "part")
    (tmp_path / "part.tmp").write_bytes(b"ours")
    (tmp_path / "part").mkdir()
    with pytest.raises(OSError):
        fs.rename(src, dst)
    assert (tmp_path / "part.tmp").read_bytes() == b"ours"
    assert list((tmp_path / "part").iterdir()) == []
