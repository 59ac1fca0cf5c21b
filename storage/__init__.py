"""dcp-storage: pluggable storage backends for torch.distributed.checkpoint."""

from storage._local import LocalFileSystem
from storage._memory import MemoryFileSystem
from storage.api import async_save, load, save
from storage.base import FileSystemBase
from storage.manager import CheckpointManager
from storage.reader import CheckpointReader
from storage.registry import filesystem_from_url, register_filesystem
from storage.transport import StorageTransport
from storage.writer import CheckpointWriter

__all__ = [
    "CheckpointManager",
    "CheckpointReader",
    "CheckpointWriter",
    "FileSystemBase",
    "FsspecFileSystem",
    "GCSFileSystem",
    "LocalFileSystem",
    "MemoryFileSystem",
    "S3FileSystem",
    "StorageTransport",
    "async_save",
    "filesystem_from_url",
    "load",
    "register_filesystem",
    "save",
]


def __getattr__(name: str) -> object:
    # Cloud backends import their client libraries; load them only when asked for.
    lazy = {
        "FsspecFileSystem": "storage._fsspec",
        "S3FileSystem": "storage._s3",
        "GCSFileSystem": "storage._gcs",
    }
    if name in lazy:
        from storage.registry import _resolve

        return _resolve(f"{lazy[name]}:{name}")
    raise AttributeError(f"module 'storage' has no attribute {name!r}")
