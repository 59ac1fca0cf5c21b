"""``dcp-storage export SRC DEST --format safetensors``: a committed checkpoint (ours or
stock, encrypted with keys) to a Hub-layout model in a bucket or directory, filtered,
renamed, converted and cut into files, streamed: memory does not grow with the model."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from safetensors.torch import load_file

import storage
from extensions import AES256GCM, ZStandard
from extensions.errors import IntegrityError
from storage.backends import LocalFileSystem
from storage.backends.registry import filesystem_from_url
from storage.checkpoint.safetensors import load_safetensors
from storage.checkpoint.safetensors.verify import verify_model
from storage.cli import main
from storage.ops import export as export_module
from storage.ops.export import export_safetensors
from tests.support.distributed import gloo_group
from tests.support.servers import endpoint_with_bucket, s3_options
from tests.support.subprocess_jobs import kill_when_marked
from tests.support.trees import tiny_llama

BUCKET = "export"
KEY = bytes(range(32))


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {
        "model": {
            "embed.weight": torch.randn(64, 32, generator=gen),
            "layers.0.w": torch.randn(32, 32, generator=gen),
            "layers.0.ids": torch.arange(10),
        },
        "optim": {"state": {"m": torch.randn(32, 32, generator=gen)}},
        "step": 5,
    }


def _model_files(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(folder / name))
    return out


@pytest.fixture(scope="module", params=["seaweedfs"])
def endpoint(request: pytest.FixtureRequest) -> str:
    return endpoint_with_bucket(request, BUCKET)


def test_export_of_a_stock_checkpoint_to_a_bucket_filtered_renamed_converted_and_sharded(
    endpoint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = _state()
    src = tmp_path / "stock"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(src)), no_dist=True)
    dest = f"s3://{BUCKET}/model-{uuid.uuid4().hex[:8]}"
    options = s3_options(endpoint)
    pairs = [f"--storage-option={k}={v}" for k, v in options.items()]
    argv = ["export", str(src), dest, "--format", "safetensors", "--only", "model.", "--strip"]
    argv += ["model.", "--dtype", "bf16", "--max-shard-size", "5KB", "--json", *pairs]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tensors"] == 3 and report["skipped"] == []
    assert report["files"][-1] == "model.safetensors.index.json" and len(report["files"]) > 2
    expected = {
        "embed.weight": state["model"]["embed.weight"].bfloat16(),
        "layers.0.w": state["model"]["layers.0.w"].bfloat16(),
        "layers.0.ids": state["model"]["layers.0.ids"],  # integers keep their dtype
    }
    out = {k: torch.zeros_like(v) for k, v in expected.items()}
    load_safetensors(out, dest, storage_options=options)
    for key, value in expected.items():
        assert out[key].dtype == value.dtype and torch.equal(out[key], value), key


_PEAK = """
import json, sys, tracemalloc
import storage.cli.main  # noqa: F401 - imported before the baseline
from storage.cli import main
tracemalloc.start()
argv = ["export", *sys.argv[1:], "--format", "safetensors", "--quiet"]
assert main(argv) == 0
peak = tracemalloc.get_traced_memory()[1]
print(json.dumps({"python": peak}))
"""


def test_export_memory_does_not_grow_with_the_model(tmp_path: Path) -> None:
    """The export used to load a whole output file's tensors before writing it (the
    header carries their checksums). It now streams through a bounded set of read
    buffers: exporting 24 x 8 MiB into one file allocates no more than 8 tensors do
    (traced in a fresh process). Torch's allocations are not traced, so this bounds
    the streaming path's own buffers; it passed on the buffered export too, whose
    growth was in the loaded tensors (the RSS is in docs/benchmarks.md's run)."""
    grown = {}
    for count in (8, 24):
        src = tmp_path / f"src-{count}"
        storage.save(
            {f"w{i:02d}": torch.full((2 << 20,), float(i)) for i in range(count)}, str(src)
        )
        env = dict(os.environ, PYTHONPATH=os.getcwd())
        cmd = [sys.executable, "-c", _PEAK, str(src), str(tmp_path / f"out-{count}")]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        grown[count] = json.loads(done.stdout.strip().splitlines()[-1])
        files = _model_files(tmp_path / f"out-{count}")
        assert len(files) == count and torch.equal(files["w07"], torch.full((2 << 20,), 7.0))
    bound = export_module.FILES * export_module.AHEAD * export_module.CHUNK + (16 << 20)
    assert grown[24]["python"] < bound and grown[8]["python"] < bound, grown
    assert grown[24]["python"] - grown[8]["python"] < 4 << 20, grown


def _item_bytes(src: Path, fqn: str) -> tuple[Path, int, int]:
    """The data file of ``fqn``'s item, and where its tensor bytes are in it."""
    metadata = storage.CheckpointReader(str(src)).read_metadata()
    assert metadata.storage_data is not None
    index, info = next((i, v) for i, v in metadata.storage_data.items() if i.fqn == fqn)
    extra = info.dcp_storage
    return src / info.relative_path, info.offset + extra["data_offset"], extra["nbytes"]


@pytest.mark.parametrize("where", ["tensor", "archive"])
def test_export_of_a_damaged_item_fails_naming_it_and_commits_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    """A tensor's CRC-32C in the header is derived from its item's record before its
    bytes are read; the bytes that stream are checked against it, so a damaged item
    (its tensor bytes, or the archive around them) fails the export naming the item,
    and no index (no model) appears at the destination, rather than a file whose
    header lies about its bytes."""
    state = {f"w{i}": torch.full((1024,), float(i)) for i in range(4)}  # 4 KiB each
    src = tmp_path / "src"
    storage.save(state, str(src))
    path, start, length = _item_bytes(src, "w2")
    at = start + length // 2 if where == "tensor" else start - 16
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    out = tmp_path / "out"
    argv = ["export", str(src), str(out), "--format", "safetensors", "--max-shard-size", "4KiB"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "'w2'" in err and "damaged" in err and "checksum mismatch" in err, err
    assert not (out / "model.safetensors.index.json").exists()
    assert not any("w2" in load_file(f) for f in out.glob("*.safetensors"))


def _sharded_plain_worker(rank: int, store: str, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with gloo_group(rank, 2, store):
        mesh = init_device_mesh("cpu", (2,))
        model = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _state()["model"].items()}
        storage.save({"model": model, "step": 5}, path)


def test_export_of_plain_shards_streams_them_with_checksums_that_verify(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """An untransformed two-rank Shard(0) checkpoint exports without loading a tensor
    (every tensor's bytes are ranged reads of its shards' items, its CRC-32C combined
    from theirs), bit-exact, and the model verifies against the CRC-32Cs recorded in
    its headers."""
    src = str(tmp_path / "sharded")
    mp.spawn(_sharded_plain_worker, args=(str(tmp_path / "store"), src), nprocs=2, join=True)
    loads: list[int] = []
    monkeypatch.setattr(export_module, "load", lambda *a, **k: loads.append(1))
    out = tmp_path / "out"
    argv = ["export", src, str(out), "--format", "safetensors", "--strip", "model."]
    assert main([*argv, "--max-shard-size", "9KB"]) == 0
    assert loads == []
    files = _model_files(out)
    for key, value in _state()["model"].items():
        assert torch.equal(files[key.removeprefix("model.")], value), key
    fs, root = filesystem_from_url(str(out))
    report = verify_model(fs, root)
    assert not report.bad and not report.unchecksummed and len(report.ok) == 3


def test_export_of_zstd_and_converted_tensors_is_bit_exact_and_verifies(tmp_path: Path) -> None:
    """Tensors whose CRC-32C cannot come from the records (zstd items, a --dtype
    conversion) are loaded for it first, then again to be written: the model is
    bit-exact and verifies."""
    state = _state()
    storage.save(state, str(tmp_path / "z"), transforms=[ZStandard()])
    storage.save(state, str(tmp_path / "p"))
    cases = [("z", []), ("p", ["--dtype", "bf16"]), ("z", ["--dtype", "fp16"])]
    for n, (src, extra) in enumerate(cases):
        out = tmp_path / f"out-{n}"
        argv = ["export", str(tmp_path / src), str(out), "--format", "safetensors"]
        assert main([*argv, "--only", "model.", "--max-shard-size", "5KB", *extra]) == 0
        files = _model_files(out)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(extra[-1] if extra else "")
        for key, value in state["model"].items():
            want = value.to(dtype) if dtype is not None and value.is_floating_point() else value
            got = files[f"model.{key}"]
            assert got.dtype == want.dtype and torch.equal(got, want), key
        fs, root = filesystem_from_url(str(out))
        report = verify_model(fs, root)
        assert not report.bad and not report.unchecksummed and len(report.ok) == 3


def test_export_of_an_encrypted_checkpoint_with_keys_loads_in_transformers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    transformers = pytest.importorskip("transformers")
    monkeypatch.delenv("DCP_STORAGE_KEYS", raising=False)
    config, model = tiny_llama(0)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    src = tmp_path / "enc"
    storage.save(
        {"model": weights, "step": 3}, str(src), transforms=[AES256GCM(key=KEY, key_id="k1")]
    )
    key_file = tmp_path / "keys.json"
    key_file.write_text(json.dumps({"k1": KEY.hex()}))
    key_file.chmod(0o600)  # private, as documented
    out = tmp_path / "hub"
    argv = ["export", str(src), str(out), "--format", "safetensors", "--strip", "model."]
    assert main(argv) == 1  # no key
    assert "k1" in capsys.readouterr().err
    assert main([*argv, "--key-file", str(key_file)]) == 0
    assert "skipped 1 items that are not tensors" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    config.save_pretrained(out)
    again = transformers.LlamaForCausalLM.from_pretrained(out)
    for key, value in again.state_dict().items():
        assert torch.equal(value, weights[key]), key


def test_export_refuses_an_existing_model_and_an_empty_selection(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    storage.save(_state(), str(tmp_path / "src"))
    argv = ["export", str(tmp_path / "src"), str(tmp_path / "out"), "--format", "safetensors"]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(argv) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert main([*argv, "--overwrite", "--only", "nothing."]) == 1
    assert "no tensors to export under 'nothing.'" in capsys.readouterr().err
    assert main([*argv, "--max-shard-size", "lots"]) == 1
    assert "--max-shard-size takes a size" in capsys.readouterr().err


def test_export_refuses_a_strip_that_leaves_an_item_nameless_before_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--strip a`` on a checkpoint holding an item named exactly ``a`` wrote a tensor
    named "" (which no loader can look up); it is refused naming the item and the
    narrower prefix, and nothing is written. ``--strip a.`` strips the names under it."""
    state = {"a": torch.ones(2), "a.b": torch.zeros(3), "w": torch.full((4,), 2.0)}
    storage.save(state, str(tmp_path / "src"))
    out = tmp_path / "out"
    argv = ["export", str(tmp_path / "src"), str(out), "--format", "safetensors"]
    assert main([*argv, "--strip", "a"]) == 1
    err = capsys.readouterr().err
    assert "item 'a' would be named ''" in err and "strip 'a.'" in err and "--only" in err
    assert not out.exists()
    storage.save({"a.": torch.ones(2)}, str(tmp_path / "dotted"))
    fs = LocalFileSystem()
    with pytest.raises(ValueError, match=r"item 'a\.' would be named ''.*strip less"):
        export_safetensors(fs, str(tmp_path / "dotted"), fs, str(out), strip="a.")
    assert not out.exists()
    assert main([*argv, "--strip", "a."]) == 0
    files = _model_files(out)
    assert sorted(files) == ["a", "b", "w"]
    assert torch.equal(files["a"], state["a"]) and torch.equal(files["b"], state["a.b"])


def test_an_export_refused_for_its_source_leaves_the_model_it_would_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The model at DEST was uncommitted before the source was read: --overwrite from
    a checkpoint whose item is damaged, or that holds an item named "__metadata__",
    destroyed the model and exported nothing."""
    storage.save({"w": torch.ones(1024)}, str(tmp_path / "good"))
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "good"), str(out), "--format", "safetensors"]) == 0
    storage.save({"w": torch.zeros(1024), "__metadata__": torch.ones(2)}, str(tmp_path / "bad"))
    argv = ["export", str(tmp_path / "bad"), str(out), "--format", "safetensors", "--overwrite"]
    assert main(argv) == 1
    assert "'__metadata__'" in capsys.readouterr().err
    storage.save({"w": torch.zeros(1024)}, str(tmp_path / "bad"), overwrite=True)
    path, start, length = _item_bytes(tmp_path / "bad", "w")
    data = bytearray(path.read_bytes())
    data[start + length // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    converted = ["--dtype", "bf16"]  # loaded, so read whole before DEST is touched
    assert main([*argv, *converted]) == 1
    assert "'w'" in capsys.readouterr().err
    assert torch.equal(load_file(out / "model.safetensors")["w"], torch.ones(1024))


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_export_shows_progress_on_a_terminal_only(tmp_path: Path, monkeypatch: Any) -> None:
    """Export used to print nothing while it ran: a carriage-return line of bytes written
    of the total now goes to stderr when it is a terminal, never with --json."""
    state = {f"w{i}": torch.full((256,), float(i)) for i in range(4)}  # 1 KiB each
    storage.save(state, str(tmp_path / "src"))
    argv = ["export", str(tmp_path / "src"), "", "--format", "safetensors"]
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    argv[2] = str(tmp_path / "a")
    assert main([*argv, "--max-shard-size", "2048"]) == 0
    shown = terminal.getvalue()
    assert "\rexport: 1.0 KiB / 4.0 KiB (25%)" in shown
    assert "\rexport: 4.0 KiB / 4.0 KiB (100%)" in shown
    assert shown.endswith("\r\x1b[K")  # the line is cleared at the end
    for extra in (["--json"], ["--quiet"]):
        terminal.seek(0)
        terminal.truncate()
        argv[2] = str(tmp_path / extra[0].strip("-"))
        assert main([*argv, *extra]) == 0
        assert terminal.getvalue() == ""
    plain = io.StringIO()  # not a terminal: nothing either
    monkeypatch.setattr(sys, "stderr", plain)
    argv[2] = str(tmp_path / "b")
    assert main(argv) == 0
    assert plain.getvalue() == ""


def _sharded_zstd_worker(rank: int, store: str, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with gloo_group(rank, 2, store):
        mesh = init_device_mesh("cpu", (2,))
        full = _state()["model"]
        model = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
        storage.save({"model": model, "step": 5}, path, transforms=[ZStandard()])


def test_export_of_a_two_rank_sharded_zstd_checkpoint_gives_whole_tensors(
    tmp_path: Path,
) -> None:
    src = str(tmp_path / "sharded")
    mp.spawn(_sharded_zstd_worker, args=(str(tmp_path / "store"), src), nprocs=2, join=True)
    argv = ["export", src, str(tmp_path / "out"), "--format", "safetensors", "--strip", "model."]
    assert main(argv) == 0
    files = _model_files(tmp_path / "out")
    for key, value in _state()["model"].items():
        assert torch.equal(files[key.removeprefix("model.")], value), key


def test_export_of_an_incremental_checkpoint_resolves_its_base(tmp_path: Path) -> None:
    first = _state()
    storage.save(first, str(tmp_path / "a"))
    second = _state()
    second["model"]["layers.0.w"] = second["model"]["layers.0.w"] + 1  # the rest unchanged
    storage.save(second, str(tmp_path / "b"), base=str(tmp_path / "a"))
    argv = ["export", str(tmp_path / "b"), str(tmp_path / "out"), "--format", "safetensors"]
    assert main([*argv, "--only", "model.", "--strip", "model."]) == 0
    files = _model_files(tmp_path / "out")
    for key, value in second["model"].items():
        assert torch.equal(files[key.removeprefix("model.")], value), key


class _Watched(LocalFileSystem):
    """Local disk that records when each output file is published (renamed into place,
    or the index written) and holds each file's first write until two files are open
    at once, or a generous deadline passes."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.open = 0
        self.most_open = 0
        self.both_open = threading.Event()
        self.published: list[str] = []

    @contextlib.contextmanager
    def create_stream(self, path: str, mode: str, *, sync: bool = False) -> Iterator[IO[bytes]]:
        if mode != "wb":
            with super().create_stream(path, mode, sync=sync) as stream:
                yield stream
            return
        with self.lock:
            self.open += 1
            self.most_open = max(self.most_open, self.open)
            if self.open >= 2:
                self.both_open.set()
        try:
            if not self.both_open.wait(timeout=60):
                self.both_open.set()  # one file at a time: the rest need not wait
            with super().create_stream(path, mode, sync=sync) as stream:
                yield stream
        finally:
            with self.lock:
                self.open -= 1

    def rename(self, path: str, new_path: str) -> None:
        super().rename(path, new_path)
        with self.lock:
            self.published.append(os.path.basename(new_path))

    def rename_in(self, directory: str, name: str, new_name: str) -> None:
        super().rename_in(directory, name, new_name)  # a file published inside its folder
        with self.lock:
            self.published.append(os.path.basename(new_name))

    def write_atomic(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        super().write_atomic(path, data, exclusive=exclusive)
        with self.lock:
            self.published.append(os.path.basename(path))


def test_export_writes_files_concurrently_each_bit_exact_and_the_index_last(
    tmp_path: Path,
) -> None:
    """Files used to be written one after another, so each file's last parts uploaded
    while nothing else streamed. Two files are now written at once: both are open
    together, every file ends bit-exact, and the index (the commit) is published only
    after every file is."""
    state = {f"w{i}": torch.full((1024,), float(i)) for i in range(6)}  # 4 KiB each
    src = tmp_path / "src"
    storage.save(state, str(src))
    fs = _Watched()
    out = str(tmp_path / "out")
    src_fs, src_root = filesystem_from_url(str(src))
    result = export_safetensors(src_fs, src_root, fs, out, max_shard_size=8192)
    assert fs.most_open == 2 and len(result.files) == 4
    assert fs.published[-1] == "model.safetensors.index.json"
    assert sorted(fs.published[:-1]) == sorted(result.files[:-1])
    files = _model_files(Path(out))
    for key, value in state.items():
        assert torch.equal(files[key], value), key


@pytest.mark.parametrize("stock", [True, False], ids=["stock", "ours"])
def test_export_refuses_a_plain_item_claiming_more_bytes_than_it_stores_before_allocating(
    tmp_path: Path, stock: bool
) -> None:
    """The metadata's shapes are the checkpoint's claim: a 16-byte item whose metadata
    said 256 GiB used to be allocated as such (torch's unnamed "can't allocate memory",
    or on a machine that overcommits, a lazily mapped 256 GiB the load then touched)."""
    import pickle

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

    src = tmp_path / "src"
    if stock:
        dcp.save({"w": torch.ones(4)}, checkpoint_id=str(src), no_dist=True)
    else:
        storage.save({"w": torch.ones(4)}, str(src))
    metadata = pickle.loads((src / ".metadata").read_bytes())  # the test's own file
    big = torch.Size([1 << 36])
    props = metadata.state_dict_metadata["w"].properties
    chunk = ChunkStorageMetadata(torch.Size([0]), big)
    metadata.state_dict_metadata["w"] = TensorStorageMetadata(props, big, [chunk])
    (src / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(IntegrityError, match="item 'w' claims 68719476736 elements"):
        export_safetensors(LocalFileSystem(), str(src), LocalFileSystem(), str(tmp_path / "out"))
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_export_reads_no_more_of_an_item_than_its_archive_around_the_tensor(
    tmp_path: Path,
) -> None:
    """A direct tensor's checksum is solved from its item's archive head and tail, read
    whole. An item whose record (checksum included) claims 32 MiB after the tensor made
    the export hold those 32 MiB twice; such an item is now loaded, and the reader
    refuses it as it refuses any tensor item decoding past its archive."""
    import pickle
    import tracemalloc

    import crc32c

    from extensions.errors import UnsafeCheckpointError

    src = tmp_path / "src"
    storage.save({"w": torch.ones(1024)}, str(src))
    metadata = pickle.loads((src / ".metadata").read_bytes())  # the test's own file
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == "w")
    path = src / info.relative_path
    stored = path.read_bytes()[info.offset : info.offset + info.length] + bytes(32 << 20)
    info.offset, info.length = path.stat().st_size, len(stored)
    info.dcp_storage["crc32c"] = crc32c.crc32c(stored)
    with path.open("ab") as f:
        f.write(stored)
    (src / ".metadata").write_bytes(pickle.dumps(metadata))
    del stored
    tracemalloc.start()
    try:
        with pytest.raises(UnsafeCheckpointError, match="'w'.*more than its tensor and archive"):
            export_safetensors(LocalFileSystem(), str(src), LocalFileSystem(), str(tmp_path / "o"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20


def _damage(src: Path, fqn: str) -> None:
    path, start, length = _item_bytes(src, fqn)
    data = bytearray(path.read_bytes())
    data[start + length // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _loaded(url: str, names: Any, **options: Any) -> dict[str, torch.Tensor]:
    target = {name: torch.zeros(1024) for name in names}
    load_safetensors(target, url, **options)
    return target


@pytest.mark.parametrize("old", [None, 4096], ids=["over-one-file", "over-four-files"])
@pytest.mark.parametrize("new", [None, 4096], ids=["as-one-file", "as-four-files"])
def test_an_export_that_fails_over_a_model_leaves_it_and_the_next_replaces_it_whole(
    tmp_path: Path, old: int | None, new: int | None
) -> None:
    """Replacing a model in several files (or with several) removed its index before
    the new files were written over the old ones' names: an export that failed between
    files left no model. The new files take other names and the old model's go only
    once the new one is committed, so a failed export leaves the old model whole."""
    names = [f"w{i}" for i in range(4)]
    out = tmp_path / "out"
    storage.save({n: torch.full((1024,), float(i)) for i, n in enumerate(names)}, tmp_path / "a")
    export_safetensors(
        LocalFileSystem(), str(tmp_path / "a"), LocalFileSystem(), str(out), max_shard_size=old
    )
    storage.save({n: torch.full((1024,), -1.0) for n in names}, tmp_path / "b")
    _damage(tmp_path / "b", "w3")  # in the last file: the others are written first
    fs = LocalFileSystem()
    with pytest.raises(IntegrityError, match="'w3'"):
        export_safetensors(
            fs, str(tmp_path / "b"), fs, str(out), max_shard_size=new, overwrite=True
        )
    loaded = _loaded(str(out), names)
    assert all(torch.equal(loaded[n], torch.full((1024,), float(i))) for i, n in enumerate(names))
    storage.save({n: torch.full((1024,), -2.0) for n in names}, tmp_path / "b", overwrite=True)
    result = export_safetensors(
        fs, str(tmp_path / "b"), fs, str(out), max_shard_size=new, overwrite=True
    )
    assert all(torch.equal(t, torch.full((1024,), -2.0)) for t in _loaded(str(out), names).values())
    assert sorted(os.listdir(out)) == sorted(result.files)  # nothing of the old model left
    assert not verify_model(fs, str(out)).bad


def test_an_export_that_fails_over_a_sharded_model_in_a_bucket_leaves_it(
    endpoint: str, tmp_path: Path
) -> None:
    """As on local disk: the old model in the bucket loads until the new one's index is
    published, then only the new model's objects are there."""
    names = [f"w{i}" for i in range(4)]
    options = s3_options(endpoint)
    url = f"s3://{BUCKET}/replaced-{uuid.uuid4().hex[:8]}"
    fs, root = filesystem_from_url(url, options)
    storage.save({n: torch.full((1024,), float(i)) for i, n in enumerate(names)}, tmp_path / "a")
    local = LocalFileSystem()
    export_safetensors(local, str(tmp_path / "a"), fs, root, max_shard_size=4096)
    storage.save({n: torch.full((1024,), -1.0) for n in names}, tmp_path / "b")
    _damage(tmp_path / "b", "w3")
    with pytest.raises(IntegrityError, match="'w3'"):
        export_safetensors(
            local, str(tmp_path / "b"), fs, root, max_shard_size=4096, overwrite=True
        )
    loaded = _loaded(url, names, storage_options=options)
    assert all(torch.equal(loaded[n], torch.full((1024,), float(i))) for i, n in enumerate(names))
    storage.save({n: torch.full((1024,), -2.0) for n in names}, tmp_path / "b", overwrite=True)
    result = export_safetensors(
        local, str(tmp_path / "b"), fs, root, max_shard_size=4096, overwrite=True
    )
    loaded = _loaded(url, names, storage_options=options)
    assert all(torch.equal(t, torch.full((1024,), -2.0)) for t in loaded.values())
    assert sorted(fs.ls(root)) == sorted(result.files)


# Saves over sys.argv[1] and parks at the first removal of an old data file: killed
# there, the save is committed and the files of the checkpoint it replaced remain.
_SAVE_OVER_THEN_PARK = """
import sys
import torch
import storage
from tests.support.subprocess_jobs import park_on_rm_file
park_on_rm_file(".distcp", sys.argv[2])
storage.save({"f": torch.full((64,), 2.0), "i": torch.full((64,), 2)}, sys.argv[1])
"""


class _SavedOverOnFirstRead(LocalFileSystem):
    """The export's source: at its first read of a data file, another process saves
    over the checkpoint and is killed before it removed the old files."""

    def __init__(self, src: Path, mark: Path) -> None:
        super().__init__()
        self.src, self.mark, self.fired = src, mark, False

    def open_slice(self, path: str, offset: int, length: int) -> Any:
        if not self.fired and path.endswith(".distcp"):
            self.fired = True
            args = [str(self.src), str(self.mark)]
            kill_when_marked(_SAVE_OVER_THEN_PARK, args, self.mark, "the save's first removal")
        return super().open_slice(path, offset, length)


@pytest.mark.parametrize("size", [None, 300], ids=["one-file", "several-files"])
def test_an_export_whose_source_is_saved_over_meanwhile_commits_no_model(
    tmp_path: Path, size: int | None
) -> None:
    """A save over the source while it is exported, killed after its commit (the old
    data files stay until ``gc``). Before, the export returned a model that mixed both
    saves: ``i`` (streamed from the old files its plan named) of the first, ``f``
    (converted, so loaded, from the metadata there then) of the second. Now each file
    is published only while the source's metadata is still the one planned from."""
    src, out = tmp_path / "src", tmp_path / "hf"
    storage.save({"f": torch.full((64,), 1.0), "i": torch.full((64,), 1)}, str(src))
    fs = _SavedOverOnFirstRead(src, tmp_path / "parked")
    with pytest.raises(IntegrityError, match="was saved again while it was exported"):
        export_safetensors(
            fs, str(src), LocalFileSystem(), str(out), dtype=torch.bfloat16, max_shard_size=size
        )
    assert fs.fired
    assert not [p.name for p in out.iterdir() if "index" in p.name or p.name == "model.safetensors"]
