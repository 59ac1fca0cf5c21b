"""``dcp-storage export SRC DEST --format safetensors``: a committed checkpoint (ours or
stock, encrypted with keys) to a Hub-layout model in a bucket or directory, filtered,
renamed, converted and cut into files, one file's tensors in memory at a time."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import storage
from extensions import AES256GCM
from storage.checkpoint.safetensors import load_safetensors
from storage.cli import main
from storage.ops import export as export_module
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
