"""Writing through a directory swapped for a link after the save made it.

Whoever can write a shared root (a group-writable ``/scratch/ckpts`` without the sticky
bit) can rename a step directory a save just made and put a link to a directory of their
choosing in its place (or, where they can write the step, do so with a key-prefix
directory), between the save's ``mkdir`` and its opens. The swaps below happen at fixed
points inside the save (a hook), so no test depends on a timing window. Every test
names, in a comment, what happened before the fix it guards.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import storage
from extensions.errors import UnsafeCheckpointError
from storage import FsspecFileSystem
from tests.support.local_disk import snapshot

_SWAPPED = "symbolic link where the checkpoint has a directory"


def _state(value: float = 1.0) -> dict[str, Any]:
    return {"w": torch.full((4,), value), "b": torch.arange(3.0) + value, "step": int(value)}


def _assert_loads(path: Path | str, value: float, **options: Any) -> None:
    out = {"w": torch.zeros(4), "b": torch.zeros(3), "step": 0}
    storage.load(out, str(path), **options)
    assert torch.equal(out["w"], torch.full((4,), value)) and out["step"] == int(value)


def _local_savers() -> list[Any]:
    """The backends that save to local disk, each as ``make(directory) -> (location,
    options)`` for ``storage.save``."""

    def plain(directory: Path) -> tuple[str, dict[str, Any]]:
        return str(directory), {}

    def fsspec_file(directory: Path) -> tuple[str, dict[str, Any]]:
        return f"file://{directory}", {"filesystem": FsspecFileSystem()}

    def torch_local(directory: Path) -> tuple[str, dict[str, Any]]:
        from torch.distributed.checkpoint.filesystem import FileSystem

        return str(directory), {"filesystem": storage.TorchFileSystem(FileSystem())}

    def torch_fsspec_file(directory: Path) -> tuple[str, dict[str, Any]]:
        from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

        return f"file://{directory}", {"filesystem": storage.TorchFileSystem(FileSystem())}

    return [
        pytest.param(plain, id="path"),
        pytest.param(fsspec_file, id="fsspec-file"),
        pytest.param(torch_local, id="torch-local"),
        pytest.param(torch_fsspec_file, id="torch-fsspec-file"),
    ]


@pytest.fixture
def victim(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A directory outside the root holding a committed checkpoint of the user's own,
    prefix directory ``00`` included (what a save would truncate or replace there: its
    ``.metadata``), with its contents as they must stay."""
    victim = tmp_path / "victim"
    storage.save(_state(9.0), str(victim), key_prefixes=2)
    before = snapshot(victim)
    assert ".metadata" in before and any(n.startswith("00/") for n in before)
    return victim, before


def _swap(place: Path, target: Path) -> None:
    place.rename(place.with_name(place.name + ".moved"))
    place.symlink_to(target, target_is_directory=True)


@pytest.mark.parametrize("make", _local_savers())
def test_a_step_swapped_for_a_link_after_its_mkdir_is_never_written_through(
    tmp_path: Path,
    victim: tuple[Path, dict[str, bytes]],
    monkeypatch: pytest.MonkeyPatch,
    make: Any,
) -> None:
    # Before the fix: the save made root/step-7, then opened its heartbeat, data files
    # and metadata temporary by path; with the step swapped for a link in between, all
    # of them landed in the victim's directory and the rename replaced its .metadata.
    from storage.checkpoint import writer

    target, before = victim
    step = tmp_path / "root" / "step-7"
    made = writer.make_directory

    def make_then_swap(fs: Any, path: str) -> None:
        made(fs, path)
        _swap(step, target)

    monkeypatch.setattr(writer, "make_directory", make_then_swap)
    location, options = make(step)
    with pytest.raises(UnsafeCheckpointError, match=_SWAPPED) as caught:
        storage.save(_state(1.0), location, **options)
    assert str(step) in str(caught.value) and "writable by you only" in str(caught.value)
    assert snapshot(target) == before
    assert ".metadata" not in snapshot(step.with_name("step-7.moved"))
    _assert_loads(target, 9.0)


