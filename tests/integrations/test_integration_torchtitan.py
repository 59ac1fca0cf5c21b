"""torchtitan 0.3 (real package): its checkpoint manager on dcp-storage, to SeaweedFS.

torchtitan's Trainer needs a tokenizer, a Hugging Face dataset and (for its models) an
accelerator, so these tests drive its checkpoint component directly, as the Trainer
does: ``CheckpointManager.Config(...).build(...)`` over torchtitan's own
``OptimizersContainer`` and ``LRSchedulersContainer``, a tiny model trained a few steps
on CPU, ``save(step)`` after each step, ``load(step=...)`` in a fresh process (gloo,
world size 1: torchtitan's async mode needs a process group).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

pytest.importorskip(
    "torchtitan", reason="pip install 'dcp-storage[torchtitan]' && pip install --no-deps torchtitan"
)

from tests.support.servers import boto3_client, endpoint_with_bucket, list_keys, s3_options  # noqa: E402

BUCKET = "titan"


@pytest.fixture(scope="module")
def endpoint(request: Any) -> str:
    request.param = "seaweedfs"
    return endpoint_with_bucket(request, BUCKET)


def _run(job: dict[str, Any]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integrations.test_integration_torchtitan", json.dumps(job)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_train_save_resume_bit_exact(endpoint: str, tmp_path: Any, async_mode: str) -> None:
    """8 steps saving every 2 (zstd) with keep_latest_k=2; a fresh process with a
    differently initialised model resumes from step 6 and reaches step 8 with the
    first run's exact parameters, optimizer and scheduler state. Retention ran after
    the last asynchronous save had landed (step-4 gone)."""
    import storage
    from storage.ops.describe import describe

    url = f"s3://{BUCKET}/{tmp_path.name}-{async_mode}"
    job = {"url": url, "options": s3_options(endpoint), "async_mode": async_mode}
    _run({**job, "seed": 0, "load_step": -1, "until": 8, "out": str(tmp_path / "a.pt")})
    keys = list_keys(boto3_client(endpoint), BUCKET, url.split("/", 3)[3] + "/")
    names = sorted({k.split("/")[1] for k in keys})
    # Retention through our manager; the latest-step pointer beside the steps.
    assert names == [".dcp-latest", "step-6", "step-8"], keys
    steps = names[1:]
    assert all(any(k.endswith(f"{s}/.metadata") for k in keys) for s in steps)
    fs, path = storage.filesystem_from_url(f"{url}/step-8", s3_options(endpoint))
    rows = describe(fs, path).items
    assert rows and all(row.transforms == ["stream.zstd/1"] for row in rows), rows

    _run({**job, "seed": 1, "load_step": 6, "until": 8, "out": str(tmp_path / "b.pt")})
    first, resumed = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert resumed["loaded"] and resumed["start"] == 7 and first["start"] == 1
    for part in ("model", "optim"):
        assert first[part].keys() == resumed[part].keys()
        for key, value in first[part].items():
            other = resumed[part][key]
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            assert same, (part, key)
    assert first["lr"] == resumed["lr"]


def test_keep_latest_k_applies_after_the_last_step(endpoint: str, tmp_path: Any) -> None:
    """torchtitan's save() returns right after the last step's save, before its purge:
    with keep_latest_k=2, steps 2, 4 and the last step 5 all used to stay in the bucket
    after close()."""
    url = f"s3://{BUCKET}/{tmp_path.name}"
    *_, checkpointer = _components(torch.nn.Linear(2, 2), url, s3_options(endpoint), "disabled")
    for step in (2, 4):
        assert checkpointer.save(curr_step=step)
    assert checkpointer.save(curr_step=5, last_step=True)
    checkpointer.close()  # the purge thread drains its queue before it stops
    keys = list_keys(boto3_client(endpoint), BUCKET, url.split("/", 3)[3] + "/")
    assert sorted({k.split("/")[1] for k in keys}) == [".dcp-latest", "step-4", "step-5"], keys


def test_a_step_that_is_not_committed_is_refused(endpoint: str, tmp_path: Any) -> None:
    url = f"s3://{BUCKET}/{tmp_path.name}"
    *_, checkpointer = _components(torch.nn.Linear(2, 2), url, s3_options(endpoint), "disabled")
    assert checkpointer.load() is False  # nothing there: a fresh start
    with pytest.raises(FileNotFoundError, match=r"step-5 is not a committed checkpoint.*none"):
        checkpointer.load(step=5)
    checkpointer.close()


def test_a_save_at_a_linked_step_is_refused(tmp_path: Any) -> None:
    """A ``step-N`` under the folder that is a symbolic link (a shared checkpoint linked
    in) is never saved over: torchtitan names the step, and writing there replaced the
    linked checkpoint for everyone using it."""
    import storage

    shared = tmp_path / "shared"
    storage.save({"w": torch.ones(3)}, shared)
    before = {p.name: p.read_bytes() for p in shared.iterdir()}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "step-2").symlink_to(shared, target_is_directory=True)
    model = torch.nn.Linear(2, 2)
    *_, checkpointer = _components(model, str(tmp_path / "run"), {}, "disabled")
    with pytest.raises(storage.UnsafeCheckpointError, match=r"step-2 is a symbolic link"):
        checkpointer.save(curr_step=2)
    assert checkpointer.save(curr_step=4)
    checkpointer.close()
    assert {p.name: p.read_bytes() for p in shared.iterdir()} == before


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_an_async_manager_makes_the_models_staging_buffers_when_built(
    tmp_path: Any, async_mode: str
) -> None:
    """Before, the persist worker's staging buffers were made by the first asynchronous
    save (its stall paid the first touch of fresh memory); now building the manager with
    ``async_mode="async"`` makes those of the model's tensors, and saves nothing. A
    synchronous manager makes none."""
    out = tmp_path / "probe.json"
    _run({"probe": True, "url": str(tmp_path / "run"), "async_mode": async_mode, "out": str(out)})
    probe = json.loads(out.read_text())
    assert probe["saved"] == []
    # The 256x256 weight goes through shared memory; the small tensors go by value.
    assert probe["segments"] == (1 if async_mode == "async" else 0)


def test_secrets_stay_out_of_the_logged_config() -> None:
    """The Trainer logs ``config.to_dict()`` as JSON and writes it beside the run."""
    from storage.integrations.torchtitan import CheckpointManager

    config = CheckpointManager.Config(
        storage_options={"key": "AKIDEXAMPLE", "secret": "wJalrXUtnFEMI"},
        keys={"k1": b"\x01" * 32},
    )
    text = json.dumps(config.to_dict()) + repr(config)
    assert "AKIDEXAMPLE" not in text and "wJalrXUtnFEMI" not in text and "\\u0001" not in text
    assert config.to_dict()["storage_options"] == ["key", "secret"]


# --- the job, run in a fresh process ---------------------------------------------------


class _TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def _containers(model: torch.nn.Module) -> Any:
    """torchtitan's optimizer and LR scheduler containers, built from their configs."""
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    group = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})
    optimizers = OptimizersContainer(
        OptimizersContainer.Config(param_groups=[group], implementation="for-loop"),
        model_parts=[model],
    )
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=8
    )
    return optimizers, schedulers


