"""A save or export killed while it writes a model over another: the folder holds the
old model or the new one, never neither, and the next try succeeds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import storage
from storage.backends import LocalFileSystem
from storage.checkpoint.api import save_with
from storage.checkpoint.safetensors.verify import verify_model
from storage.cli import main
from storage.ops.export import export_safetensors
from tests.support.gated_fs import wait_for
from tests.support.trees import tiny_llama

REPO = Path(__file__).resolve().parents[2]

#: Run in a child: our local backend holds the second write of a model file whose name
#: holds ``argv[6]`` (written by path or inside its folder; its header went through),
#: marks ``started`` and sleeps until the test kills the child. ``argv[5]``: the largest
#: file, in bytes ("": one file).
_HELD = textwrap.dedent(
    """
    import contextlib, sys, time
    from pathlib import Path
    import torch
    import storage
    from storage.backends._local import LocalFileSystem

    gate = Path(sys.argv[1])
    create_stream = LocalFileSystem.create_stream

    class Held:
        def __init__(self, inner):
            self.inner, self.writes = inner, 0
        def write(self, data):
            self.writes += 1
            if self.writes == 2:
                self.inner.flush()
                gate.touch()
                time.sleep(600)
            return self.inner.write(data)
        def __getattr__(self, name):
            return getattr(self.inner, name)

    @contextlib.contextmanager
    def held(self, path, mode, *, sync=False):
        with create_stream(self, path, mode, sync=sync) as stream:
            yield Held(stream) if sys.argv[6] in path else stream

    create_stream_in = LocalFileSystem.create_stream_in

    @contextlib.contextmanager
    def held_in(self, directory, name, mode="wb", *, sync=False):
        with create_stream_in(self, directory, name, mode, sync=sync) as stream:
            yield Held(stream) if sys.argv[6] in name else stream

    LocalFileSystem.create_stream = held
    LocalFileSystem.create_stream_in = held_in
    size = int(sys.argv[5]) if sys.argv[5] else None
    if sys.argv[2] == "export":
        from storage.cli import main
        cut = ["--max-shard-size", sys.argv[5]] if size else []
        main(["export", sys.argv[3], sys.argv[4], "--format", "safetensors", "--overwrite", *cut])
    else:
        state = torch.load(sys.argv[3] + ".pt", weights_only=True)
        storage.save_safetensors(state, sys.argv[4], overwrite=True, max_shard_size=size)
    """
)


def _kill_while_writing(
    tmp_path: Path,
    how: str,
    src: Path,
    out: Path,
    size: int | None = None,
    hold: str = ".safetensors",
) -> None:
    gate = tmp_path / "started"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    argv = [str(gate), how, str(src), str(out), str(size or ""), hold]
    child = subprocess.Popen([sys.executable, "-c", _HELD, *argv], env=env, cwd=REPO)
    try:
        wait_for(gate)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()


@pytest.mark.parametrize("how", ["export", "save"])
def test_a_write_killed_over_a_single_file_model_leaves_the_old_model(
    tmp_path: Path, how: str
) -> None:
    """Replacing a model removed its single file before the new one was written, so a
    kill half way left no model at all (the new file is published whole over the old
    one: keeping the old until then costs nothing)."""
    src, out = tmp_path / "src", tmp_path / "out"
    storage.save({"w": torch.zeros(4096)}, str(src))
    torch.save({"w": torch.zeros(4096)}, f"{src}.pt")
    storage.save_safetensors({"w": torch.ones(4096)}, str(out))
    _kill_while_writing(tmp_path, how, src, out)
    assert torch.equal(load_file(out / "model.safetensors")["w"], torch.ones(4096))
    target = {"w": torch.empty(4096)}
    storage.load_safetensors(target, str(out))
    assert torch.equal(target["w"], torch.ones(4096))
    # The next try replaces it.
    argv = ["export", str(src), str(out), "--format", "safetensors", "--overwrite"]
    assert main(argv) == 0
    assert torch.equal(load_file(out / "model.safetensors")["w"], torch.zeros(4096))
    assert main(["verify", str(out)]) == 0


@pytest.mark.parametrize("how", ["export", "save"])
def test_a_write_killed_between_files_over_a_sharded_model_leaves_the_old_model(
    tmp_path: Path, how: str
) -> None:
    """Replacing a model in several files removed its index, then wrote the new files
    over the old ones' names: killed between two files, it left no model. The new files
    take other names and the index is replaced last, so the old model stays whole."""
    names = [f"w{i}" for i in range(4)]
    src, out = tmp_path / "src", tmp_path / "out"
    state = {n: torch.zeros(1024) for n in names}
    storage.save(state, str(src))
    torch.save(state, f"{src}.pt")
    old = {n: torch.full((1024,), float(i)) for i, n in enumerate(names)}
    storage.save_safetensors(old, str(out), max_shard_size=4096)
    before = sorted(os.listdir(out))
    _kill_while_writing(tmp_path, how, src, out, 4096, "-00003-of-00004")
    target = {n: torch.empty(1024) for n in names}
    storage.load_safetensors(target, str(out))
    assert all(torch.equal(target[n], old[n]) for n in names)
    assert main(["verify", str(out)]) == 0
    # The next try replaces it, and removes the old files and those of the killed write.
    argv = ["export", str(src), str(out), "--format", "safetensors", "--overwrite"]
    assert main([*argv, "--max-shard-size", "4096"]) == 0
    storage.load_safetensors(target, str(out))
    assert all(torch.equal(target[n], state[n]) for n in names)
    # (The killed write's temporary stays until it is an hour old: `gc` and writes sweep it.)
    after = sorted(n for n in os.listdir(out) if ".tmp-" not in n)
    assert len(after) == 5 and not set(after) & (set(before) - {"model.safetensors.index.json"})


def test_verify_of_a_killed_export_says_it_did_not_finish(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder holding the files of an export killed before its index: verify said it
    had no .metadata ("an interrupted save, or not a checkpoint directory")."""
    src, out = tmp_path / "src", tmp_path / "out"
    storage.save({"a": torch.zeros(4096), "b": torch.ones(4096)}, str(src))
    argv = ["export", str(src), str(out), "--format", "safetensors", "--max-shard-size", "20000"]
    assert main(argv) == 0
    (out / "model.safetensors.index.json").unlink()  # what a kill before the index leaves
    capsys.readouterr()
    assert main(["verify", str(out)]) == 1
    err = capsys.readouterr().err
    assert "safetensors files but no model.safetensors.index.json" in err, err
    assert "export or save it again" in err


