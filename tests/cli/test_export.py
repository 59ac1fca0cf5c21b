"""``dcp-storage export SRC DEST --format safetensors``: a committed checkpoint (ours or
stock, encrypted with keys) to a Hub-layout model in a bucket or directory, filtered,
renamed, converted and cut into files, one file's tensors in memory at a time."""

from __future__ import annotations

import io
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from safetensors.torch import load_file

import storage
from extensions import AES256GCM, ZStandard
from storage.checkpoint.safetensors import load_safetensors
from storage.cli import main
from storage.ops import export as export_module
from tests.support.distributed import gloo_group
from tests.support.servers import endpoint_with_bucket, s3_options
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


def test_export_loads_one_file_of_tensors_at_a_time(tmp_path: Path, monkeypatch: Any) -> None:
    """Peak memory is a file's tensors, not the model's: each load the export makes asks
    for one file's tensors only, never more bytes than --max-shard-size."""
    state = {f"w{i}": torch.full((256,), float(i)) for i in range(8)}  # 1 KiB each
    storage.save(state, str(tmp_path / "src"))
    loads: list[int] = []
    real_load = export_module.load

    def counting_load(target: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> None:
        loads.append(sum(t.nbytes for t in target.values()))
        real_load(target, *args, **kwargs)

    monkeypatch.setattr(export_module, "load", counting_load)
    argv = ["export", str(tmp_path / "src"), str(tmp_path / "out"), "--format", "safetensors"]
    assert main([*argv, "--max-shard-size", "2048"]) == 0
    assert loads == [2048] * 4
    files = _model_files(tmp_path / "out")
    assert all(torch.equal(files[k], v) for k, v in state.items())


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