@pytest.mark.parametrize("make", _local_savers())
def test_a_step_swapped_for_a_link_before_its_metadata_is_never_published_through_it(
    tmp_path: Path,
    victim: tuple[Path, dict[str, bytes]],
    monkeypatch: pytest.MonkeyPatch,
    make: Any,
) -> None:
    # Before the fix: with every data file written and checked, the step swapped for a
    # link just before the publish, the metadata's temporary was written in the victim's
    # directory and renamed over its .metadata: its own checkpoint no longer loaded.
    from storage.checkpoint import commit

    target, before = victim
    step = tmp_path / "root" / "step-7"
    checked = commit.absent

    def check_then_swap(fs: Any, path: str, names: set[str]) -> list[str]:
        missing = checked(fs, path, names)
        _swap(step, target)
        return missing

    monkeypatch.setattr(commit, "absent", check_then_swap)
    location, options = make(step)
    with pytest.raises(UnsafeCheckpointError, match=_SWAPPED):
        storage.save(_state(1.0), location, **options)
    assert snapshot(target) == before
    moved = snapshot(step.with_name("step-7.moved"))
    assert ".metadata" not in moved and any(n.endswith(".distcp") for n in moved)
    _assert_loads(target, 9.0)


@pytest.mark.parametrize("make", _local_savers())
def test_a_key_prefix_planted_as_a_link_after_its_check_is_never_written_through(
    tmp_path: Path,
    victim: tuple[Path, dict[str, bytes]],
    monkeypatch: pytest.MonkeyPatch,
    make: Any,
) -> None:
    # Before the fix: the prefix directory 00 was checked not to be a link, then the data
    # file opened by path under it; a link planted in between sent the file into the
    # victim's 00.
    from storage.checkpoint import data_files

    target, before = victim
    step = tmp_path / "root" / "step-7"
    refused = data_files.refuse_linked_prefix

    def check_then_plant(fs: Any, path: str, name: str) -> None:
        refused(fs, path, name)
        if not (step / "00").is_symlink():
            (step / "00").symlink_to(target / "00", target_is_directory=True)

    monkeypatch.setattr(data_files, "refuse_linked_prefix", check_then_plant)
    location, options = make(step)
    with pytest.raises(UnsafeCheckpointError, match=_SWAPPED):
        storage.save(_state(1.0), location, key_prefixes=2, **options)
    assert snapshot(target) == before


@pytest.mark.parametrize("make", _local_savers())
@pytest.mark.parametrize("key_prefixes", [0, 2])
def test_a_link_the_user_named_as_the_checkpoint_is_still_written_through(
    tmp_path: Path, make: Any, key_prefixes: int
) -> None:
    """A checkpoint path that is itself the user's link (``ckpt -> /big/disk/ckpt``) is
    followed once, as the save begins: the save, its overwrite and its load work as they
    did, every file in the directory it points at."""
    real = tmp_path / "big" / "ckpt"
    real.mkdir(parents=True)
    link = tmp_path / "ckpt"
    link.symlink_to(real, target_is_directory=True)
    location, options = make(link)
    storage.save(_state(1.0), location, key_prefixes=key_prefixes, **options)
    storage.save(_state(2.0), location, key_prefixes=key_prefixes, **options)
    _assert_loads(link, 2.0)
    assert link.is_symlink() and ".metadata" in snapshot(real)
    assert not any(name.startswith(".heartbeat-") for name in snapshot(real))


def test_an_async_save_through_the_users_link_writes_where_it_points(tmp_path: Path) -> None:
    """The persist worker writes in the directory the training process resolved."""
    real = tmp_path / "big" / "ckpt"
    real.mkdir(parents=True)
    link = tmp_path / "ckpt"
    link.symlink_to(real, target_is_directory=True)
    storage.async_save(_state(3.0), str(link)).result()
    _assert_loads(real, 3.0)


def test_a_step_pointer_lands_beside_steps_under_a_linked_root(tmp_path: Path) -> None:
    """The latest-step pointer is written in the root as the user named it, a link
    there followed (the root is the place the user chose)."""
    real = tmp_path / "big"
    real.mkdir()
    root = tmp_path / "root"
    root.symlink_to(real, target_is_directory=True)
    storage.CheckpointManager(root).save(3, _state(3.0))
    assert (real / ".dcp-latest").read_bytes() == b"step-3\n"


