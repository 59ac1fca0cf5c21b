"""One call each way, raising the real error (``dcp.save`` / ``dcp.load`` wrap it in a
``CheckpointException`` that only quotes it)."""

from __future__ import annotations

import os
from typing import Any

from storage.checkpoint.api import load_with, save_with
from storage.checkpoint.safetensors.reader import SafetensorsReader
from storage.checkpoint.safetensors.writer import SafetensorsWriter


def save_safetensors(
    state_dict: dict[str, Any], url: str | os.PathLike[str], **writer_options: Any
) -> None:
    """Save a state dict of tensors to ``url`` as a Hub-layout model with
    :class:`SafetensorsWriter` (its keyword options: ``storage_options``,
    ``max_shard_size``, ``overwrite``, ...). Collective under a process group."""
    save_with(SafetensorsWriter(url, **writer_options), state_dict)


def load_safetensors(
    state_dict: dict[str, Any], url: str | os.PathLike[str], **reader_options: Any
) -> None:
    """Load the Hub-layout model at ``url`` into ``state_dict`` in place with
    :class:`SafetensorsReader` (``storage_options``, ``thread_count``). Collective under
    a process group."""
    load_with(SafetensorsReader(url, **reader_options), state_dict)
