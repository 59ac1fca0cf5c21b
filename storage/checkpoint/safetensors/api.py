"""One call each way, raising the real error (``dcp.save`` / ``dcp.load`` wrap it in a
``CheckpointException`` that only quotes it)."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from storage.checkpoint.api import _no_dist, _quiet_single_process, unwrap_checkpoint_exception
from storage.checkpoint.safetensors.reader import SafetensorsReader
from storage.checkpoint.safetensors.writer import SafetensorsWriter


def save_safetensors(
    state_dict: dict[str, Any], url: str | os.PathLike[str], **writer_options: Any
) -> None:
    """Save a state dict of tensors to ``url`` as a Hub-layout model with
    :class:`SafetensorsWriter` (its keyword options: ``storage_options``,
    ``max_shard_size``, ``overwrite``, ...). Collective under a process group."""
    writer = SafetensorsWriter(url, **writer_options)
    try:
        with _quiet_single_process():
            dcp.save(state_dict, storage_writer=writer, no_dist=_no_dist())
    except CheckpointException as exc:
        real = unwrap_checkpoint_exception(exc, writer)
        raise real from real.__cause__


def load_safetensors(
    state_dict: dict[str, Any], url: str | os.PathLike[str], **reader_options: Any
) -> None:
    """Load the Hub-layout model at ``url`` into ``state_dict`` in place with
    :class:`SafetensorsReader` (``storage_options``, ``thread_count``). Collective under
    a process group."""
    reader = SafetensorsReader(url, **reader_options)
    try:
        with _quiet_single_process():
            dcp.load(state_dict, storage_reader=reader, no_dist=_no_dist())
    except CheckpointException as exc:
        real = unwrap_checkpoint_exception(exc, reader)
        raise real from real.__cause__