def _components(model: torch.nn.Module, url: str, options: dict[str, Any], async_mode: str) -> Any:
    """The containers and our checkpoint manager, built as the Trainer builds them."""
    import extensions
    from storage.integrations.torchtitan import CheckpointManager

    optimizers, schedulers = _containers(model)
    train_state = _TrainState()
    checkpointer = CheckpointManager.Config(
        enable=True,
        folder=url,
        interval=2,
        keep_latest_k=2,
        async_mode=async_mode,
        storage_options=options,
        transforms=[extensions.ZStandard(level=3)],
    ).build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
    )
    return optimizers, schedulers, train_state, checkpointer


def job(spec: dict[str, Any]) -> None:
    import torch.distributed as dist

    # A file rendezvous beside the job's output: no port another process could take.
    store = spec["out"] + ".store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    if spec.get("probe"):
        _probe(spec)
        dist.destroy_process_group()
        return
    torch.manual_seed(spec["seed"])
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizers, schedulers, train_state, checkpointer = _components(
        model, spec["url"], spec["options"], spec["async_mode"]
    )
    loaded = checkpointer.load(step=spec["load_step"])
    start = train_state.step + 1
    for step in range(start, spec["until"] + 1):
        data = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, 8, generator=data), torch.randn(32, 1, generator=data)
        optimizers.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizers.step()
        schedulers.step()
        train_state.step = step
        checkpointer.save(curr_step=step)
    checkpointer.maybe_wait_for_saving()
    checkpointer.close()
    torch.save(
        {
            "loaded": loaded,
            "start": start,
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": optimizers.state_dict(),
            "lr": schedulers.state_dict(),
        },
        spec["out"],
    )
    dist.destroy_process_group()


def _probe(spec: dict[str, Any]) -> None:
    """Build the manager over a model with one tensor large enough for shared memory and
    record the persist worker's staging segments, before any save."""
    from storage.checkpoint import persist

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 1))
    checkpointer = _components(model, spec["url"], {}, spec["async_mode"])[3]
    pool = persist.worker().pool
    segments = [] if pool is None else pool.live()
    saved = sorted(os.listdir(spec["url"])) if os.path.isdir(spec["url"]) else []
    checkpointer.close()
    with open(spec["out"], "w") as f:
        json.dump({"segments": len(segments), "saved": saved}, f)


if __name__ == "__main__":
    job(json.loads(sys.argv[1]))
