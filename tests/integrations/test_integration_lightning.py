"""PyTorch Lightning integration (storage/integrations/lightning/) with the real Trainer.

A tiny LightningModule trains on CPU with ``StorageCheckpointIO`` and ``ModelCheckpoint``
writing to SeaweedFS; a fresh Trainer resumes from the bucket and must end bit-exact
where an uninterrupted run ends (weights and optimizer state). The sharded path runs
the real ``ModelParallelStrategy`` (FSDP2 over gloo) on two CPU ranks.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import io
import os
import sys
import types
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("lightning", reason="pip install 'dcp-storage[lightning]'")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from extensions import ZStandard  # noqa: E402
from extensions.errors import (  # noqa: E402
    CheckpointNotFoundError,
    MissingDependencyError,
    UnsafeCheckpointError,
)
from storage import FsspecFileSystem, filesystem_from_url  # noqa: E402
from storage.checkpoint import siblings  # noqa: E402
from storage.checkpoint.layout import is_committed  # noqa: E402
from storage.integrations import _tree  # noqa: E402
from storage.integrations.lightning import (  # noqa: E402
    PREFIX,
    StorageCheckpointIO,
    StorageFSDPStrategy,
    StorageModelCheckpoint,
    StorageModelParallelStrategy,
)
from tests.support.distributed import gloo_group  # noqa: E402
from tests.support.servers import KEY, SECRET, boto3_client, endpoint_with_bucket, list_keys  # noqa: E402
from tests.support.trees import assert_tree_equal  # noqa: E402

BUCKET = "lightning"


@pytest.fixture(scope="module", params=["seaweedfs"])
def endpoint(request: pytest.FixtureRequest) -> str:
    return endpoint_with_bucket(request, BUCKET)


@pytest.fixture
def bucket_env(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """ModelCheckpoint lists and checks the bucket through fsspec (s3fs) on its own: it
    reaches SeaweedFS through the standard AWS variables. Our plugin gets explicit options."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return {"endpoint_url": endpoint, "key": KEY, "secret": SECRET}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a busy machine the threads'
    waits cost ~20x (a 6-step run: 7 s with 2 threads, 0.35 s with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclasses.dataclass
class Hparams:
    lr: float


class TinyModule(pl.LightningModule):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return [optimizer], [scheduler]


def _data() -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(
        torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)
    )
    return torch.utils.data.DataLoader(ds, batch_size=8)  # 4 steps per epoch, fixed order


def _trainer(epochs: int, **options: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def _optimizer_state(trainer: pl.Trainer) -> dict[str, Any]:
    return trainer.optimizers[0].state_dict()


def test_fit_to_bucket_then_resume_in_a_fresh_trainer_is_bit_exact(
    bucket_env: dict[str, Any], endpoint: str
) -> None:
    root = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    plugin = StorageCheckpointIO(storage_options=bucket_env, transforms=[ZStandard()])
    saves = ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=1, every_n_epochs=1)
    straight = TinyModule()
    trainer = _trainer(3, plugins=[plugin], callbacks=[saves])
    trainer.fit(straight, _data())

    # save_top_k=1: ModelCheckpoint removed epoch 0 and 1 through remove_checkpoint.
    keys = list_keys(boto3_client(endpoint), BUCKET, root.split("/", 3)[3] + "/")
    assert {k.split("/")[1] for k in keys} == {"epoch=2.ckpt"}
    assert any(k.endswith("/.metadata") for k in keys)

    # The same run interrupted after epoch 1: resume it from the bucket in a new Trainer.
    first = ModelCheckpoint(dirpath=root + "/a", filename="{epoch}", save_top_k=-1)
    _trainer(2, plugins=[plugin], callbacks=[first]).fit(TinyModule(), _data())
    resumed = TinyModule(seed=5)  # other weights: all must come from the checkpoint
    again = _trainer(3, plugins=[plugin], enable_checkpointing=False)
    again.fit(resumed, _data(), ckpt_path=f"{root}/a/epoch=1.ckpt")

    assert again.global_step == trainer.global_step == 12
    assert_tree_equal(resumed.state_dict(), straight.state_dict())
    assert_tree_equal(_optimizer_state(again), _optimizer_state(trainer))
    assert again.lr_scheduler_configs[0].scheduler.state_dict() == (
        trainer.lr_scheduler_configs[0].scheduler.state_dict()
    )


