"""A save or export killed while it writes a model over another: the folder holds the
old model or the new one, never neither, and the next try succeeds."""

from __future__ import annotations

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
from storage.cli import main
from tests.support.gated_fs import wait_for

REPO = Path(__file__).resolve().parents[2]

#: Run in a child: our local backend holds the second write of a model file whose name
#: holds ``argv[6]`` (its header went through), marks ``started`` and sleeps until the
#: test kills the child. ``argv[5]``: the largest file, in bytes ("": one file).
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

    LocalFileSystem.create_stream = held
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
