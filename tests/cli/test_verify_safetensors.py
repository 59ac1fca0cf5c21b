"""``dcp-storage verify`` on a Hub-layout safetensors model (ours or anyone's): headers
and index checked as the reader checks them, each tensor's bytes against the CRC-32C our
writer records, a damaged tensor named with its file, exit status 1."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from storage.checkpoint.safetensors import SafetensorsWriter
from storage.cli import main


def _model() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {
        "embed.weight": torch.randn(32, 16, generator=gen),
        "layers.0.w": torch.randn(16, 16, generator=gen).to(torch.bfloat16),
        "layers.0.b": torch.randn(16, generator=gen),
    }


def _save(folder: Path) -> None:
    writer = SafetensorsWriter(folder, max_shard_size=1100)
    dcp.save(_model(), storage_writer=writer, no_dist=True)


def test_verify_passes_a_model_and_names_the_file_and_tensor_of_a_damaged_byte(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """verify used to answer "no checkpoint" for a safetensors model; now it checks it
    and a flipped byte in one tensor fails it, naming that file and tensor."""
    _save(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: safetensors model") and "3 tensors" in out
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    file = index["weight_map"]["layers.0.w"]
    path = tmp_path / file
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    begin = 8 + length + header["layers.0.w"]["data_offsets"][0]
    data[begin + 3] ^= 0x01
    path.write_bytes(bytes(data))
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"{file}: layers.0.w: checksum mismatch" in out and out.startswith("BAD: 1 of 3")
    assert main(["verify", str(tmp_path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["valid"] is False and report["format"] == "safetensors"
    assert list(report["bad"]) == [f"{file}: layers.0.w"]


def test_verify_of_a_model_without_checksums_checks_its_structure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_file(_model(), str(tmp_path / "model.safetensors"))  # the library's own writer
    assert main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK:") and "no checksums recorded for 3 tensors" in out
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 2**63) + b"{}")
    assert main(["verify", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.safetensors" in err and "claims" in err


def test_verify_refuses_an_index_that_names_a_tensor_its_file_lacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(tmp_path)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))
    index["weight_map"]["ghost"] = files[0]
    index_path.write_text(json.dumps(index))
    assert main(["verify", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "'ghost'" in err and files[0] in err


def _damaged_one_tensor_model(folder: Path, name: str) -> None:
    """A one-tensor model named ``name`` in ``folder``, a byte of its data flipped."""
    dcp.save({name: torch.ones(64)}, storage_writer=SafetensorsWriter(folder), no_dist=True)
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_damaged_tensor_whose_name_holds_a_line_break_cannot_forge_a_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tensor's name is the model's to choose: one holding a line break used to print
    as two lines of the report, the second one the name's forged "OK: ..." line."""
    name = "w\nOK: safetensors model forged"
    _damaged_one_tensor_model(tmp_path, name)
    assert main(["verify", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("BAD: 1 of 1") and not any(line.startswith("OK:") for line in lines)
    assert "model.safetensors: w\\nOK: safetensors model forged: checksum mismatch" in lines[1]


def test_a_damaged_tensor_with_a_name_of_a_megabyte_is_named_in_a_bounded_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tensor's name (up to the header's size) went whole into verify's line."""
    name = "w" * (1 << 20)
    _damaged_one_tensor_model(tmp_path, name)
    assert main(["verify", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert "checksum mismatch" in lines[1] and len(lines[1]) < 1000


@pytest.mark.parametrize("command", ["inspect", "cp"])
def test_the_commands_that_read_dcp_checkpoints_point_a_model_at_verify(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """inspect and cp of a safetensors model answered that the folder had no .metadata
    ("an interrupted save, or not a checkpoint directory"), which it is neither."""
    _save(tmp_path / "model")
    argv = [command, str(tmp_path / "model")] + (
        [str(tmp_path / "copy")] if command == "cp" else []
    )
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "holds a safetensors model" in err and f"dcp-storage verify {tmp_path / 'model'}" in err
