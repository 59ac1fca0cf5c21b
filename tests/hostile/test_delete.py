"""Deleting what is not ours: hostile metadata, linked steps, races and lost responses.

Every test names, in a comment, what happened before the fix it guards.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import storage
from extensions.errors import CheckpointNotFoundError, UnsafeCheckpointError
from storage import CheckpointManager, FsspecFileSystem, GCSFileSystem, LocalFileSystem
from storage.checkpoint import storage_format as fmt
from storage.cli import main
from tests.support.distributed import gloo_group, spawn
from tests.support.local_disk import snapshot
from tests.support.subprocess_jobs import kill_when_marked


def _state(value: float = 1.0) -> dict[str, Any]:
    return {"w": torch.full((4,), value), "b": torch.arange(3.0) + value, "step": int(value)}


def _assert_loads(path: Path | str, value: float) -> None:
    out = {"w": torch.zeros(4), "b": torch.zeros(3), "step": 0}
    storage.load(out, str(path))
    assert torch.equal(out["w"], torch.full((4,), value)) and out["step"] == int(value)


def _point_metadata_at(ckpt: Path, names: list[str]) -> None:
    """Hand-edit ``.metadata`` so that its items name ``names`` as their data files."""
    meta = fmt.load_metadata((ckpt / ".metadata").read_bytes(), str(ckpt))
    infos = list(meta.storage_data.values())
    for info, name in zip(infos, names, strict=False):
        info.relative_path = name
    (ckpt / ".metadata").write_bytes(fmt.dump_metadata(meta))


# --- 1. only files named like our data files are ever deleted --------------------------

# Names a hostile or hand-edited .metadata may list as relative_path. None of them is a
# data file name (``__{rank}_{n}[-{save_id}].distcp``), so none may be deleted.
_FOREIGN = ["train.py", "notes.distcp", "__0_0.distcp.bak"]


def _overwrite_save(ckpt: Path) -> None:
    storage.save(_state(2.0), str(ckpt))


def _overwrite_manager(ckpt: Path) -> None:
    CheckpointManager(ckpt.parent).save(int(ckpt.name.removeprefix("step-")), _state(2.0))


def _overwrite_cp(ckpt: Path) -> None:
    source = ckpt.parent / "fresh"
    storage.save(_state(2.0), str(source))
    assert main(["cp", str(source), str(ckpt), "--overwrite"]) == 0


@pytest.mark.parametrize(
    "overwrite",
    [_overwrite_save, _overwrite_manager, _overwrite_cp],
    ids=["storage.save", "manager.save", "cp--overwrite"],
)
def test_overwrite_deletes_only_data_files(tmp_path: Path, overwrite: Callable[..., None]) -> None:
    # Without the fix, replacing the checkpoint removed every file the old metadata
    # named: train.py beside the data files was deleted by storage.save,
    # CheckpointManager.save and `dcp-storage cp --overwrite` alike.
    ckpt = tmp_path / "step-1"
    storage.save(_state(1.0), str(ckpt))
    for name in _FOREIGN:
        (ckpt / name).write_text("precious")
    _point_metadata_at(ckpt, _FOREIGN)
    overwrite(ckpt)
    for name in _FOREIGN:
        assert (ckpt / name).read_text() == "precious", name
    _assert_loads(ckpt, 2.0)


def test_rm_and_retention_delete_only_data_files(tmp_path: Path) -> None:
    # Without the fix, `rm`, retention and gc removed every *.distcp in a step
    # directory (notes.distcp is a user's file that merely ends like a data file).
    root = tmp_path / "root"
    mgr = CheckpointManager(root, keep_last=1)
    mgr.save(1, _state(1.0))
    (root / "step-1" / "notes.distcp").write_text("precious")
    mgr.save(2, _state(2.0))  # retention removes step-1
    assert (root / "step-1" / "notes.distcp").read_text() == "precious"
    assert mgr.steps() == [2]
    (root / "step-2" / "notes.distcp").write_text("precious")
    assert main(["rm", str(root / "step-2")]) == 0
    assert (root / "step-2" / "notes.distcp").read_text() == "precious"
    assert main(["gc", str(root), "--keep-last", "1", "--grace", "0"]) == 0
    assert (root / "step-2" / "notes.distcp").read_text() == "precious"


@pytest.mark.parametrize("where", ["step-1/0a", "."])
def test_gc_keeps_the_files_of_a_checkpoint_nested_in_a_prefix_named_folder(
    tmp_path: Path, where: str
) -> None:
    # Without the fix, gc took a checkpoint copied into a folder whose name is a key
    # prefix (`cp run/step-1 run/step-1/0a`, or a checkpoint ROOT holding `2024/`) for
    # a key prefix directory of the checkpoint around it, and removed its data files
    # as orphans: the nested checkpoint no longer loaded.
    root = tmp_path / "run"
    mgr = CheckpointManager(root)
    mgr.save(1, _state(1.0))
    outer = root / where
    if where == ".":
        assert main(["cp", str(root / "step-1"), str(root)]) == 0
    nested = outer / ("2024" if where == "." else "")
    assert main(["cp", str(root / "step-1"), str(nested)]) == 0
    assert main(["gc", str(root), "--keep-last", "5", "--grace", "0"]) == 0
    _assert_loads(nested, 1.0)
    _assert_loads(root / "step-1", 1.0)


# --- 2. never delete through a symbolic link -------------------------------------------


@pytest.fixture
def linked_root(tmp_path: Path) -> tuple[Path, Path]:
    """``root/step-0`` links to a shared pretrained checkpoint outside the root;
    ``root/step-{1,2}`` are the run's own."""
    pretrained = tmp_path / "shared" / "pretrained"
    storage.save(_state(0.0), str(pretrained))
    root = tmp_path / "root"
    root.mkdir()
    (root / "step-0").symlink_to(pretrained, target_is_directory=True)
    mgr = CheckpointManager(root)
    mgr.save(1, _state(1.0))
    mgr.save(2, _state(2.0))
    return root, pretrained


