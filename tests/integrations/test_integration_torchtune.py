"""torchtune 0.6 (real package): its CheckpointClient and DistributedCheckpointer on
dcp-storage, to SeaweedFS.

A tiny model trains three epochs on CPU; torchtune's ``CheckpointClient`` (with
``enable_async_checkpointing``, as the distributed recipes use it) saves each epoch
asynchronously through our ``DistributedCheckpointer``; a fresh process resumes with
``load_distributed_checkpoint`` and finishes the fourth epoch bit for bit like an
uninterrupted run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

pytest.importorskip("torchtune", reason="pip install 'dcp-storage[torchtune]'")

from tests.support.servers import boto3_client, endpoint_with_bucket, list_keys, s3_options  # noqa: E402

BUCKET = "tune"
EPOCHS = 4


@pytest.fixture(scope="module")
def endpoint(request: Any) -> str:
    request.param = "seaweedfs"
    return endpoint_with_bucket(request, BUCKET)


def test_async_epochs_resume_bit_exact(endpoint: str, tmp_path: Any) -> None:
    from torchtune import training

    import storage
    from storage.ops.describe import describe

    url = f"s3://{BUCKET}/{tmp_path.name}"
    client = _client(url, s3_options(endpoint), resume=False)
    torch.manual_seed(0)
    model, optimizer = _model()
    for epoch in range(EPOCHS):
        _train_epoch(model, optimizer, epoch)
        if epoch + 1 < EPOCHS:
            client.save_checkpoint(model, optimizer, _progress(epoch + 1), epoch)
    client._get_dcp_checkpointer()._checkpoint_future.result()

    keys = list_keys(boto3_client(endpoint), BUCKET, f"{tmp_path.name}/")
    names = sorted({k.split("/")[1] for k in keys})
    assert names == [".dcp-latest", "step-1", "step-2"], keys  # keep_last=2, and the pointer
    fs, path = storage.filesystem_from_url(f"{url}/step-2", s3_options(endpoint))
    rows = describe(fs, path).items
    assert rows and all(row.transforms == ["stream.zstd/1"] for row in rows)

    out = tmp_path / "resumed.pt"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.integrations.test_integration_torchtune",
            json.dumps({"url": url, "options": s3_options(endpoint), "out": str(out)}),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed = torch.load(out)
    assert resumed["epochs_run"] == 3 and resumed["ckpt"][training.SEED_KEY] == 0
    for key, value in model.state_dict().items():
        assert torch.equal(value, resumed["model"][key]), key
    for index, state in optimizer.state_dict()["state"].items():
        for name, value in state.items():
            assert torch.equal(value, resumed["optim"]["state"][index][name]), (index, name)


def test_the_checkpointer_is_a_torchtune_component(tmp_path: Any) -> None:
    """Recipes build their checkpointer with ``config.instantiate`` and pass
    ``should_load_recipe_state``; the DCP contract (a state dict to load into) holds."""
    from omegaconf import OmegaConf
    from torchtune import config

    from storage.integrations.torchtune import DistributedCheckpointer

    checkpointer = config.instantiate(
        OmegaConf.create(
            {
                "_component_": "storage.integrations.torchtune.DistributedCheckpointer",
                "checkpoint_dir": str(tmp_path),
                "output_dir": str(tmp_path / "out"),
            }
        ),
        should_load_recipe_state=True,
    )
    assert isinstance(checkpointer, DistributedCheckpointer)
    state = {"w": torch.arange(6.0)}
    checkpointer.save_checkpoint(state, epoch=0, intermediate_checkpoint=True)
    target = {"w": torch.zeros(6)}
    assert checkpointer.load_checkpoint(target) is target and torch.equal(target["w"], state["w"])
    assert checkpointer._get_latest_intermediate_checkpoint() == str(tmp_path / "out" / "step-0")
    with pytest.raises(ValueError, match="State dict must be provided"):
        checkpointer.load_checkpoint()


def test_prepare_makes_the_staging_buffers_before_the_first_async_save(tmp_path: Any) -> None:
    """Before, the checkpointer owned its manager and gave no way to call its
    ``prepare``: the first asynchronous epoch made the staging buffers, and touching
    that fresh memory was its stall."""
    from storage.checkpoint import persist
    from storage.integrations.torchtune import DistributedCheckpointer

    handle = persist.worker()
    handle.close()  # a fresh pool: only this test's buffers in it
    try:
        checkpointer = DistributedCheckpointer(tmp_path, tmp_path / "out")
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 1))
        checkpointer.prepare({"model": model.state_dict()})
        assert handle.pool is not None
        segments = handle.pool.live()
        assert len(segments) == 1  # the 256x256 weight; the rest is small, sent by value
        assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
        with torch.no_grad():
            model[0].weight.add_(1.0)
        checkpointer.save_checkpoint({"model": model.state_dict()}, epoch=0, save_async=True)
        checkpointer._checkpoint_future.result()
        assert handle.pool.live() == segments  # the save copied into the prepared buffer
        target = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
        checkpointer.load_checkpoint(target)
        for key, value in model.state_dict().items():
            assert torch.equal(target["model"][key], value), key
    finally:
        handle.close()


# --- shared by the test and the resumed process ----------------------------------------


def _client(url: str, options: dict[str, Any], *, resume: bool) -> Any:
    from omegaconf import OmegaConf

    from storage.integrations.torchtune import CheckpointClient

    return CheckpointClient(
        OmegaConf.create(
            {
                "device": "cpu",
                "resume_from_checkpoint": resume,
                "enable_async_checkpointing": True,
                "dcp_storage": {
                    "url": url,
                    "storage_options": options,
                    "keep_last": 2,
                    "transforms": [{"_component_": "extensions.ZStandard", "level": 3}],
                },
            }
        )
    )


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_epoch(model: torch.nn.Module, optimizer: torch.optim.Optimizer, epoch: int) -> None:
    for step in range(2):
        data = torch.Generator().manual_seed(100 * epoch + step)
        x, y = torch.randn(32, 8, generator=data), torch.randn(32, 1, generator=data)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _progress(epochs_run: int) -> Any:
    from torchtune.training.checkpointing._checkpoint_client import TrainingProgress

    return TrainingProgress(
        seed=0,
        epochs_run=epochs_run,
        total_epochs=EPOCHS,
        max_steps_per_epoch=2,
        dataloader_state_dict={},
    )


def resume(spec: dict[str, Any]) -> None:
    from torchtune import training

    client = _client(spec["url"], spec["options"], resume=True)
    torch.manual_seed(1)
    model, optimizer = _model()
    ckpt = client.load_distributed_checkpoint(model, optimizer)
    epochs_run = ckpt[training.EPOCHS_KEY]
    for epoch in range(epochs_run, EPOCHS):
        _train_epoch(model, optimizer, epoch)
    torch.save(
        {
            "epochs_run": epochs_run,
            "ckpt": {k: v for k, v in ckpt.items() if not isinstance(v, dict)},
            "model": model.state_dict(),
            "optim": optimizer.state_dict(),
        },
        spec["out"],
    )


if __name__ == "__main__":
    resume(json.loads(sys.argv[1]))
