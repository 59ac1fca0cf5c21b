"""Lightning's ``CheckpointIO`` plugin (:class:`StorageCheckpointIO`): Lightning
checkpoints as dcp-storage checkpoints, saved and loaded by the calling process alone;
and how a path Lightning passes is read (a URL or a local path, a checkpoint or its
metadata file)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from lightning.pytorch.plugins.io import CheckpointIO

from extensions.base import Keys
from extensions.errors import CheckpointStorageError
from extensions.registry import ExtensionRegistry
from storage.checkpoint import api
from storage.checkpoint.deletion import delete_checkpoint
from storage.checkpoint.layout import is_committed, is_metadata_name
from storage.checkpoint.options import WriterSettings, resolve_location
from storage.checkpoint.writer import CheckpointWriter
from storage.integrations import _tree
from storage.integrations._solo import empty_targets, load_alone, reader_alone, save_alone

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
        return self.storage_options if is_url(path) else None

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
        refuse_call_options(storage_options, type(self).__name__)
        self.replace_link(path_text(path))
        save_alone(self.writer(path_text(path)), _tree.pack(checkpoint, PREFIX))

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
        return self.load_tree(
            loaded_checkpoint(path), weights_only=weights_only, map_location=map_location
        )

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
        url = path_text(path)
        fs, location = resolve_location(url, self.options_for(url), None)
        if fs.is_link(location):
            fs.rm_file(location)
        elif is_committed(fs, location):
            delete_checkpoint(fs, location)


def path_text(path: Any) -> str:
    # Lightning passes str or pathlib.Path; URLs stay strings (Path would drop a slash).
    return os.fspath(path)


def loaded_checkpoint(path: Any) -> str:
    """The checkpoint a load names: ``path``, or the checkpoint whose metadata file it
    is (what :class:`._model_checkpoint.StorageModelCheckpoint` offers for
    ``ckpt_path="last"``)."""
    url = path_text(path)
    parent, sep, name = url.rstrip("/").rpartition("/")
    return parent if sep and is_metadata_name(name) else url


def is_url(path: str) -> bool:
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme not in ("", "file")


def refuse_call_options(storage_options: Any, owner: str) -> None:
    if storage_options is not None:
        raise TypeError(
            f"trainer.save_checkpoint(..., storage_options=...) is not supported by {owner}; "
            "pass storage_options (and transforms) to StorageCheckpointIO(...) instead"
        )