def test_ckpt_path_last_in_a_bucket_resumes_from_the_last_checkpoint(
    bucket_env: dict[str, Any],
) -> None:
    """``fit(ckpt_path="last")`` with an ``s3://`` dirpath: Lightning's ModelCheckpoint
    listed the bucket without the URL scheme, found no last checkpoint, warned, and the
    fit trained again from step 0. StorageModelCheckpoint resumes from last.ckpt."""
    root = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    plugin = StorageCheckpointIO(storage_options=bucket_env)
    straight = TinyModule()
    trainer = _trainer(3, plugins=[plugin], enable_checkpointing=False)
    trainer.fit(straight, _data())

    first = StorageModelCheckpoint(dirpath=root, save_last=True)
    _trainer(2, plugins=[plugin], callbacks=[first]).fit(TinyModule(), _data())
    resumed = TinyModule(seed=5)
    again = StorageModelCheckpoint(dirpath=root, save_last=True)
    later = _trainer(3, plugins=[plugin], callbacks=[again])
    later.fit(resumed, _data(), ckpt_path="last")

    assert later.ckpt_path == f"{root}/last.ckpt/.metadata"
    assert later.global_step == 12
    assert_tree_equal(resumed.state_dict(), straight.state_dict())
    assert_tree_equal(_optimizer_state(later), _optimizer_state(trainer))


def test_ckpt_path_last_without_a_last_checkpoint_in_the_bucket_raises(
    bucket_env: dict[str, Any],
) -> None:
    """Checkpoints in the bucket but none saved as last (save_last unset): Lightning
    warned and the fit trained from step 0 beside them; now it stops, naming them."""
    root = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    plugin = StorageCheckpointIO(storage_options=bucket_env)
    saves = StorageModelCheckpoint(dirpath=root)
    _trainer(1, plugins=[plugin], callbacks=[saves]).fit(TinyModule(), _data())
    later = _trainer(2, plugins=[plugin], callbacks=[StorageModelCheckpoint(dirpath=root)])
    with pytest.raises(CheckpointNotFoundError, match=r"epoch=0-step=4\.ckpt.*save_last=True"):
        later.fit(TinyModule(), _data(), ckpt_path="last")
    assert later.global_step == 0


@pytest.mark.parametrize(
    "hidden",
    [
        pytest.param({"last.ckpt", "last-v2.ckpt"}, id="the-newest-missed"),
        pytest.param({"last.ckpt", "last-v1.ckpt", "last-v2.ckpt"}, id="every-last-missed"),
    ],
)
def test_ckpt_path_last_asks_for_the_last_checkpoints_a_listing_misses(
    monkeypatch: pytest.MonkeyPatch, hidden: set[str]
) -> None:
    """A listing of the dirpath that lags or misses objects (an eventually consistent
    LIST) in a resumed job, which never saw those saves: the last checkpoints it missed
    were not offered, so the fit resumed from an older last-v1.ckpt, or was refused for
    want of a last checkpoint with every last one missed. Each is asked for by name now;
    an uncommitted one (a save that did not finish) is never offered."""
    root = f"memory://{uuid.uuid4().hex}/run"  # fsspec's: Lightning checks the dirpath too
    plugin = StorageCheckpointIO()
    fs, location = filesystem_from_url(root)
    for name in ("last.ckpt", "last-v1.ckpt", "last-v2.ckpt", "epoch=0-step=4.ckpt"):
        plugin.save_checkpoint({"epoch": 0, "w": torch.ones(2)}, f"{root}/{name}")
        siblings.forget(fs, fs.concat_path(location, name))  # as a resumed job knows them
    fs.write_atomic(fs.concat_path(location, "last-v3.ckpt/__0_0.distcp"), b"unfinished")
    listing = FsspecFileSystem.ls
    monkeypatch.setattr(
        FsspecFileSystem,
        "ls",
        lambda self, path: [n for n in listing(self, path) if n not in hidden],
    )
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(checkpoint_io=plugin))
    found = StorageModelCheckpoint(dirpath=root)._find_last_checkpoints(trainer)
    assert found == {f"{root}/{n}/.metadata" for n in ("last.ckpt", "last-v1.ckpt", "last-v2.ckpt")}


