"""Stream transforms for dcp-storage checkpoints: the contract, the registry, built-ins."""

from extensions.base import ItemInfo, StreamTransformExtension
from extensions.encryption import AES256GCM, keys_from_environment, keys_from_file
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
from extensions.registry import ExtensionRegistry, register
from extensions.shuffle import ByteShuffle
from extensions.weights import WeightCodec
from extensions.zstd import ZStandard

__all__ = [
    "AES256GCM",
    "ByteShuffle",
    "CheckpointExistsError",
    "CheckpointInUseError",
    "CheckpointNotFoundError",
    "CheckpointStorageError",
    "ExtensionRegistry",
    "IntegrityError",
    "ItemInfo",
    "MissingDependencyError",
    "MissingKeyError",
    "StreamTransformExtension",
    "TierFullError",
    "UnknownTransformError",
    "UnsafeCheckpointError",
    "WeightCodec",
    "WorkerDiedError",
    "ZStandard",
    "keys_from_environment",
    "keys_from_file",
    "register",
]
