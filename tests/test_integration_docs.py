"""The snippets of docs/integrations.md run as written, against SeaweedFS: the docs'
endpoint and bucket are swapped for the test server's, credentials come from the
environment as the docs advise."""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.servers import KEY, SECRET, boto3_client, endpoint_with_bucket, list_keys

DOC = Path(__file__).resolve().parent.parent / "docs" / "integrations.md"
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

    def of(section: str, language: str) -> list[str]:
        text = DOC.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
        found = re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)
        assert found, f"no {language} block under '## {section}'"
        return [
            b.replace("https://s3.example.com", endpoint).replace("s3://bucket/run1", run)
            for b in found
        ]

    of.run = run  # type: ignore[attr-defined]
    return of


def _committed(endpoint: str, run: str, marker: str) -> list[str]:
    prefix = run.split("/", 3)[3] + "/"
    return [k for k in list_keys(boto3_client(endpoint), BUCKET, prefix) if k.endswith(marker)]


def test_torchtitan(blocks: Any, endpoint: str) -> None:
    pytest.importorskip("torchtitan")
    from tests.test_integration_torchtitan import _containers, _TrainState

    namespace: dict[str, Any] = {}
    exec(blocks("torchtitan", "python")[0], namespace)
    model = torch.nn.Linear(4, 4)
    optimizers, schedulers = _containers(model)
    checkpointer = namespace["checkpoint"].build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": _TrainState()},
        sd_adapter=None,
    )
    assert checkpointer.save(curr_step=500)
    checkpointer.close()
    assert _committed(endpoint, blocks.run, "step-500/.metadata")


def test_torchtune(blocks: Any, endpoint: str) -> None:
    pytest.importorskip("torchtune")
    from omegaconf import OmegaConf

    from tests.test_integration_torchtune import _model, _progress, _train_epoch

    namespace: dict[str, Any] = {}
    exec(blocks("torchtune", "text")[0], namespace)  # the recipe's import line
    cfg = OmegaConf.create(blocks("torchtune", "yaml")[0])
    cfg.device = "cpu"
    model, optimizer = _model()
    _train_epoch(model, optimizer, 0)
    client = namespace["CheckpointClient"](cfg)
    client.save_checkpoint(model, optimizer, _progress(1), 0)
    client._get_dcp_checkpointer()._checkpoint_future.result()
    assert _committed(endpoint, blocks.run, "step-0/.metadata")
    fresh, fresh_optimizer = _model()
    namespace["CheckpointClient"](cfg).load_distributed_checkpoint(fresh, fresh_optimizer)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_torch_checkpointing(blocks: Any, endpoint: str) -> None:
    pytest.importorskip("torch_checkpointing")
    namespace: dict[str, Any] = {}
    exec(blocks("torch_checkpointing", "python")[0], namespace)
    assert namespace["loaded"]["step"] == 100
    assert _committed(endpoint, blocks.run, "step_100/.dcp-storage-commit")
