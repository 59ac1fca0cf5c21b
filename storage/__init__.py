"""dcp-storage: pluggable storage backends for torch.distributed.checkpoint.

The package is layered (docs/architecture.md): ``storage.backends`` (where bytes live)
<- ``storage.checkpoint`` (the DCP plug-in) <- ``storage.ops`` (manager, tools) <-
``storage.cli``; ``extensions`` (transforms and the error types) sits below them all.
This module only gathers the public names."""

from extensions.errors import (
    CheckpointExistsError,
    CheckpointInUseError,
    CheckpointNotFoundError,
    CheckpointStorageError,
    IntegrityError,
    MissingDependencyError,
    MissingKeyError,
    TierFullError,
    UnknownTransformError,
    UnsafeCheckpointError,
    WorkerDiedError,
)
from storage.backends import (
    FileSystemBase,
    LocalFileSystem,
    MemoryFileSystem,
    RangeMismatchError,
    TorchFileSystem,
    filesystem_from_url,
    register_filesystem,
)
from storage.backends.registry import LAZY_NAMES as _LAZY
from storage.checkpoint import CheckpointReader, CheckpointWriter, async_save, load, save
from storage.checkpoint.deadline import CheckpointRankError, DeadlineExceededError
from storage.checkpoint.safetensors import (
    SafetensorsReader,
    SafetensorsWriter,
    load_safetensors,
    save_safetensors,
)
from storage.ops import CheckpointManager, StorageTransport

# The backends with optional client libraries (FsspecFileSystem, S3FileSystem,
# GCSFileSystem: storage.backends.registry.LAZY_NAMES) resolve lazily (below) and stay
# out of __all__, so `from storage import *` works without s3fs, gcsfs or fsspec.
__all__ = [
    "CheckpointExistsError",
    "CheckpointInUseError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointRankError",
    "CheckpointReader",
    "CheckpointStorageError",
    "CheckpointWriter",
    "DeadlineExceededError",
    "FileSystemBase",
    "IntegrityError",
    "LocalFileSystem",
    "MemoryFileSystem",
    "MissingDependencyError",
    "MissingKeyError",
    "RangeMismatchError",
    "SafetensorsReader",
    "SafetensorsWriter",
    "StorageTransport",
    "TorchFileSystem",
    "TierFullError",
    "UnknownTransformError",
    "UnsafeCheckpointError",
    "WorkerDiedError",
    "async_save",
    "filesystem_from_url",
    "load",
    "load_safetensors",
    "register_filesystem",
    "save",
    "save_safetensors",
]


def __getattr__(name: str) -> object:
    # Cloud backends import their client libraries; load them only when asked for.
    backend = _LAZY.get(name)
    if backend is not None:
        return backend.load(f"storage.{name}")
    raise AttributeError(f"module 'storage' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