def test_writes_go_by_path_where_the_platform_cannot_walk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``dir_fd`` support for ``mkdir`` and ``link`` a save still works, its
    directories followed by path as before (the file itself still never a link)."""
    from storage.backends import _local_walk

    monkeypatch.setattr(_local_walk, "WRITES_SAFELY", False)
    storage.save(_state(4.0), str(tmp_path / "ckpt"), key_prefixes=2)
    _assert_loads(tmp_path / "ckpt", 4.0)
    shutil.rmtree(tmp_path / "ckpt")


_ROOT_ONLY = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="needs root to own a link as another user",
)


def _neighbours_link(tmp_path: Path, target: Path) -> Path:
    """``shared/ckpt``, a link to ``target`` that user 65534 put in a sticky directory
    every user can write (a shared ``/scratch``), which is not theirs."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    link = shared / "ckpt"
    link.symlink_to(target, target_is_directory=True)
    os.lchown(link, 65534, 65534)
    return link


@_ROOT_ONLY
@pytest.mark.parametrize("make", _local_savers())
def test_a_neighbours_link_at_the_checkpoint_path_is_never_followed(
    tmp_path: Path, victim: tuple[Path, dict[str, bytes]], make: Any
) -> None:
    # Before the fix: a rank resolved the checkpoint path as its save began and followed
    # any link there, so one that began after a neighbour swapped in their link (on many
    # ranks: after another rank made the directory) wrote its data files and metadata
    # into the link's target, replacing the victim's .metadata.
    target, before = victim
    link = _neighbours_link(tmp_path, target)
    location, options = make(link)
    with pytest.raises(UnsafeCheckpointError, match="user id 65534") as caught:
        storage.save(_state(1.0), location, **options)
    assert str(link) in str(caught.value) and "ln -sfn" in str(caught.value)
    with pytest.raises(UnsafeCheckpointError, match="user id 65534"):
        storage.save_safetensors({"w": torch.ones(2)}, location)  # its own backend choice
    assert snapshot(target) == before
    _assert_loads(target, 9.0)


