"""``cp`` and ``export`` of a checkpoint that lost a data file say so as ``load`` does:
the checkpoint, the file, an item it held and the fix, in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import storage
from storage.cli import main


@pytest.mark.parametrize(
    "command", [["cp"], ["export", "--format", "safetensors"]], ids=["cp", "export"]
)
def test_a_missing_data_file_is_named_with_its_item_and_the_fix(
    tmp_path: Path, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """They raised the bare "No such file or directory: PATH", naming neither the
    checkpoint as incomplete nor what to do."""
    src = tmp_path / "src"
    storage.save({"w": torch.ones(1024)}, str(src))
    (data,) = src.glob("*.distcp")
    data.unlink()
    assert main([command[0], str(src), str(tmp_path / "out"), *command[1:]]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"{src}: data file '{data.name}' (item 'w') is missing" in err, err
    assert "restore the file or re-save the checkpoint" in err