def test_checkpoint_dict_round_trips_with_its_types(tmp_path: Any) -> None:
    """Lightning's dicts hold what DCP's own flattening cannot give back: int keys (an
    optimizer's state), lists of dicts, tuples, an OrderedDict, None, a tensor in a tuple."""
    ckpt = {
        "epoch": 3,
        "state_dict": collections.OrderedDict(w=torch.randn(4, 3), b=torch.zeros(3)),
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.randn(4, 3)}},
                "param_groups": [{"params": [0], "lr": 0.1}],
            }
        ],
        "loops": {"fit_loop": {"state_dict": {}, "progress": (1, 2)}},
        "callbacks": {
            "ModelCheckpoint{'monitor': None}": {"best_model_score": None, "kth": (torch.ones(2),)}
        },
        "a/b": torch.arange(3),
        "a": {"b": torch.arange(4)},
        "none": None,
    }
    plugin = StorageCheckpointIO()
    plugin.save_checkpoint(ckpt, tmp_path / "x.ckpt")
    back = plugin.load_checkpoint(tmp_path / "x.ckpt")
    assert type(back["state_dict"]) is collections.OrderedDict
    assert list(back["optimizer_states"][0]["state"]) == [0]  # an int, not "0"
    assert back["loops"]["fit_loop"]["progress"] == (1, 2)
    assert torch.equal(
        back["callbacks"]["ModelCheckpoint{'monitor': None}"]["kth"][0], torch.ones(2)
    )
    for key in ("state_dict", "optimizer_states", "a/b", "a"):
        assert_tree_equal(
            back[key] if key != "optimizer_states" else back[key][0]["state"][0],
            ckpt[key] if key != "optimizer_states" else ckpt[key][0]["state"][0],
        )
    assert back["none"] is None and back["epoch"] == 3

    plugin.remove_checkpoint(tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt").exists()
    with pytest.raises(CheckpointNotFoundError):
        plugin.load_checkpoint(tmp_path / "x.ckpt")


def test_plugin_options_are_the_writers_but_publish(tmp_path: Any) -> None:
    """The plug-in takes every writer option (its saves publish, so not ``publish``),
    refuses others naming itself, and checks a value when made, not at the first save."""
    with pytest.raises(TypeError, match=r"unknown StorageCheckpointIO option\(s\) \['publish'\]"):
        StorageCheckpointIO(publish=False)
    with pytest.raises(TypeError, match=r"\['thread_cont'\]; writer options are \[.*'base'"):
        StorageCheckpointIO(thread_cont=2)
    with pytest.raises(TypeError, match="overwrite must be a bool"):
        StorageCheckpointIO(overwrite="yes")
    writer = StorageCheckpointIO(thread_count=2, overwrite=False).writer(str(tmp_path / "c"))
    assert (writer.thread_count, writer.overwrite, writer.publish) == (2, False, True)


def test_the_rest_is_unpickled_with_the_weights_only_lightning_asks_for(tmp_path: Any) -> None:
    """A checkpoint with a class in it loads only with weights_only=False, as torch.load."""
    plugin = StorageCheckpointIO()
    plugin.save_checkpoint({"hparams": Hparams(lr=0.5), "w": torch.ones(2)}, tmp_path / "c")
    with pytest.raises(UnsafeCheckpointError, match="Hparams.*add_safe_globals"):
        plugin.load_checkpoint(tmp_path / "c", weights_only=True)
    assert plugin.load_checkpoint(tmp_path / "c", weights_only=False)["hparams"] == Hparams(lr=0.5)


@pytest.mark.parametrize("weights_only", [None, True])
def test_a_payload_in_the_rest_is_refused_without_torchs_advice(
    tmp_path: Any, weights_only: bool | None
) -> None:
    """The part of a Lightning checkpoint that is not tensors holds a payload: nothing
    runs, but a raw pickle.UnpicklingError escaped whose text (torch's) advises loading
    with weights_only=False, the one thing that would run it."""
    from tests.hostile.test_read import _RunsCode, assert_refused_quietly

    marker = tmp_path / "ran"
    plugin = StorageCheckpointIO()
    plugin.save_checkpoint({"hparams": _RunsCode(marker), "w": torch.ones(2)}, tmp_path / "c")
    with pytest.raises(UnsafeCheckpointError) as info:
        plugin.load_checkpoint(tmp_path / "c", weights_only=weights_only)
    assert_refused_quietly(info.value, str(tmp_path / "c"), repr(PREFIX))
    assert not marker.exists()


def test_a_save_to_a_linked_last_checkpoint_replaces_the_link_not_its_target(
    tmp_path: Any,
) -> None:
    """``save_last="link"`` makes last.ckpt a symbolic link to the newest checkpoint (and
    a fit resumes through it); a run resumed with ``save_last=True`` then saved last.ckpt
    through the link, into epoch=1's checkpoint: the link is replaced now, as Lightning's
    own saves replace it, and a removal takes the link, never what it points to."""
    plugin = StorageCheckpointIO()
    linked = ModelCheckpoint(dirpath=tmp_path, save_last="link", save_top_k=-1)
    _trainer(2, plugins=[plugin], callbacks=[linked]).fit(TinyModule(), _data())
    last, kept = tmp_path / "last.ckpt", tmp_path / "epoch=1-step=8.ckpt"
    assert last.is_symlink() and os.readlink(last) == kept.name
    again = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=-1)
    later = _trainer(3, plugins=[plugin], callbacks=[again])
    later.fit(TinyModule(seed=5), _data(), ckpt_path=str(last))  # through the link
    assert later.global_step == 12
    assert plugin.load_checkpoint(kept)["global_step"] == 8
    assert not last.is_symlink() and plugin.load_checkpoint(last)["global_step"] == 12
    link = tmp_path / "link.ckpt"
    link.symlink_to(kept.name)
    plugin.remove_checkpoint(link)
    assert not link.exists() and plugin.load_checkpoint(kept)["global_step"] == 8


