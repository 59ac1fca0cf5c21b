"""PyTorch Lightning: checkpoints to any dcp-storage URL (``s3://``, ``gs://``, fsspec,
local paths).

* :class:`StorageCheckpointIO`, a ``CheckpointIO`` plugin, for the strategies that save
  one checkpoint from global rank 0 (single device, DDP):
  ``Trainer(plugins=[StorageCheckpointIO(storage_options=...)])``.
* :class:`StorageModelParallelStrategy` and :class:`StorageFSDPStrategy`, Lightning's
  ``ModelParallelStrategy`` (FSDP2, tensor parallel) and ``FSDPStrategy`` (FSDP1) whose
  sharded saves and loads go through our writer and reader: the stock strategies
  bypass ``CheckpointIO`` and let ``dcp.save`` pick a local ``FileSystemWriter``. They
  take their settings from a ``StorageCheckpointIO`` among the Trainer's plugins.
* :class:`StorageModelCheckpoint`, a ``ModelCheckpoint`` whose ``ckpt_path="last"``
  finds the last checkpoint under a URL ``dirpath`` (Lightning's lookup finds none
  there and starts from step 0).

A checkpoint path names a DCP checkpoint directory (or key prefix), committed like
every save here: data first, metadata last, one CRC-32C per item, the plugin's
transforms. ``ModelCheckpoint(dirpath="s3://...")`` works as with any fsspec URL (it
lists and checks existence through fsspec, so that client must reach the bucket too,
e.g. through ``AWS_ENDPOINT_URL``); ``trainer.fit(ckpt_path=URL)`` resumes.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from typing import Any

from extensions.base import Keys
from extensions.errors import CheckpointNotFoundError, CheckpointStorageError
from extensions.registry import ExtensionRegistry
from storage.checkpoint import api
from storage.checkpoint.deletion import delete_checkpoint
from storage.checkpoint.layout import is_committed, is_metadata_name, metadata_names
from storage.checkpoint.options import WriterSettings, resolve_location
from storage.checkpoint.reader import CheckpointReader
from storage.checkpoint.siblings import names_under
from storage.checkpoint.writer import CheckpointWriter
from storage.integrations import _tree
from storage.integrations._deps import require
from storage.integrations._solo import empty_targets, load_alone, reader_alone, save_alone
from storage.integrations._versions import unlisted_versions

require("lightning.pytorch.plugins.io", "lightning")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import CheckpointIO  # noqa: E402
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy  # noqa: E402

# The item holding everything but the tensors (storage.integrations._tree).
PREFIX = "lightning"

log = logging.getLogger(__name__)


class StorageCheckpointIO(CheckpointIO):
    """Lightning checkpoints as dcp-storage checkpoints.

    ``storage_options`` go to the client library of URL paths (``endpoint_url``,
    ``key``, ...; local paths take none);
    ``transforms`` (e.g. ``[extensions.ZStandard()]``) encode every item; ``keys``,
    ``registry`` and ``require_encryption`` are the reader's (see
    :class:`storage.CheckpointReader`); other keywords are
    :class:`storage.CheckpointWriter` options (``thread_count``, ``overwrite``, ...).

    Each tensor of the checkpoint dict (model, optimizer, callbacks' tensors) is an item
    of its own; everything else is one ``torch.save`` item, unpickled on load with the
    ``weights_only`` Lightning asks for, as ``TorchCheckpointIO`` does. Loads return CPU
    tensors unless ``map_location`` names a device; Lightning moves them to the model's.
    Saves and loads are made by the calling process alone (Lightning saves on global
    rank 0 and loads on every rank), never as collectives.
    """

    def __init__(
        self,
        *,
        storage_options: dict[str, Any] | None = None,
        transforms: Sequence[Any] | None = None,
        keys: Keys | None = None,
        registry: ExtensionRegistry | None = None,
        require_encryption: bool | None = None,
        **writer_options: Any,
    ) -> None:
        self.settings = WriterSettings.from_kwargs(
            writer_options,
            owner="StorageCheckpointIO",
            refuse=("publish",),  # saves publish
        )
        self.storage_options = storage_options
        self.transforms = list(transforms or [])
        self.read_options = api.ReaderOptions(keys, registry, require_encryption)

    def options_for(self, path: str) -> dict[str, Any] | None:
        """``storage_options`` for ``path``: a URL's client gets them, a local path
        (Lightning's default ``checkpoints/`` directory, say) none."""
        return self.storage_options if _is_url(path) else None

    def reader_options(self, path: str) -> dict[str, Any]:
        """:class:`CheckpointReader` options for ``path`` with this plugin's settings."""
        return {"storage_options": self.options_for(path), **self.read_options.as_kwargs()}

    def writer(self, path: str) -> CheckpointWriter:
        """A :class:`CheckpointWriter` for ``path`` with this plugin's settings."""
        return CheckpointWriter(
            path,
            transforms=self.transforms,
            storage_options=self.options_for(path),
            **self.settings.writer_kwargs(),
        )

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        _refuse_call_options(storage_options, type(self).__name__)
        self.replace_link(_location(path))
        save_alone(self.writer(_location(path)), _tree.pack(checkpoint, PREFIX))

    def replace_link(self, path: str) -> None:
        """Remove ``path`` if it is a symbolic link (the link only, never what it points
        to), before a save there. ``ModelCheckpoint(save_last="link")`` makes
        ``last.ckpt`` a link to the newest checkpoint; a later save to that name
        (``save_last=True`` on resuming, or "link" before any top-k save) went through
        the link into the checkpoint it points to and replaced it. Lightning's own
        saves replace the link (fsspec renames its file over it): so do these, with a
        checkpoint of their own."""
        fs, location = resolve_location(path, self.options_for(path), None)
        if fs.is_link(location):
            log.info("%s is a symbolic link: replaced by this save's checkpoint", fs.url(location))
            fs.rm_file(location)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        return self.load_tree(_loaded(path), weights_only=weights_only, map_location=map_location)

    def load_tree(
        self,
        path: str,
        *,
        weights_only: bool | None = None,
        map_location: Any = None,
    ) -> Any:
        """What :meth:`save_checkpoint` (or the strategy, for all but the sharded
        model and optimizer states) stored at ``path``."""
        reader = reader_alone(path, **self.reader_options(path))
        metadata = reader.read_metadata()
        names = _tree.item_names(list(metadata.state_dict_metadata), PREFIX)
        if PREFIX not in names:
            raise CheckpointStorageError(
                f"{reader.url} is a checkpoint, but not one saved through dcp-storage's "
                f"Lightning integration (it has no {PREFIX!r} item); load it with "
                "storage.load into a state dict of your own"
            )
        items = empty_targets(metadata, names, reader.url)
        load_alone(reader_alone(path, **self.reader_options(path)), dict(items))
        return _tree.unpack(
            items, PREFIX, where=reader.url, weights_only=weights_only, map_location=map_location
        )

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the committed checkpoint at ``path`` the safe way (metadata first, then
        only the data files it names; storage.checkpoint.layout); nothing if there is
        none. A symbolic link (``save_last="link"``'s) is removed itself, never through."""
        url = _location(path)
        fs, location = resolve_location(url, self.options_for(url), None)
        if fs.is_link(location):
            fs.rm_file(location)
        elif is_committed(fs, location):
            delete_checkpoint(fs, location)


class StorageModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose ``fit(ckpt_path="last")`` finds its last checkpoint
    under a URL ``dirpath``.

    Lightning's lookup lists ``dirpath`` through fsspec, which names what it finds
    without the scheme (``bucket/run1/last.ckpt``): it finds no local path of that name,
    warns, and the fit starts from step 0; and fsspec cannot date a prefix. This lists
    the committed ``last*.ckpt`` of a URL ``dirpath`` with the Trainer's
    :class:`StorageCheckpointIO` settings, asking by name for those a listing that lags
    misses (so it never resumes from an older one), and offers each by its metadata
    file (dated; loads here take it for its checkpoint, and ``ckpt_path`` names it).
    Committed checkpoints but no last one (``save_last`` unset) raise
    :class:`CheckpointNotFoundError` rather than a fit from step 0 beside them. A local
    ``dirpath`` keeps Lightning's lookup.
    """

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        dirpath = _location(self._ModelCheckpoint__resolve_ckpt_dir(trainer))  # type: ignore[attr-defined]
        if not _is_url(dirpath):
            return super()._find_last_checkpoints(trainer)
        io = trainer.strategy.checkpoint_io
        io = io if isinstance(io, StorageCheckpointIO) else StorageCheckpointIO()
        fs, location = resolve_location(dirpath, io.options_for(dirpath), None)
        names = names_under(fs, location)
        last = re.compile(rf"{re.escape(self.CHECKPOINT_NAME_LAST)}(-\d+)?")
        found, others = set(), []
        unlisted = unlisted_versions(
            fs,
            location,
            names,
            (self.CHECKPOINT_NAME_LAST, self.FILE_EXTENSION, self.CHECKPOINT_JOIN_CHAR),
            self.STARTING_VERSION,
        )
        for name in [*names, *unlisted]:
            stem, ext = os.path.splitext(name)
            if ext != self.FILE_EXTENSION:
                continue
            committing = metadata_names(fs, fs.concat_path(location, name))
            if committing and last.match(stem):
                found.add(f"{dirpath.rstrip('/')}/{name}/{committing[0]}")
            elif committing:
                others.append(name)
        if not found and others:
            # Lightning would warn and train from step 0 beside these checkpoints.
            raise CheckpointNotFoundError(
                f'fit(ckpt_path="last"): {dirpath} holds committed checkpoints '
                f"({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}) but no "
                f"{self.CHECKPOINT_NAME_LAST}{self.FILE_EXTENSION}; pass ckpt_path= the URL "
                "of the one to resume from, and save with StorageModelCheckpoint(save_last=True)"
            )
        return found


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

        url = self.broadcast(_loaded(checkpoint_path))
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

        url = self.broadcast(_loaded(checkpoint_path))
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
    _refuse_call_options(storage_options, type(strategy).__name__)
    if strategy.global_rank == 0:  # before any rank writes there (broadcast waits)
        strategy.storage_io.replace_link(_location(filepath))
    url = strategy.broadcast(_location(filepath))  # rank 0's path for every rank
    state: dict[str, Any] = {model_key: checkpoint.pop("state_dict")}
    for idx, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[f"optimizer_{idx}"] = optim_state
    if strategy.global_rank == 0:
        state.update(_tree.pack(checkpoint, PREFIX))
    api.save_with(strategy.storage_io.writer(url), state)


def _location(path: Any) -> str:
    # Lightning passes str or pathlib.Path; URLs stay strings (Path would drop a slash).
    return os.fspath(path)


def _loaded(path: Any) -> str:
    """The checkpoint a load names: ``path``, or the checkpoint whose metadata file it
    is (what :class:`StorageModelCheckpoint` offers for ``ckpt_path="last"``)."""
    url = _location(path)
    parent, sep, name = url.rstrip("/").rpartition("/")
    return parent if sep and is_metadata_name(name) else url


def _is_url(path: str) -> bool:
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme not in ("", "file")


def _refuse_call_options(storage_options: Any, owner: str) -> None:
    if storage_options is not None:
        raise TypeError(
            f"trainer.save_checkpoint(..., storage_options=...) is not supported by {owner}; "
            "pass storage_options (and transforms) to StorageCheckpointIO(...) instead"
        )


__all__ = [
    "PREFIX",
    "StorageCheckpointIO",
    "StorageFSDPStrategy",
    "StorageModelCheckpoint",
    "StorageModelParallelStrategy",
]
