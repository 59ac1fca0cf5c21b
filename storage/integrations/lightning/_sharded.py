"""Lightning's sharded strategies with dcp-storage checkpoints:
:class:`StorageModelParallelStrategy` (FSDP2, tensor parallel) and
:class:`StorageFSDPStrategy` (FSDP1), every rank writing its shards and one metadata
committing them all, with the rest of the checkpoint stored as
:class:`._checkpoint_io.StorageCheckpointIO` stores it."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from storage.checkpoint import api
from storage.checkpoint.reader import CheckpointReader
from storage.integrations import _tree
from storage.integrations.lightning._checkpoint_io import (
    PREFIX,
    StorageCheckpointIO,
    loaded_checkpoint,
    path_text,
    refuse_call_options,
)


class _ShardedStorage:
    """What both sharded strategies share: the plugin their settings come from, the
    save (``_MODEL_KEY``: the name Lightning gives the model's shards), the removal."""

    _MODEL_KEY: str

    @property
    def storage_io(self) -> StorageCheckpointIO:
        """The plugin whose settings this strategy's checkpoints use."""
        io = self.checkpoint_io  # type: ignore[attr-defined]
        return io if isinstance(io, StorageCheckpointIO) else StorageCheckpointIO()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        _save_sharded(self, self._MODEL_KEY, checkpoint, filepath, storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:  # type: ignore[attr-defined]
            self.storage_io.remove_checkpoint(filepath)


class StorageModelParallelStrategy(_ShardedStorage, ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2, tensor parallel) whose distributed checkpoints
    use dcp-storage.

    Every rank writes its shards of the model and optimizer states with
    :class:`CheckpointWriter` and one metadata commits them all (Lightning's stock
    strategy writes a local directory plus a ``meta.pt`` beside the DCP files); the
    rest of the checkpoint (loops, callbacks, schedulers) is stored by global rank 0 in
    the same checkpoint, as :class:`StorageCheckpointIO` stores it. Loads read the
    shards each rank needs with :class:`CheckpointReader` (collectively) and return the
    rest. Settings (``storage_options``, transforms, keys) come from the Trainer's
    ``StorageCheckpointIO`` plugin, or its defaults without one. Only sharded
    checkpoints are supported (``save_distributed_checkpoint=True``).
    """

    _MODEL_KEY = "state_dict"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self._save_distributed_checkpoint:
            raise ValueError(
                _SHARDED_ONLY.format(type(self).__name__, "save_distributed_checkpoint")
            )

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        url = self.broadcast(loaded_checkpoint(checkpoint_path))
        options = self.storage_io.reader_options(url)
        module = self.model
        assert module is not None and self.lightning_module is not None
        model_state = {"state_dict": get_model_state_dict(module)}
        api.load(model_state, url, **options)
        module.load_state_dict(
            model_state["state_dict"], strict=self.lightning_module.strict_loading
        )
        for idx, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{idx}"
            optim_state = {key: get_optimizer_state_dict(module, optimizer)}
            api.load(optim_state, url, **options)
            set_optimizer_state_dict(
                module,
                optimizer,
                optim_state_dict=optim_state[key],
                options=StateDictOptions(cpu_offload=True),
            )
        return self.storage_io.load_tree(url, weights_only=weights_only)


class StorageFSDPStrategy(_ShardedStorage, FSDPStrategy):
    """``FSDPStrategy`` (FSDP1) whose sharded checkpoints use dcp-storage, as
    :class:`StorageModelParallelStrategy` does for FSDP2: shards through
    :class:`CheckpointWriter` / :class:`CheckpointReader`, the rest of the checkpoint in
    the same commit, settings from the Trainer's ``StorageCheckpointIO``. Only
    ``state_dict_type="sharded"`` is supported."""

    _MODEL_KEY = "model"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._state_dict_type != "sharded":
            raise ValueError(_SHARDED_ONLY.format(type(self).__name__, 'state_dict_type="sharded"'))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        from lightning.pytorch.trainer.states import TrainerFn
        from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import (
            ShardedOptimStateDictConfig,
            ShardedStateDictConfig,
            StateDictType,
        )

        url = self.broadcast(loaded_checkpoint(checkpoint_path))
        options = self.storage_io.reader_options(url)
        module = self.model
        assert module is not None and self.lightning_module is not None
        with FSDP.state_dict_type(
            module,
            StateDictType.SHARDED_STATE_DICT,
            ShardedStateDictConfig(offload_to_cpu=True),
            ShardedOptimStateDictConfig(offload_to_cpu=True),
        ):
            model_state = {"model": module.state_dict()}
            api.load(model_state, url, **options)
            module.load_state_dict(
                model_state["model"], strict=self.lightning_module.strict_loading
            )
            fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
            for idx, optimizer in enumerate(self.optimizers if fitting else []):
                key = f"optimizer_{idx}"
                optim_state = load_sharded_optimizer_state_dict(
                    model_state_dict=model_state["model"],
                    optimizer_key=key,
                    storage_reader=CheckpointReader(url, **options),
                )
                optimizer.load_state_dict(
                    FSDP.optim_state_dict_to_load(
                        model=module, optim=optimizer, optim_state_dict=optim_state[key]
                    )
                )
        return self.storage_io.load_tree(url, weights_only=weights_only)


_SHARDED_ONLY = (
    "{} saves sharded checkpoints only; keep {} (a consolidated file of a sharded model is "
    "what torch's dcp_to_torch_save can make from the checkpoint afterwards)"
)


def _save_sharded(
    strategy: Any,
    model_key: str,
    checkpoint: dict[str, Any],
    filepath: Any,
    storage_options: Any,
) -> None:
    """A sharded Lightning checkpoint in one collective commit: ``model_key`` and
    ``optimizer_<i>`` (as Lightning names them) from every rank, the rest from rank 0."""
    refuse_call_options(storage_options, type(strategy).__name__)
    if strategy.global_rank == 0:  # before any rank writes there (broadcast waits)
        strategy.storage_io.replace_link(path_text(filepath))
    url = strategy.broadcast(path_text(filepath))  # rank 0's path for every rank
    state: dict[str, Any] = {model_key: checkpoint.pop("state_dict")}
    for idx, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[f"optimizer_{idx}"] = optim_state
    if strategy.global_rank == 0:
        state.update(_tree.pack(checkpoint, PREFIX))
    api.save_with(strategy.storage_io.writer(url), state)
