"""The snippets of docs/safetensors.md run as written, against SeaweedFS: the docs'
endpoint and bucket are swapped for the test server's, credentials come from the
environment as the docs advise."""

from __future__ import annotations

import json
import shlex
from typing import Any

import pytest
import torch

import storage
from storage.cli import main
from tests.support.doc_snippets import BUCKET, Snippets, snippets
from tests.support.servers import endpoint_with_bucket, s3_options


@pytest.fixture(scope="module")
def endpoint(request: Any) -> str:
    request.param = "seaweedfs"
    return endpoint_with_bucket(request, BUCKET)


@pytest.fixture
def blocks(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Snippets:
    return snippets("safetensors.md", endpoint, monkeypatch)


def test_save_then_load_snippets(blocks: Snippets) -> None:
    saved: dict[str, Any] = {}
    exec(blocks.one("Save a state dict as a model (DCP writer)", "python"), saved)
    loaded: dict[str, Any] = {}
    exec(blocks.one("Load a model from a bucket (DCP reader)", "python"), loaded)
    for key, value in saved["state_dict"].items():
        assert torch.equal(loaded["model"][key], value), key


def test_export_snippet(
    blocks: Snippets, endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    gen = torch.Generator().manual_seed(0)
    weights = {"embed.weight": torch.randn(16, 8, generator=gen), "norm": torch.ones(8)}
    source = {"model": weights, "optim": {"m": torch.zeros(3)}, "step": 3000}
    storage.save(source, f"{blocks.run}/step-3000", storage_options=s3_options(endpoint))
    command = blocks.one("Export a checkpoint (CLI)", "bash").replace("\\\n", " ")
    argv = shlex.split(command)
    assert argv[0] == "dcp-storage"
    assert main([*argv[1:], "--storage-option", f"endpoint_url={endpoint}"]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"] == 2
    out = {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in weights.items()}
    storage.load_safetensors(out, f"{blocks.run}/hf", storage_options=s3_options(endpoint))
    for key, value in weights.items():
        assert torch.equal(out[key], value.bfloat16()), key