def test_a_sharded_save_to_a_linked_path_replaces_the_link(tmp_path: Any) -> None:
    """The sharded strategies' saves (every rank writes) replace a link at the path
    on rank 0 before any rank writes, as StorageCheckpointIO's do."""
    from storage.integrations.lightning._sharded import _save_sharded

    plugin = StorageCheckpointIO()
    plugin.save_checkpoint({"global_step": 8, "w": torch.ones(2)}, tmp_path / "kept.ckpt")
    (tmp_path / "last.ckpt").symlink_to("kept.ckpt")
    strategy = types.SimpleNamespace(
        global_rank=0, broadcast=lambda value: value, storage_io=plugin
    )
    checkpoint = {"state_dict": {"w": torch.zeros(2)}, "global_step": 12}
    _save_sharded(strategy, "state_dict", checkpoint, tmp_path / "last.ckpt", None)
    assert not (tmp_path / "last.ckpt").is_symlink()
    assert plugin.load_checkpoint(tmp_path / "kept.ckpt")["global_step"] == 8


def test_without_lightning_the_import_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lightning.pytorch.plugins.io", None)
    monkeypatch.delitem(sys.modules, "storage.integrations.lightning")
    with pytest.raises(MissingDependencyError, match=r"pip install 'dcp-storage\[lightning\]'"):
        importlib.import_module("storage.integrations.lightning")


def test_a_tree_that_misplaces_a_tensor_is_refused() -> None:
    items = _tree.pack({"w": torch.ones(2)}, PREFIX)
    forged = _tree.pack({"other": 1}, PREFIX)[PREFIX]  # no room for 'lightning/w'
    record = torch.load(io.BytesIO(forged.numpy().tobytes()))
    record["slots"] = [("lightning/w", ("missing", "deeper"))]
    buf = io.BytesIO()
    torch.save(record, buf)
    items[PREFIX] = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    with pytest.raises(UnsafeCheckpointError, match="no room"):
        _tree.unpack(items, PREFIX, where="ckpt")


# --- the sharded path: ModelParallelStrategy (FSDP2) on two CPU ranks -----------------

WORLD = 2


class ShardedModule(TinyModule):
    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def _local_state(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
    """This rank's shards of the weights and of the optimizer state, as plain tensors."""
    model = {k: v.to_local().clone() for k, v in module.state_dict().items()}
    optim = trainer.optimizers[0].state_dict()["state"]
    return {
        "model": model,
        "optim": {
            k: {n: getattr(t, "to_local", lambda t=t: t)().clone() for n, t in s.items()}
            for k, s in optim.items()
        },
    }


def _sharded_worker(rank: int, store: str, root: str, options: dict[str, Any], out: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",  # the group below exists already
    )
    torch.set_num_threads(1)
    with gloo_group(rank, WORLD, store):
        plugin = StorageCheckpointIO(storage_options=options)

        def run(module: pl.LightningModule, epochs: int, **fit: Any) -> pl.Trainer:
            trainer = _trainer(
                epochs,
                devices=WORLD,
                strategy=StorageModelParallelStrategy(
                    data_parallel_size=WORLD, tensor_parallel_size=1
                ),
                plugins=[plugin],
                callbacks=[ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=-1)],
            )
            trainer.fit(module, _data(), **fit)
            return trainer

        straight = ShardedModule()
        trainer = run(straight, 2)
        expected = _local_state(trainer, straight)
        resumed = ShardedModule(seed=5)
        again = run(resumed, 2, ckpt_path=f"{root}/epoch=0.ckpt")
        assert again.global_step == trainer.global_step == 4  # 2 ranks x 2 steps an epoch
        assert_tree_equal(_local_state(again, resumed), expected)
        torch.save(expected, f"{out}/{rank}.pt")


