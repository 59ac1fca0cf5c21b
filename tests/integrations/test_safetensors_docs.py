"""The snippets of docs/safetensors.md run as written, against SeaweedFS: the docs'
endpoint and bucket are swapped for the test server's, credentials come from the
environment as the docs advise."""

from __future__ import annotations

import json
import re
import shlex
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import storage
from storage.cli import main
from tests.support.servers import KEY, SECRET, endpoint_with_bucket, s3_options

DOC = Path(__file__).resolve().parents[2] / "docs" / "safetensors.md"
BUCKET = "docs"


@pytest.fixture(scope="module")
def endpoint(request: Any) -> str:
    request.param = "seaweedfs"
    return endpoint_with_bucket(request, BUCKET)


@pytest.fixture
def blocks(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    run = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"

    def of(section: str, language: str) -> str:
        text = DOC.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
        found = re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)
        assert len(found) == 1, f"one {language} block under '## {section}'"
        return str(
            found[0].replace("https://s3.example.com", endpoint).replace("s3://bucket/run1", run)
        )

    of.run = run  # type: ignore[attr-defined]
    return of


def test_save_then_load_snippets(blocks: Any) -> None:
    saved: dict[str, Any] = {}
    exec(blocks("Save a state dict as a model (DCP writer)", "python"), saved)
    loaded: dict[str, Any] = {}
    exec(blocks("Load a model from a bucket (DCP reader)", "python"), loaded)
    for key, value in saved["state_dict"].items():
        assert torch.equal(loaded["model"][key], value), key


def test_export_snippet(blocks: Any, endpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    gen = torch.Generator().manual_seed(0)
    weights = {"embed.weight": torch.randn(16, 8, generator=gen), "norm": torch.ones(8)}
    source = {"model": weights, "optim": {"m": torch.zeros(3)}, "step": 3000}
    storage.save(source, f"{blocks.run}/step-3000", storage_options=s3_options(endpoint))
    command = blocks("Export a checkpoint (CLI)", "bash").replace("\\\n", " ")
    argv = shlex.split(command)
    assert argv[0] == "dcp-storage"
    assert main([*argv[1:], "--storage-option", f"endpoint_url={endpoint}"]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"] == 2
    out = {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in weights.items()}
    storage.load_safetensors(out, f"{blocks.run}/hf", storage_options=s3_options(endpoint))
    for key, value in weights.items():
        assert torch.equal(out[key], value.bfloat16()), key