@_ROOT_ONLY
@pytest.mark.parametrize("make", _local_savers())
def test_a_neighbours_link_at_the_checkpoint_path_is_never_read(
    tmp_path: Path,
    victim: tuple[Path, dict[str, bytes]],
    make: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Before: a load followed any link at the checkpoint path, so a neighbour who put
    # theirs at a name a job loads from in a shared sticky directory (before the job
    # first saved there, or at a step it had not made yet) had the job load their
    # weights: DCP loads, verify, copies and safetensors loads read what they put there.
    from storage.cli import main

    planted, _ = victim  # a committed checkpoint that is theirs
    link = _neighbours_link(tmp_path, planted)
    location, options = make(link)
    out = {"w": torch.zeros(4), "b": torch.zeros(3), "step": 0}
    with pytest.raises(UnsafeCheckpointError, match="user id 65534"):
        storage.load(out, location, **options)
    assert torch.equal(out["w"], torch.zeros(4))  # nothing read into the target
    assert main(["verify", str(link)]) != 0
    assert "user id 65534" in capsys.readouterr().err
    storage.save_safetensors({"w": torch.ones(2)}, str(tmp_path / "model"))
    served = tmp_path / "shared" / "model"
    served.symlink_to(tmp_path / "model", target_is_directory=True)
    os.lchown(served, 65534, 65534)
    with pytest.raises(UnsafeCheckpointError, match="user id 65534"):
        storage.load_safetensors({"w": torch.zeros(2)}, str(served))
    _assert_loads(planted, 9.0)  # their own path, named as theirs, still loads


@_ROOT_ONLY
def test_a_link_at_the_checkpoint_path_is_followed_only_where_it_is_trusted(
    tmp_path: Path,
) -> None:
    # Before the fix: resolve_link did not exist and every link at the checkpoint path
    # was followed, whoever owned it. Now it is followed as the kernel's
    # protected_symlinks follows one: the process's own (root's here), the owner's of
    # the directory holding it, or anyone's in a directory only its owner can write;
    # anyone else's is refused, in a chain too.
    from torch.distributed.checkpoint.filesystem import FileSystem

    real = tmp_path / "real"
    real.mkdir()
    theirs = tmp_path / "theirs"  # a directory of user 65534's, where their link is fine
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    (theirs / "ckpt").symlink_to(real, target_is_directory=True)
    os.lchown(theirs / "ckpt", 65534, 65534)
    private = tmp_path / "private"  # root's, writable by root only: nobody else put it
    private.mkdir(mode=0o755)
    (private / "ckpt").symlink_to(real, target_is_directory=True)
    os.lchown(private / "ckpt", 65534, 65534)
    neighbours = _neighbours_link(tmp_path, real)
    ours = tmp_path / "ours"
    ours.symlink_to(neighbours, target_is_directory=True)  # ours, leading to theirs
    for fs in (
        storage.LocalFileSystem(),
        FsspecFileSystem(protocol="file"),
        storage.TorchFileSystem(FileSystem()),
    ):
        assert fs.resolve_link(str(real)) == str(real)
        assert fs.resolve_link(str(tmp_path / "missing")) == str(tmp_path / "missing")
        assert fs.resolve_link(str(theirs / "ckpt")) == str(real)
        assert fs.resolve_link(str(private / "ckpt")) == str(real)
        with pytest.raises(UnsafeCheckpointError, match=r"symbolic link of user id 65534's"):
            fs.resolve_link(str(neighbours))
        with pytest.raises(UnsafeCheckpointError, match="leads through"):
            fs.resolve_link(str(ours))
    assert storage.MemoryFileSystem().resolve_link("bucket/ckpt") == "bucket/ckpt"


def test_a_link_replaced_while_it_is_read_is_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without the check: the link's owner was read, then the link replaced (by whoever
    # can write its directory) before its target was read, and the save followed the
    # new link's target under the old link's owner.
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "ckpt"
    link.symlink_to(real, target_is_directory=True)
    read = os.readlink

    def replace_then_read(path: Any, *, dir_fd: int | None = None) -> str:
        (tmp_path / "other").symlink_to(tmp_path, target_is_directory=True)
        os.replace(tmp_path / "other", link)
        return read(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "readlink", replace_then_read)
    with pytest.raises(UnsafeCheckpointError, match="was replaced while it was read"):
        storage.LocalFileSystem().resolve_link(str(link))


def test_a_tier_swapped_for_a_link_never_gets_its_root_file_through_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before the fix: the tier's .dcp-tier-root was written by path; the tier directory
    # swapped for a link after the manager resolved it (by whoever can write its
    # parent), the file landed in the link's target, claiming a directory of their
    # choosing as this manager's tier.
    from storage.checkpoint import heartbeat

    tier, victim = tmp_path / "tier", tmp_path / "victim"
    tier.mkdir()
    victim.mkdir()
    resolve = heartbeat.resolved

    def resolve_then_swap(fs: Any, path: str) -> str:
        home = resolve(fs, path)
        if path == str(tier) and not tier.is_symlink():
            _swap(tier, victim)
        return home

    monkeypatch.setattr(heartbeat, "resolved", resolve_then_swap)
    with pytest.raises(UnsafeCheckpointError, match=_SWAPPED):
        storage.CheckpointManager(tmp_path / "root", local=tier)
    assert list(victim.iterdir()) == []


def test_a_root_swapped_for_a_link_keeps_the_pointer_it_leads_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Before the fix: the deletion of step-3 read the root's latest-step pointer, then
    # removed it by path; the root swapped for a link in between (by whoever can write
    # its parent), it removed the pointer in the link's target, another root's.
    from storage.checkpoint import latest

    root, victim = tmp_path / "root", tmp_path / "victim"
    root.mkdir()
    victim.mkdir()
    for place in (root, victim):
        (place / latest.NAME).write_bytes(b"step-3\n")
    read = latest._versioned

    def read_then_swap(fs: Any, parent: str) -> tuple[str | None, str | None]:
        held = read(fs, parent)
        _swap(root, victim)
        return held

    monkeypatch.setattr(latest, "_versioned", read_then_swap)
    latest.withdraw(storage.LocalFileSystem(), str(root / "step-3"))
    assert (victim / latest.NAME).read_bytes() == b"step-3\n"
    assert _SWAPPED in caplog.text