def _pretrained_intact(pretrained: Path) -> None:
    assert (pretrained / ".metadata").exists()
    _assert_loads(pretrained, 0.0)


def test_retention_never_deletes_through_a_linked_step(
    linked_root: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    # Without the fix, retention deleted the pretrained checkpoint's files through the
    # link, then failed on rmdir of the link half-way (steps 1 and 2 survived).
    root, pretrained = linked_root
    mgr = CheckpointManager(root, keep_last=1)
    mgr.save(3, _state(3.0))
    _pretrained_intact(pretrained)
    assert (root / "step-0").is_symlink()
    assert mgr.steps() == [0, 3]
    assert "symbolic link" in caplog.text


def test_delete_and_rm_refuse_a_linked_step(
    linked_root: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    # Without the fix, manager.delete(0) and `dcp-storage rm root/step-0` deleted the
    # linked checkpoint's files.
    root, pretrained = linked_root
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        CheckpointManager(root).delete(0)
    assert main(["rm", str(root / "step-0")]) == 1
    assert "symbolic link" in capsys.readouterr().err
    _pretrained_intact(pretrained)


def test_gc_skips_linked_steps_and_says_so(
    linked_root: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    # Without the fix, gc deleted the pretrained checkpoint (retention) and, for a link
    # to an uncommitted directory, its leftovers (cleanup), silently.
    root, pretrained = linked_root
    partial = root.parent / "shared" / "partial"
    partial.mkdir()
    (partial / "__0_0-abc.distcp").write_bytes(b"x")
    old = 1_000_000_000  # 2001: older than any grace
    os.utime(partial / "__0_0-abc.distcp", (old, old))
    (root / "step-7").symlink_to(partial, target_is_directory=True)
    capsys.readouterr()
    assert main(["gc", str(root), "--keep-last", "1", "--grace", "0"]) == 0
    out = capsys.readouterr().out
    assert "step-0" in out and "step-7" in out and "symbolic link" in out
    _pretrained_intact(pretrained)
    assert (partial / "__0_0-abc.distcp").exists()


# --- 3. deletion racing an overwrite of the same step ----------------------------------


class _BeforePublish(LocalFileSystem):
    """Runs ``hook`` once when the commit begins (its first step makes the written
    files durable): the moment a concurrent deleter hurts most, every data file of the
    save written and the metadata not yet published."""

    hook: Callable[[], None] | None = None

    def sync_dir(self, path: str) -> None:
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        super().sync_dir(path)


def test_retention_racing_an_overwrite_keeps_the_new_files(tmp_path: Path) -> None:
    # Without the fix, retention (here another process's gc: a second manager on the
    # same root) listed the step, removed the old metadata and then every *.distcp in
    # it, the in-flight save's new files included; the save then published metadata
    # naming missing files and reported success.
    root = tmp_path / "root"
    CheckpointManager(root).save(1, _state(1.0))
    CheckpointManager(root).save(2, _state(2.0))
    fs = _BeforePublish()
    fs.hook = lambda: CheckpointManager(root, keep_last=1).apply_retention()
    CheckpointManager(root, filesystem=fs).save(1, _state(5.0))  # overwrite step 1
    _assert_loads(root / "step-1", 5.0)


def test_save_never_reports_success_for_missing_files(tmp_path: Path) -> None:
    # Without the fix, a data file removed while the save ran (a gc whose grace is
    # shorter than the save) went unnoticed: the save published metadata naming it and
    # returned normally, and every load failed.
    ckpt = tmp_path / "ckpt"
    storage.save(_state(1.0), str(ckpt))
    before = {p.name for p in ckpt.iterdir()}
    fs = _BeforePublish()

    def remove_a_new_file() -> None:
        (new,) = {p.name for p in ckpt.iterdir()} - before
        (ckpt / new).unlink()

    fs.hook = remove_a_new_file
    with pytest.raises(CheckpointNotFoundError, match="vanished"):
        storage.save(_state(2.0), str(ckpt), filesystem=fs)
    _assert_loads(ckpt, 1.0)  # the committed checkpoint is untouched


# --- 4. every rank follows the coordinator's verdict -----------------------------------


class _LostResponse(LocalFileSystem):
    """The metadata publish lands, then the response is lost (raises)."""

    def write_atomic(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        super().write_atomic(path, data, exclusive=exclusive)
        raise OSError(f"{path}: connection reset after the request was sent")


def _lost_response_worker(rank: int, store: str, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with gloo_group(rank, 2, store):
        mesh = init_device_mesh("cpu", (2,))
        state = {"w": distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])}
        with pytest.raises(OSError, match="connection reset"):
            storage.save(state, path, filesystem=_LostResponse())


def test_ranks_keep_their_files_when_the_commit_may_have_landed(tmp_path: Path) -> None:
    # Without the fix, rank 1 removed its data file in abort(): only rank 0 knew that
    # the metadata had landed, so the published checkpoint named a missing file.
    ckpt = tmp_path / "ckpt"
    spawn(_lost_response_worker, args=(str(tmp_path / "store"), str(ckpt)), nprocs=2, join=True)
    assert len(list(ckpt.glob("__1_*.distcp"))) == 1
    out = {"w": torch.zeros(8)}
    storage.load(out, str(ckpt))
    assert torch.equal(out["w"], torch.arange(8.0))


# --- 5. a failed write on an object store keeps the object already there ---------------

_BUCKET = "dcp-hostile-delete"


@pytest.fixture(scope="module")
def gcs_endpoint() -> str:
    from tests.support.servers import fake_gcs_endpoint, gcs_create_bucket

    url = fake_gcs_endpoint()
    gcs_create_bucket(url, _BUCKET)
    return url


@pytest.mark.parametrize("backend", ["gcs", "fsspec-gs"])
@pytest.mark.parametrize("size", [100, 600 << 10], ids=["one-request", "resumable"])
def test_failed_write_keeps_the_object_already_there(
    gcs_endpoint: str, backend: str, size: int
) -> None:
    # Without the fix, _abandon removed the object at the path after cancelling the
    # upload: the old object, which the store had kept, was deleted.
    from tests.support.servers import gcs_options

    options = gcs_options(gcs_endpoint)
    fs: FsspecFileSystem = (
        GCSFileSystem(storage_options=options, part_size=256 << 10)
        if backend == "gcs"
        else FsspecFileSystem(storage_options=options, protocol="gs")
    )
    path = fs.init_path(f"gs://{_BUCKET}/{uuid.uuid4().hex}/obj.bin")
    fs.write_atomic(path, b"old")
    with pytest.raises(RuntimeError, match="boom"), fs.create_stream(path, "wb") as stream:
        stream.write(b"n" * size)
        raise RuntimeError("boom")
    assert fs.read_bytes(path) == b"old"


_PARK_WHILE_PRUNING = """
import sys
from storage import CheckpointManager
from tests.support.subprocess_jobs import park_on_rm_file
park_on_rm_file(".metadata.tmp-", sys.argv[2])  # step-1's metadata moved aside, not removed
CheckpointManager(sys.argv[1], keep_last=1, persist="thread").apply_retention()
"""


def test_retention_killed_mid_deletion_leaves_an_interrupted_save_for_cleanup(
    tmp_path: Path,
) -> None:
    """kill -9 of a process pruning step 1, after its metadata was moved aside (a
    deletion first does that, to look once more for steps referencing it): what stays
    must be an interrupted save that `cleanup` removes, never a step that is listed or
    loaded, and step 2 and a later save of step 1 must be unharmed. Without the
    temporary metadata name (say, a name `cleanup` does not know), the directory would
    hold a file `cleanup` refuses to touch and stay for good."""
    root = tmp_path / "root"
    mgr = CheckpointManager(str(root), persist="thread")
    mgr.save(1, _state(1.0))
    mgr.save(2, _state(2.0))
    mark = tmp_path / "parked"
    kill_when_marked(
        _PARK_WHILE_PRUNING, [str(root), str(mark)], mark, "the pruning of step 1's metadata"
    )
    assert [n for n in os.listdir(root / "step-1") if n.startswith(".metadata.tmp-")]
    assert mgr.steps() == [2]
    assert mgr.cleanup(grace_seconds=0) == [1]
    assert not (root / "step-1").exists()
    _assert_loads(root / "step-2", 2.0)
    mgr.save(1, _state(3.0))
    _assert_loads(root / "step-1", 3.0)


# --- 3. a directory swapped for a link after the checks --------------------------------
#
# Whoever can write the root (a shared directory) can rename a step directory away and
# put a link in its place, or (where they can write the step) do so with a key-prefix
# directory, after a deletion checked that neither is a link and before it removes the
# files by name. The swaps below happen at fixed points inside the deletion (a hook), so
# no test depends on a timing window.


def _local_deleters() -> list[Any]:
    """The backends that delete on local disk, each as ``make(directory) -> (fs, path)``."""

    def plain(directory: Path) -> tuple[Any, str]:
        fs = LocalFileSystem()
        return fs, fs.init_path(str(directory))

    def fsspec_file(directory: Path) -> tuple[Any, str]:
        fs = FsspecFileSystem()
        return fs, fs.init_path(f"file://{directory}")

    def torch_local(directory: Path) -> tuple[Any, str]:
        from torch.distributed.checkpoint.filesystem import FileSystem

        fs = storage.TorchFileSystem(FileSystem())
        return fs, fs.init_path(str(directory))

    return [
        pytest.param(plain, id="path"),
        pytest.param(fsspec_file, id="fsspec-file"),
        pytest.param(torch_local, id="torch-local"),
    ]


_OLD = 1_000_000_000  # 2001: older than any grace period


@pytest.fixture
def swappable(tmp_path: Path) -> tuple[Path, Path, dict[str, bytes]]:
    """``root/step-1`` saved with key prefixes, and ``victim``: a directory outside the
    root holding files at the very names of step 1's (someone's copy of it), with its
    contents as they must stay."""
    root, victim = tmp_path / "root", tmp_path / "victim"
    CheckpointManager(root, key_prefixes=2).save(1, _state(1.0))
    shutil.copytree(root / "step-1", victim)
    before = snapshot(victim)
    assert any(name.endswith(".distcp") and "/" in name for name in before)
    return root, victim, before


_SWAPPED = "symbolic link where the checkpoint has a directory"


def _swap(place: Path, target: Path) -> None:
    place.rename(place.with_name(place.name + ".moved"))
    place.symlink_to(target, target_is_directory=True)


@pytest.mark.parametrize("make", _local_deleters())
@pytest.mark.parametrize("what", ["step", "prefix"])
@pytest.mark.parametrize("hook", ["recheck", "after-metadata"])
def test_delete_never_follows_a_directory_swapped_for_a_link_after_its_checks(
    swappable: tuple[Path, Path, dict[str, bytes]],
    monkeypatch: pytest.MonkeyPatch,
    make: Any,
    what: str,
    hook: str,
) -> None:
    # Before the fix: the deletion checked for links, then removed each file by its path;
    # the step (or its prefix directory 00) swapped for a link in between, it removed
    # the victim's files at those names (the metadata moved aside, the data files).
    from storage.checkpoint import deletion

    root, victim, before = swappable
    step = root / "step-1"

    def swap() -> None:
        if what == "step":
            _swap(step, victim)
        else:
            _swap(step / "00", victim / "00")

    fs, path = make(step)
    recheck = None
    if hook == "recheck":  # the metadata moved aside, nothing removed yet
        recheck = swap
    else:  # the metadata removed, the data files not yet
        monkeypatch.setattr(deletion, "withdraw_latest", lambda fs, path: swap())
    with pytest.raises(UnsafeCheckpointError, match=_SWAPPED):
        deletion.delete_checkpoint(fs, path, recheck=recheck)
    assert snapshot(victim) == before


def test_retention_never_follows_a_step_swapped_for_a_link_after_its_checks(
    swappable: tuple[Path, Path, dict[str, bytes]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Before the fix: retention's deletion of step 1 removed the victim's files.
    from storage.checkpoint import deletion

    root, victim, before = swappable
    monkeypatch.setattr(
        deletion, "withdraw_latest", lambda fs, path: _swap(root / "step-1", victim)
    )
    mgr = CheckpointManager(root, keep_last=1, key_prefixes=2)
    mgr.save(2, _state(2.0))  # retention deletes step 1
    assert snapshot(victim) == before
    assert _SWAPPED in caplog.text
    _assert_loads(root / "step-2", 2.0)


def test_removal_fails_closed_when_a_directory_is_swapped_mid_walk(
    swappable: tuple[Path, Path, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The walk itself: the step directory opened, its prefix directory is swapped for a
    link just before the walk opens it; the removal must refuse, removing nothing."""
    root, victim, before = swappable
    step = root / "step-1"
    name = next(n for n in snapshot(step) if n.startswith("00/"))
    real_open = os.open

    def open_then_swap(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if path == "00" and kwargs.get("dir_fd") is not None:
            _swap(step / "00", victim / "00")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_then_swap)
    with pytest.raises(UnsafeCheckpointError, match=_SWAPPED):
        LocalFileSystem().rm_file_in(str(step), name)
    monkeypatch.undo()
    assert snapshot(victim) == before
    assert (step.with_name("step-1") / "00.moved" / name.split("/")[1]).is_file()


def test_a_step_swapped_after_the_walk_opened_it_loses_only_its_own_file(
    swappable: tuple[Path, Path, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the walk holds the step directory open, swapping the name for a link
    changes nothing: the file removed is the step's own (under its new name)."""
    root, victim, before = swappable
    step = root / "step-1"
    name = next(n for n in snapshot(step) if n.startswith("00/"))
    real_open = os.open

    def open_then_swap(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd = real_open(path, flags, *args, **kwargs)
        if path == "step-1" and kwargs.get("dir_fd") is not None:
            _swap(step, victim)
        return fd

    monkeypatch.setattr(os, "open", open_then_swap)
    LocalFileSystem().rm_file_in(str(step), name)
    monkeypatch.undo()
    assert snapshot(victim) == before
    assert not (root / "step-1.moved" / name).exists()


class _SwapOnCommit(LocalFileSystem):
    """The local backend; the model folder ``folder`` is swapped for a link to ``victim``
    once the new model is committed, before the replaced files are removed: right after
    the new model.safetensors is published (one file), or after the last check of the
    new index (several files: it asks whether a model.safetensors is there)."""

    def __init__(self, folder: Path, victim: Path) -> None:
        super().__init__()
        self.folder, self.victim = folder, victim
        self.swapped = self.indexed = False

    def _swap_once(self) -> None:
        if not self.swapped:
            self.swapped = True
            _swap(self.folder, self.victim)

    def rename(self, path: str, new_path: str) -> None:
        super().rename(path, new_path)
        if os.path.basename(new_path) == "model.safetensors":
            self._swap_once()

    def rename_in(self, directory: str, name: str, new_name: str) -> None:
        super().rename_in(directory, name, new_name)  # published inside the folder
        if new_name == "model.safetensors":
            self._swap_once()

    def write_atomic(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        super().write_atomic(path, data, exclusive=exclusive)
        self.indexed |= path.endswith(".index.json")

    def exists(self, path: str) -> bool:
        found = super().exists(path)
        if self.indexed and os.path.basename(path) == "model.safetensors":
            self._swap_once()
        return found


@pytest.mark.parametrize("how", ["save", "export"])
@pytest.mark.parametrize("size", [None, 4096], ids=["one-file", "several-files"])
def test_replacing_a_model_never_removes_files_through_a_folder_swapped_for_a_link(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str, size: int | None
) -> None:
    # Before the fix: once the new model was committed, the replaced model's files (its
    # index, its shards) were removed by path, so the folder swapped for a link in the
    # meantime made the write remove them from the victim: another model's folder.
    from storage.checkpoint.api import save_with
    from storage.ops.export import export_safetensors

    out, victim = tmp_path / "out", tmp_path / "victim"
    old = {f"w{i}": torch.full((1024,), float(i)) for i in range(4)}
    storage.save_safetensors(old, str(out), max_shard_size=4096)
    shutil.copytree(out, victim)
    before = snapshot(victim)
    new = {name: -t for name, t in old.items()}
    fs = _SwapOnCommit(out, victim)
    raised = ""
    try:
        if how == "export":
            storage.save(new, str(tmp_path / "src"))
            export_safetensors(
                fs, str(tmp_path / "src"), fs, str(out), max_shard_size=size, overwrite=True
            )
        else:
            writer = storage.SafetensorsWriter(out, max_shard_size=size, overwrite=True)
            writer.fs = fs
            save_with(writer, new)
    except Exception as exc:  # one file: the stale index is not removed, and that raises
        raised = repr(exc)
    assert fs.swapped
    assert snapshot(victim) == before
    assert _SWAPPED in raised + caplog.text


class _Failed(Exception):
    """A write that failed half way (a full disk, a cancelled save)."""


@pytest.mark.parametrize("make", _local_deleters())
def test_a_failed_write_never_removes_its_file_through_a_directory_swapped_for_a_link(
    swappable: tuple[Path, Path, dict[str, bytes]], make: Any
) -> None:
    # Before the fix: a write that failed removed its file by path, so the step swapped
    # for a link while it wrote made it remove the victim's file of that name.
    root, victim, before = swappable
    step = root / "step-1"
    name = next(n for n in before if n.endswith(".distcp"))  # in a prefix directory
    fs, path = make(step)
    with pytest.raises(_Failed), fs.create_stream(fs.concat_path(path, name), "wb") as out:
        out.write(b"half")
        _swap(step, victim)
        raise _Failed
    assert snapshot(victim) == before


@pytest.mark.parametrize("make", _local_deleters())
def test_a_failed_write_through_the_users_own_link_removes_its_file(
    tmp_path: Path, make: Any
) -> None:
    """A directory the user reaches through their own link: a write that fails there
    still removes its file, in the directory the link resolves to."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "mine").symlink_to(real, target_is_directory=True)
    fs, path = make(tmp_path / "mine")
    with pytest.raises(_Failed), fs.create_stream(fs.concat_path(path, "f.bin"), "wb") as out:
        out.write(b"half")
        raise _Failed
    assert list(real.iterdir()) == []


def test_removal_goes_by_path_where_the_platform_cannot_walk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``dir_fd`` support a removal goes by path (refusing, the heartbeats and
    overwritten data files of every save stayed behind for good): files, directories and
    renames still work, a link on the way is still refused when it is already there, and
    a name that climbs out is refused as the walk refuses it."""
    from storage.backends import _local_walk

    fs = LocalFileSystem()
    (tmp_path / "d" / "00").mkdir(parents=True)
    (tmp_path / "d" / "00" / "f").write_text("x")
    (tmp_path / "d" / "g").write_text("y")
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "f").write_text("theirs")
    (tmp_path / "d" / "11").symlink_to(tmp_path / "victim", target_is_directory=True)
    monkeypatch.setattr(_local_walk, "WALKS_SAFELY", False)
    fs.rename_in(str(tmp_path / "d"), "g", "h")
    assert (tmp_path / "d" / "h").read_text() == "y"
    fs.rm_file_in(str(tmp_path / "d"), "00/f")
    fs.rm_dir_in(str(tmp_path / "d"), "00")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["11", "h"]
    with pytest.raises(UnsafeCheckpointError, match="symbolic"):
        fs.rm_file_in(str(tmp_path / "d"), "11/f")
    with pytest.raises(NotADirectoryError):
        fs.rm_dir_in(str(tmp_path / "d"), "11")
    with pytest.raises(UnsafeCheckpointError, match="not a plain relative name"):
        fs.rm_file_in(str(tmp_path / "d"), "../victim/f")
    assert (tmp_path / "victim" / "f").read_text() == "theirs"


@pytest.mark.parametrize("bad", ["../x", "00/../../x", "/etc/passwd", "a/./b", "a\0b", ""])
def test_a_removal_never_leaves_its_directory_by_name(tmp_path: Path, bad: str) -> None:
    """A name that climbs out (``..``), is absolute, holds ``.`` or a NUL is refused
    before anything is opened."""
    (tmp_path / "d").mkdir()
    (tmp_path / "x").write_text("outside")
    with pytest.raises(UnsafeCheckpointError, match="not a plain relative name"):
        LocalFileSystem().rm_file_in(str(tmp_path / "d"), bad)
    assert (tmp_path / "x").read_text() == "outside"


def test_links_planted_in_a_step_are_removed_as_links_and_their_targets_survive(
    tmp_path: Path,
) -> None:
    """Links a neighbour planted in a committed step and in an interrupted one, at the
    names gc, retention and delete remove (an unnamed data file, a heartbeat, a data
    file of a leftover step, a prefix directory): the links go or stay, their targets
    are never touched."""
    root, victim = tmp_path / "root", tmp_path / "victim"
    (victim / "dir").mkdir(parents=True)
    target = victim / "file"
    target.write_bytes(b"keep me")
    (victim / "dir" / "__0_0.distcp").write_bytes(b"keep me too")
    mgr = CheckpointManager(root, key_prefixes=2)
    mgr.save(1, _state(1.0))
    mgr.save(2, _state(2.0))
    planted = [
        root / "step-1" / "__9_0-0123456789ab.distcp",
        root / "step-1" / "00" / "__9_1-0123456789ab.distcp",
        root / "step-1" / ".heartbeat-0123456789ab",
        root / "step-3" / "__0_0-0123456789ab.distcp",
    ]
    for link in planted:
        link.parent.mkdir(exist_ok=True)
        link.symlink_to(target)
    (root / "step-2" / "0f").symlink_to(victim / "dir", target_is_directory=True)
    for p in [*planted, target]:
        os.utime(p, (_OLD, _OLD), follow_symlinks=False)
    mgr.cleanup(grace_seconds=60)
    assert not any(os.path.lexists(p) for p in planted)
    mgr.delete(2)
    mgr.delete(1)
    assert (root / "step-2" / "0f").is_symlink()
    assert target.read_bytes() == b"keep me"
    assert (victim / "dir" / "__0_0.distcp").read_bytes() == b"keep me too"


def test_a_relative_directory_is_walked_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``step-1`` (a relative path, as torch's local filesystem may hand it) is walked
    from the working directory, never from ``/``."""
    (tmp_path / "step-1" / "00").mkdir(parents=True)
    (tmp_path / "step-1" / "00" / "f").write_text("x")
    monkeypatch.chdir(tmp_path)
    fs = LocalFileSystem()
    fs.rm_file_in("step-1", "00/f")
    fs.rm_dir_in("step-1", "00")
    fs.rm_dir_in("step-1")
    assert os.listdir(tmp_path) == []
