"""Saves and loads that one process makes on its own, whatever process group is running.

Frameworks call their checkpoint hooks on one rank (Lightning's ``CheckpointIO`` saves
on global rank 0, a Trainer callback drains on the main process), so these must not be
collective even when ``torch.distributed`` is initialized: ``storage.save`` and
``storage.load`` would wait for ranks that never come. Errors are the real ones, as
with the one-call helpers (DCP's ``CheckpointException`` unwrapped); a failed save
removes what it wrote.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from storage.checkpoint.api import unwrap_checkpoint_exception
from storage.checkpoint.reader import CheckpointReader
from storage.checkpoint.tensors import empty_stored
from storage.checkpoint.writer import CheckpointWriter


def save_alone(writer: CheckpointWriter, state_dict: dict[str, Any]) -> None:
    """``dcp.save`` of ``state_dict`` through ``writer`` by this process alone."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state_dict, storage_writer=writer, no_dist=True)
    except CheckpointException as exc:
        writer.abort(exc)
        real = unwrap_checkpoint_exception(exc, writer)
        raise real from real.__cause__


def reader_alone(url: str | os.PathLike[str], **reader_options: Any) -> CheckpointReader:
    """A reader for a load by this process alone: no metadata sharing, no fetching
    items for other ranks (both are collectives)."""
    return CheckpointReader(url, share_metadata=False, read_once=False, **reader_options)


def load_alone(reader: CheckpointReader, state_dict: dict[str, Any]) -> None:
    """``dcp.load`` into ``state_dict`` (in place) through ``reader`` by this process alone."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state_dict, storage_reader=reader, no_dist=True)
    except CheckpointException as exc:
        real = unwrap_checkpoint_exception(exc, reader)
        raise real from real.__cause__


def empty_targets(metadata: Metadata, keys: list[str], url: str) -> dict[str, torch.Tensor]:
    """CPU tensors to load the stored tensors ``keys`` (of the checkpoint at ``url``)
    into, shaped as stored once each claim is checked (``empty_stored``)."""
    targets = {}
    for key in keys:
        assert isinstance(metadata.state_dict_metadata[key], TensorStorageMetadata)
        targets[key] = empty_stored(metadata, key, url)
    return targets
