"""Hugging Face integration (storage/integrations/huggingface.py) with the real Trainer and
Accelerator: a tiny GPT-2 built from its config (no download) trains on CPU, its
checkpoint folders drain to SeaweedFS, the local run directory is deleted, and a fresh
run resumes from the bucket and must end bit-exact where the uninterrupted run ends."""

from __future__ import annotations

import hashlib
import importlib
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="pip install 'dcp-storage[huggingface]'")

from accelerate import Accelerator  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from extensions import ZStandard  # noqa: E402
from extensions.errors import MissingDependencyError  # noqa: E402
from storage.integrations.huggingface import (  # noqa: E402
    AcceleratorCheckpoints,
    StorageTrainerCallback,
)
from tests.support.servers import boto3_client, endpoint_with_bucket, list_keys, s3_options  # noqa: E402
from tests.support.trees import assert_tree_equal  # noqa: E402

BUCKET = "huggingface"


@pytest.fixture(scope="module", params=["seaweedfs"])
def endpoint(request: pytest.FixtureRequest) -> str:
    return endpoint_with_bucket(request, BUCKET)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a busy machine the threads'
    waits cost ~20x (a 6-step run: 7 s with 2 threads, 0.35 s with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(2)
        self.ids = torch.randint(0, 128, (24, 16), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer(model: GPT2LMHeadModel, output_dir: Path, callback: StorageTrainerCallback) -> Trainer:
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=6,
        save_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        logging_steps=100,
        seed=0,
    )
    return Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[callback])


def _digests(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_trainer_drains_to_the_bucket_and_resumes_bit_exact(endpoint: str, tmp_path: Path) -> None:
    root = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    options = {"storage_options": s3_options(endpoint), "transforms": [ZStandard()]}
    run = tmp_path / "run"
    straight = _trainer(_model(0), run, StorageTrainerCallback(root, keep_last=2, **options))
    straight.train()
    saved = _digests(run / "checkpoint-4")
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= set(saved)
    keys = list_keys(boto3_client(endpoint), BUCKET, root.split("/", 3)[3] + "/")
    names = sorted({k.split("/")[1] for k in keys})
    assert names == [".dcp-latest", "step-4", "step-6"]  # keep_last=2, and the pointer

    shutil.rmtree(run)  # the machine is gone: only the bucket remains
    callback = StorageTrainerCallback(root, **options)
    again = _trainer(_model(1), tmp_path / "new", callback)
    path = callback.restore(tmp_path / "new", step=4)
    assert path == str(tmp_path / "new" / "checkpoint-4")
    assert _digests(Path(path)) == saved  # every file back, byte for byte
    again.train(resume_from_checkpoint=path)

    assert again.state.global_step == straight.state.global_step == 6
    assert_tree_equal(again.model.state_dict(), straight.model.state_dict())
    assert_tree_equal(
        again.optimizer.state_dict()["state"], straight.optimizer.state_dict()["state"]
    )
    assert callback.restore(tmp_path / "latest").endswith("checkpoint-6")  # the newest


def test_without_transformers_the_import_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "storage.integrations.huggingface")
    with pytest.raises(MissingDependencyError, match=r"pip install 'dcp-storage\[huggingface\]'"):
        importlib.import_module("storage.integrations.huggingface")


def _accelerate_run(seed: int) -> tuple[Accelerator, Any, Any, Any]:
    accelerator = Accelerator(cpu=True)
    model = _model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    return accelerator, *accelerator.prepare(model, optimizer, scheduler)


def _steps(
    accelerator: Accelerator, model: Any, optimizer: Any, scheduler: Any, batches: Any
) -> None:
    for batch in batches:
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def test_accelerator_save_state_drains_and_load_state_resumes_bit_exact(
    endpoint: str, tmp_path: Path
) -> None:
    root = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    batches = _Tokens().ids.split(4)
    accelerator, model, optimizer, scheduler = _accelerate_run(0)
    ckpts = AcceleratorCheckpoints(root, storage_options=s3_options(endpoint))  # background
    _steps(accelerator, model, optimizer, scheduler, batches[:3])
    folder = ckpts.save_state(accelerator, tmp_path / "local" / "s", step=3)
    first = _digests(Path(folder))
    _steps(accelerator, model, optimizer, scheduler, batches[3:])
    # The same folder again: save_state waits for step 3's upload before Accelerate
    # rewrites its files (the upload reads them through memory maps).
    ckpts.save_state(accelerator, tmp_path / "local" / "s", step=6)
    ckpts.wait()
    shutil.rmtree(folder)
    assert ckpts.checkpoints.steps() == [3, 6]

    accelerator2, model2, optimizer2, scheduler2 = _accelerate_run(1)
    assert ckpts.load_state(accelerator2, tmp_path / "restored", step=3) == 3
    assert _digests(tmp_path / "restored" / "checkpoint_3") == first
    _steps(accelerator2, model2, optimizer2, scheduler2, batches[3:])
    assert_tree_equal(model2.state_dict(), model.state_dict())
    assert_tree_equal(optimizer2.state_dict()["state"], optimizer.state_dict()["state"])
    assert scheduler2.state_dict() == scheduler.state_dict()
