"""What the writer and the reader accept, checked once: the location (a path or URL, or
a ``FileSystemBase`` and a path on it), ``checkpoint_id`` as torch reports it, thread
counts, the serialization format, transforms, the staging options and on/off flags;
:class:`WriterSettings`, a writer's keyword options as one checked value."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.staging import StagingOptions

from storage.backends.base import FileSystemBase
from storage.backends.registry import filesystem_from_url
from storage.checkpoint import persist as _persist
from storage.checkpoint.committed import CommittedCheckpoint
from storage.checkpoint.deadline import check_timeout
from storage.checkpoint.prefixes import check_key_prefixes
from storage.checkpoint.validate import MAX_CHAIN


@dataclasses.dataclass(frozen=True)
class WriterSettings:
    """A :class:`~storage.checkpoint.writer.CheckpointWriter`'s keyword options (all but
    the location, ``transforms`` and ``storage_options``), checked when made, with the
    writer's defaults and the errors the writer raises for a bad value. What the writer,
    the manager (for every save and drain) and the framework plug-ins hold instead of a
    dict of keywords; :meth:`writer_kwargs` gives them back. ``timeout`` is kept as a
    float, as the writer uses it."""

    thread_count: int | None = None
    single_file_per_rank: bool = True
    sync_files: bool = True
    per_thread_copy_ahead: int = 10_000_000
    overwrite: bool = True
    cache_staged_state_dict: bool = False
    serialization_format: SerializationFormat = SerializationFormat.TORCH_SAVE
    base: str | os.PathLike[str] | CommittedCheckpoint | None = None
    fingerprint: bool = False
    timeout: float | None = None
    key_prefixes: int = 0
    persist: str | None = None
    max_bandwidth: int | None = None
    publish: bool = True
    async_staging: bool = False

    def __post_init__(self) -> None:
        _persist.check_mode(self.persist, self.max_bandwidth)
        object.__setattr__(self, "timeout", check_timeout(self.timeout))
        check_key_prefixes(self.key_prefixes)
        check_serialization_format(self.serialization_format)
        check_thread_count(self.thread_count)
        check_flags(
            single_file_per_rank=self.single_file_per_rank,
            sync_files=self.sync_files,
            overwrite=self.overwrite,
            cache_staged_state_dict=self.cache_staged_state_dict,
            fingerprint=self.fingerprint,
            publish=self.publish,
            async_staging=self.async_staging,
        )
        base = self.base
        if base is not None and not isinstance(base, (str, os.PathLike, CommittedCheckpoint)):
            raise TypeError(f"base must be a path or URL, got {base!r}")

    @classmethod
    def from_kwargs(
        cls, options: Mapping[str, Any], *, owner: str, refuse: Collection[str] = ()
    ) -> WriterSettings:
        """The settings ``options`` (keywords a user gave ``owner``) ask for. A keyword
        that is no writer option, or one of ``refuse`` (those ``owner`` sets itself, per
        save), raises ``TypeError`` naming ``owner`` and the options it accepts."""
        accepted = sorted(f.name for f in dataclasses.fields(cls) if f.name not in refuse)
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise TypeError(f"unknown {owner} option(s) {unknown}; writer options are {accepted}")
        return cls(**options)

    def writer_kwargs(self) -> dict[str, Any]:
        """Every option as a keyword of ``CheckpointWriter``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def persist_mode(self, *filesystems: FileSystemBase) -> _persist.Mode:
        """Where an asynchronous save with these settings to ``filesystems`` runs."""
        return _persist.for_filesystems(
            _persist.check_mode(self.persist, self.max_bandwidth), *filesystems
        )


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


def torch_alias(name: str, value: Any, torch_name: str, torch_value: Any) -> Any:
    """``value``, or ``torch_value`` given under the name torch's writer or reader uses
    for the same option (``_extensions`` for ``transforms``); both given is an error."""
    if torch_value is None:
        return value
    if value is not None:
        raise TypeError(f"pass {name} or {torch_name} (torch's name for it), not both")
    return torch_value


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
    if len(transforms) > MAX_CHAIN:
        raise ValueError(
            f"{len(transforms)} transforms: readers refuse a chain of more than {MAX_CHAIN}"
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
