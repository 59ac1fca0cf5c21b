"""Stream transforms for dcp-storage checkpoints: the contract, the registry, built-ins."""

from extensions.base import ItemInfo, StreamTransformExtension
from extensions.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointStorageError,
    IntegrityError,
    MissingDependencyError,
    MissingKeyError,
    UnknownTransformError,
    UnsafeCheckpointError,
)
from extensions.registry import ExtensionRegistry, register
from extensions.zstd import ZStandard

__all__ = [
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointStorageError",
    "ExtensionRegistry",
    "IntegrityError",
    "ItemInfo",
    "MissingDependencyError",
    "MissingKeyError",
    "StreamTransformExtension",
    "UnknownTransformError",
    "UnsafeCheckpointError",
    "ZStandard",
    "register",
]
