"""What the writer and the reader accept, checked once: the location (a path or URL, or
a ``FileSystemBase`` and a path on it), ``checkpoint_id`` as torch reports it, thread
counts, the serialization format, transforms, the staging options and on/off flags."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.staging import StagingOptions

from storage.backends.base import FileSystemBase
from storage.backends.registry import filesystem_from_url


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


def default_thread_count(fs: FileSystemBase) -> int:
    return max(1, fs.io_concurrency)


def check_thread_count(thread_count: object) -> int | None:
    if thread_count is None:
        return None
    if not isinstance(thread_count, int) or isinstance(thread_count, bool) or thread_count < 1:
        raise TypeError(f"thread_count must be an int >= 1, got {thread_count!r}")
    return thread_count


def check_serialization_format(value: object) -> None:
    if value == SerializationFormat.TORCH_SAVE:
        return
    if value == getattr(SerializationFormat, "SAFETENSORS", None):
        raise ValueError(
            "serialization_format=SAFETENSORS is not supported: items are stored as torch.save "
            "archives (SerializationFormat.TORCH_SAVE), which is what stock readers expect; "
            "for a Hugging Face safetensors model (on any backend) use "
            "storage.SafetensorsWriter, or `dcp-storage export --format safetensors`"
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


def staging_options(*, pin: bool) -> StagingOptions:
    # What dcp.async_save stages with by default, plus pinned buffers when caching on GPU.
    return StagingOptions(
        use_pinned_memory=pin,
        use_shared_memory=False,
        use_async_staging=False,
        use_non_blocking_copy=False,
    )


def check_flags(**flags: object) -> None:
    """Refuse a flag (an option that is on or off) given as anything but a bool."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