def test_model_parallel_strategy_saves_shards_through_our_writer(
    bucket_env: dict[str, Any], endpoint: str, tmp_path: Any
) -> None:
    root = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    # fork: the workers start with Lightning imported (spawn would import it again, ~5 s)
    mp.start_processes(
        _sharded_worker,
        args=(str(tmp_path / "store"), root, bucket_env, str(tmp_path)),
        nprocs=WORLD,
        start_method="fork",
    )
    fs, path = filesystem_from_url(f"{root}/epoch=0.ckpt", bucket_env)
    assert is_committed(fs, path)
    names = fs.ls(path)
    assert not any(n == "meta.pt" for n in names)  # one commit: everything in the checkpoint
    assert {n.split("-")[0] for n in names if n.endswith(".distcp")} == {"__0_0", "__1_0"}
    # each rank held a different shard
    shards = [torch.load(tmp_path / f"{r}.pt")["model"]["net.0.weight"] for r in range(WORLD)]
    assert not torch.equal(shards[0], shards[1])


# --- FSDPStrategy (FSDP1): Lightning refuses it without CUDA and FSDP1 needs an explicit
# CPU device_id that Lightning does not pass, so its checkpoint component runs directly:
# the real strategy's state dicts (lightning_module_state_dict, optimizer_state) of an
# FSDP1 module on two gloo ranks, through save_checkpoint and load_checkpoint.


def _fsdp_strategy(rank: int, options: dict[str, Any], seed: int) -> Any:
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.trainer.states import TrainerFn
    from torch.distributed.fsdp import FullyShardedDataParallel

    strategy = StorageFSDPStrategy(state_dict_type="sharded")
    environment = LightningEnvironment()
    environment.set_global_rank(rank)
    environment.set_world_size(WORLD)
    strategy.cluster_environment = environment
    strategy.checkpoint_io = StorageCheckpointIO(storage_options=options)
    module = TinyModule(seed)
    module.trainer = _trainer(1, devices=1)
    module.trainer.state.fn = TrainerFn.FITTING
    strategy.connect(module)
    strategy.model = FullyShardedDataParallel(
        module, device_id=torch.device("cpu"), use_orig_params=True
    )
    optimizer = torch.optim.AdamW(strategy.model.parameters(), lr=1e-2)
    strategy.optimizers = [optimizer]
    x, y = next(iter(_data()))
    torch.nn.functional.mse_loss(strategy.model(x), y).backward()
    optimizer.step()
    return strategy


def _fsdp_local(strategy: Any) -> dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(strategy.model, writeback=False):
        weights = {k: v.clone() for k, v in strategy.model.named_parameters()}
    return {"weights": weights, "optim": strategy.optimizers[0].state_dict()["state"]}


def _fsdp_worker(rank: int, store: str, url: str, options: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, WORLD, store):
        saved = _fsdp_strategy(rank, options, seed=0)
        checkpoint = {
            "epoch": 1,
            "state_dict": saved.lightning_module_state_dict(),
            "optimizer_states": [saved.optimizer_state(saved.optimizers[0])],
            "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 1}}}},
        }
        saved.save_checkpoint(checkpoint, url)
        loaded = _fsdp_strategy(rank, options, seed=7)
        rest = loaded.load_checkpoint(url)
        assert rest == {"epoch": 1, "loops": checkpoint["loops"]}
        assert_tree_equal(_fsdp_local(loaded), _fsdp_local(saved))


def test_fsdp_strategy_checkpoint_component_uses_our_writer_and_reader(
    bucket_env: dict[str, Any], tmp_path: Any
) -> None:
    url = f"s3://{BUCKET}/{uuid.uuid4().hex}/fsdp.ckpt"
    mp.start_processes(
        _fsdp_worker,
        args=(str(tmp_path / "store"), url, bucket_env),
        nprocs=WORLD,
        start_method="fork",
    )
    fs, path = filesystem_from_url(url, bucket_env)
    assert is_committed(fs, path)
    assert {n.split("-")[0] for n in fs.ls(path) if n.endswith(".distcp")} == {"__0_0", "__1_0"}
