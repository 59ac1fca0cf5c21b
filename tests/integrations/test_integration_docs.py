"""The snippets of docs/integrations.md run as written, against SeaweedFS: the docs'
endpoint and bucket are swapped for the test server's, credentials come from the
environment as the docs advise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.doc_snippets import BUCKET, Snippets, snippets
from tests.support.servers import boto3_client, endpoint_with_bucket, list_keys


@pytest.fixture(scope="module")
def endpoint(request: Any) -> str:
    request.param = "seaweedfs"
    return endpoint_with_bucket(request, BUCKET)


@pytest.fixture
def blocks(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Snippets:
    return snippets("integrations.md", endpoint, monkeypatch)


def _committed(endpoint: str, run: str, marker: str) -> list[str]:
    prefix = run.split("/", 3)[3] + "/"
    return [k for k in list_keys(boto3_client(endpoint), BUCKET, prefix) if k.endswith(marker)]


def test_torchtitan(blocks: Snippets, endpoint: str) -> None:
    pytest.importorskip("torchtitan")
    from tests.integrations.test_integration_torchtitan import _containers, _TrainState

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


def test_torchtune(blocks: Snippets, endpoint: str) -> None:
    pytest.importorskip("torchtune")
    from omegaconf import OmegaConf

    from tests.integrations.test_integration_torchtune import _model, _progress, _train_epoch

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


def test_torch_checkpointing(blocks: Snippets, endpoint: str) -> None:
    pytest.importorskip("torch_checkpointing")
    namespace: dict[str, Any] = {}
    exec(blocks("torch_checkpointing", "python")[0], namespace)
    assert namespace["loaded"]["step"] == 100
    assert _committed(endpoint, blocks.run, "step_100/.dcp-storage-commit")


def test_torchft(blocks: Snippets, endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torchft")
    from datetime import timedelta

    import torch.distributed as dist
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for name, value in {
        "TORCHFT_LIGHTHOUSE": lighthouse.address(),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        monkeypatch.setenv(name, value)
    namespace: dict[str, Any] = {}
    try:
        exec(blocks("torchft", "python")[0], namespace)
        transport, model = namespace["transport"], namespace["model"]
        sent = {"user": {"default": model.state_dict()}, "torchft": {"step": 3}}
        transport.send_checkpoint([1], 3, sent, timedelta(seconds=60))
        assert _committed(endpoint, blocks.run, "ft/replica_0/replica-0/step-3/.metadata")
        got = transport.recv_checkpoint(0, transport.metadata(), 3, timedelta(seconds=60))
        assert got["torchft"] == {"step": 3}
        assert all(torch.equal(v, got["user"]["default"][k]) for k, v in model.state_dict().items())
    finally:
        if "manager" in namespace:
            namespace["manager"].shutdown(wait=False)
        lighthouse.shutdown()


def test_lightning(
    blocks: Snippets, endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The snippet as written: its Trainers set max_epochs (without it Lightning trains
    1000 epochs and ModelCheckpoint keeps only the newest), and its
    ``ckpt_path="last"`` resumes after the first fit's 8 steps. With Lightning's own
    ModelCheckpoint, "last" found nothing in the bucket and the resumed fit trained
    from step 0 with only a warning."""
    pytest.importorskip("lightning")
    import functools

    import lightning.pytorch as pl

    from tests.integrations.test_integration_lightning import TinyModule, _data

    class Counting(TinyModule):
        steps = 0

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            Counting.steps += 1
            return super().training_step(batch, batch_idx)

    # ModelCheckpoint reaches the bucket through fsspec with the standard variables (as
    # the docs say); the Trainers are kept quiet: no logger, no progress bar.
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.chdir(tmp_path)
    quiet = functools.partial(
        pl.Trainer,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    monkeypatch.setattr(pl, "Trainer", quiet)
    code = blocks("PyTorch Lightning", "python")[0].replace(
        '{"endpoint_url": ...}', "{'endpoint_url': ENDPOINT}"
    )
    torch.set_num_threads(1)
    namespace: dict[str, Any] = {"ENDPOINT": endpoint, "model": Counting(), "data": _data()}
    exec(code, namespace)
    # save_top_k=1: the resumed fit's epoch=2-step=12 replaced the first fit's epoch=1-step=8.
    assert _committed(endpoint, blocks.run, "epoch=2-step=12.ckpt/.metadata")
    assert _committed(endpoint, blocks.run, "/last.ckpt/.metadata")
    assert str(namespace["resumed"].ckpt_path).endswith("/last.ckpt/.metadata")
    assert Counting.steps == 8 + 4  # two epochs, then the third one only
    assert namespace["resumed"].global_step == 12


def test_accelerate(
    blocks: Snippets, endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from tests.integrations.test_integration_huggingface import _model

    # The endpoint reaches the client only through the snippet's storage_options: with no
    # AWS_ENDPOINT_URL, a snippet without them would go to AWS and fail.
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.chdir(tmp_path)
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(_model(0))
    namespace: dict[str, Any] = {"accelerator": accelerator, "step": 7}
    code = [b for b in blocks("Hugging Face: Transformers Trainer and Accelerate", "python")]
    exec(code[1], namespace)  # save_state, then (as on a new machine) load_state
    assert namespace["step"] == 7
    assert _committed(endpoint, blocks.run, "step-7/.metadata")
    assert (tmp_path / "restored" / "checkpoint_7").is_dir()
    assert model is not None
