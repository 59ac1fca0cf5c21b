"""Small pieces shared by the writer and the reader: option checks, locations, errors."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.staging import StagingOptions

from storage.backends.base import FileSystemBase
from storage.backends.registry import filesystem_from_url

F = TypeVar("F", bound=Callable[..., Any])


def records_error(method: F) -> F:
    """Keep the first error a DCP hook raised on ``self.last_error``: DCP hands callers
    only a ``CheckpointException`` quoting it, and the one-call helpers re-raise it."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except BaseException as exc:
            if getattr(self, "last_error", None) is None:
                self.last_error = exc
            raise

    return wrapper  # type: ignore[return-value]


def default_thread_count(fs: FileSystemBase) -> int:
    return max(1, fs.io_concurrency)


def check_thread_count(thread_count: object) -> int | None:
    if thread_count is None:
        return None
    if not isinstance(thread_count, int) or isinstance(thread_count, bool) or thread_count < 1:
        raise TypeError(f"thread_count must be an int >= 1, got {thread_count!r}")
    return thread_count


def resolve_location(
    location: str | os.PathLike[str],
    storage_options: dict[str, Any] | None,
    filesystem: FileSystemBase | None,
) -> tuple[FileSystemBase, str]:
    if filesystem is not None:
        if not isinstance(filesystem, FileSystemBase):
            raise TypeError(f"filesystem must be a storage.FileSystemBase, got {filesystem!r}")
        return filesystem, filesystem.init_path(location)
    return filesystem_from_url(location, storage_options)


def stock_checkpoint_id(location: str | os.PathLike[str]) -> str | os.PathLike[str]:
    """``checkpoint_id`` as torch's writers and readers report it: a local path as a
    ``pathlib.Path`` (``FileSystemWriter``), a URL unchanged (``FsspecWriter``)."""
    if isinstance(location, os.PathLike) or "://" in location:
        return location
    return Path(location)


def check_shapes(
    req: ReadItem, target: torch.Tensor, chunk: tuple[torch.Size, Any] | None, where: str
) -> None:
    """A target that does not fit the stored chunk is the caller's mismatch (a
    ``ValueError``, as torch's planner says), found before any byte is read."""
    requested, offsets = tuple(req.lengths), tuple(req.storage_offsets)
    stored = tuple(chunk[0]) if chunk is not None else None
    if tuple(target.size()) != requested or (
        stored is not None
        and not (
            len(offsets) == len(requested) == len(stored)
            and all(o >= 0 and o + n <= s for o, n, s in zip(offsets, requested, stored))
        )
    ):
        raise ValueError(
            f"{where}: size mismatch: the target has shape {tuple(target.size())}, the "
            f"stored chunk {stored if stored is not None else '(unknown)'} (region at "
            f"{offsets} of sizes {requested}); load into a state dict shaped like the "
            "checkpoint (dcp-storage inspect lists its shapes)"
        )


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    flat = tensor.reshape(-1).view(torch.uint8)
    return flat.numpy().data.cast("B")


def staging_options(*, pin: bool) -> StagingOptions:
    # What dcp.async_save stages with by default, plus pinned buffers when caching on GPU.
    return StagingOptions(
        use_pinned_memory=pin,
        use_shared_memory=False,
        use_async_staging=False,
        use_non_blocking_copy=False,
    )


def check_serialization_format(value: object) -> None:
    if value == SerializationFormat.TORCH_SAVE:
        return
    if value == getattr(SerializationFormat, "SAFETENSORS", None):
        raise ValueError(
            "serialization_format=SAFETENSORS is not supported: items are stored as torch.save "
            "archives (SerializationFormat.TORCH_SAVE), which is what stock readers expect; "
            "for safetensors files use torch's HuggingFaceStorageWriter"
        )
    raise TypeError(f"serialization_format must be a torch SerializationFormat, got {value!r}")


def check_transforms(transforms: Sequence[Any] | None) -> list[Any]:
    if transforms is None:
        return []
    if isinstance(transforms, (str, bytes)) or not isinstance(transforms, Sequence):
        raise TypeError(
            "transforms must be a list of transform instances, e.g. [extensions.ZStandard()]"
        )
    for t in transforms:
        if isinstance(t, type) or not all(
            hasattr(t, a) for a in ("transform_to", "get_descriptor", "registry_name")
        ):
            raise TypeError(
                f"{t!r} is not a stream transform instance; pass e.g. extensions.ZStandard(), "
                "not the class"
            )
    return list(transforms)