class _Killed(BaseException):
    """A kill, as the write sees it: nothing after the step it stopped at runs."""


class _KilledAtRemoval(LocalFileSystem):
    """The local backend, the write killed as it removes the file named ``name``."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.killed = False

    def rm_file_in(self, directory: str, name: str) -> None:
        if name == self.name:
            self.killed = True
            raise _Killed(name)
        super().rm_file_in(directory, name)


def _write(
    how: str, fs: LocalFileSystem, state: dict[str, torch.Tensor], out: Path, size: int | None
) -> None:
    """Write ``state`` over the model at ``out`` through ``fs``: an export of its DCP
    checkpoint (saved beside ``out``), or a ``SafetensorsWriter`` save."""
    if how == "export":
        src = out.parent / f"src-{len(os.listdir(out.parent))}"
        storage.save(state, str(src))
        export_safetensors(fs, str(src), fs, str(out), max_shard_size=size, overwrite=True)
    else:
        writer = storage.SafetensorsWriter(out, max_shard_size=size, overwrite=True)
        writer.fs = fs
        save_with(writer, state)


def _killed_write(
    how: str, at: str, state: dict[str, torch.Tensor], out: Path, size: int | None
) -> None:
    fs = _KilledAtRemoval(at)
    with pytest.raises(BaseException):  # noqa: B017, PT011 (a save wraps it in DCP's error)
        _write(how, fs, state, out, size)
    assert fs.killed


def _loaded(out: Path, names: list[str]) -> dict[str, torch.Tensor]:
    target = {n: torch.empty(1024) for n in names}
    storage.load_safetensors(target, str(out))
    return target


NAMES = [f"w{i}" for i in range(4)]
OLD = {n: torch.full((1024,), float(i)) for i, n in enumerate(NAMES)}
NEW = {n: torch.full((1024,), -1.0 - i) for i, n in enumerate(NAMES)}
NEXT = {n: torch.full((1024,), 10.0 + i) for i, n in enumerate(NAMES)}
INDEX = "model.safetensors.index.json"


def _only_the_model(out: Path, size: int | None) -> None:
    """``out`` holds ``NEXT`` and nothing else: no file of the models it replaced."""
    held = sorted(os.listdir(out))
    if size is None:
        assert held == ["model.safetensors"]
    else:
        index = json.loads((out / INDEX).read_text())
        assert held == sorted({INDEX, *index["weight_map"].values()})
        assert len(held) == 5
    loaded = _loaded(out, NAMES)
    assert all(torch.equal(loaded[n], NEXT[n]) for n in NAMES)
    assert main(["verify", str(out)]) == 0


@pytest.mark.parametrize("then", [None, 4096], ids=["then-one-file", "then-several"])
@pytest.mark.parametrize("how", ["export", "save"])
def test_several_files_killed_before_removing_the_single_file_leave_the_old_model(
    tmp_path: Path, how: str, then: int | None
) -> None:
    """A model in several files replacing a single file, killed between publishing its
    index and removing the old model.safetensors, left both: transformers loads that
    file, while our reader and verify took the new index. The file's removal is the
    commit now and every reader prefers it, so all read the old model until the next
    write, which leaves one clean model."""
    out = tmp_path / "out"
    storage.save_safetensors(OLD, str(out))
    _killed_write(how, "model.safetensors", NEW, out, 4096)
    assert {"model.safetensors", INDEX} <= set(os.listdir(out))
    assert len(os.listdir(out)) == 6  # the new index and its four shards are all there
    loaded = _loaded(out, NAMES)
    assert all(torch.equal(loaded[n], OLD[n]) for n in NAMES)
    assert verify_model(LocalFileSystem(), str(out)).files == ["model.safetensors"]
    assert main(["verify", str(out)]) == 0
    _write(how, LocalFileSystem(), NEXT, out, then)
    _only_the_model(out, then)


@pytest.mark.parametrize("then", [None, 4096], ids=["then-one-file", "then-several"])
@pytest.mark.parametrize("how", ["export", "save"])
def test_one_file_killed_before_removing_the_old_index_is_the_new_model(
    tmp_path: Path, how: str, then: int | None
) -> None:
    """A single file replacing a model in several files is committed when it is
    published: killed before the old index is removed, every reader takes the new file
    (as transformers does), and the next write removes the stale index and shards."""
    out = tmp_path / "out"
    storage.save_safetensors(OLD, str(out), max_shard_size=4096)
    _killed_write(how, INDEX, NEW, out, None)
    assert {"model.safetensors", INDEX} <= set(os.listdir(out))
    loaded = _loaded(out, NAMES)
    assert all(torch.equal(loaded[n], NEW[n]) for n in NAMES)
    assert main(["verify", str(out)]) == 0
    _write(how, LocalFileSystem(), NEXT, out, then)
    _only_the_model(out, then)


@pytest.mark.parametrize(
    "sharded_first", [False, True], ids=["one-then-several", "several-then-one"]
)
def test_transformers_and_our_reader_load_the_same_model_from_a_killed_replacement(
    tmp_path: Path, sharded_first: bool
) -> None:
    """Where a killed replacement left model.safetensors beside an index,
    transformers' from_pretrained and our reader load the same model: the old one for
    several files over one, the new one for one file over several."""
    transformers = pytest.importorskip("transformers")
    config, old_model = tiny_llama(0)
    _, new_model = tiny_llama(1)
    old = {k: v.detach().clone() for k, v in old_model.state_dict().items()}
    new = {k: v.detach().clone() for k, v in new_model.state_dict().items()}
    out = tmp_path / "out"
    config.save_pretrained(out)
    shard = 64 << 10
    storage.save_safetensors(old, str(out), max_shard_size=shard if sharded_first else None)
    killed_at = INDEX if sharded_first else "model.safetensors"
    _killed_write("save", killed_at, new, out, None if sharded_first else shard)
    assert {"model.safetensors", INDEX} <= set(os.listdir(out))
    expected = new if sharded_first else old
    theirs = transformers.LlamaForCausalLM.from_pretrained(out).state_dict()
    ours = {k: torch.empty_like(v) for k, v in old.items()}
    storage.load_safetensors(ours, str(out))
    for key, value in expected.items():
        assert torch.equal(theirs[key], value), key
        assert torch.equal(ours[key], value), key


class _Undeletable(LocalFileSystem):
    def rm_file_in(self, directory: str, name: str) -> None:
        if name == "model.safetensors":
            raise PermissionError(name)
        super().rm_file_in(directory, name)


def test_several_files_that_cannot_remove_the_single_file_fail_and_leave_the_old_model(
    tmp_path: Path,
) -> None:
    """The removal of the replaced model.safetensors is the commit: where it fails, the
    old file is still what every reader loads, so the write fails instead of returning
    as if its model were there."""
    out = tmp_path / "out"
    storage.save_safetensors(OLD, str(out))
    with pytest.raises(OSError, match="still the model that readers load"):
        _write("export", _Undeletable(), NEW, out, 4096)
    loaded = _loaded(out, NAMES)
    assert all(torch.equal(loaded[n], OLD[n]) for n in NAMES)


@pytest.mark.parametrize("then", [None, 4096], ids=["then-one-file", "then-several"])
@pytest.mark.parametrize("how", ["export", "save"])
def test_replacing_a_model_in_a_folder_the_user_links_to_removes_the_old_files(
    tmp_path: Path, how: str, then: int | None
) -> None:
    """A model folder the user names through their own link: the replaced model's files
    are removed in the folder the link resolves to (removals never go through a link)."""
    real, out = tmp_path / "real", tmp_path / "mine"
    real.mkdir()
    out.symlink_to(real, target_is_directory=True)
    storage.save_safetensors(OLD, str(out), max_shard_size=None if then else 4096)
    _write(how, LocalFileSystem(), NEXT, out, then)
    assert out.is_symlink()
    _only_the_model(real, then)
