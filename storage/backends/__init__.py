"""Where bytes live: the ``FileSystemBase`` contract, the URL registry and one module
per backend (local disk, memory, any fsspec URL, S3 and GCS as small packages, and an
adapter for torch-style filesystems).

This layer knows files and objects, never checkpoints: it imports nothing from
``storage.checkpoint``, ``storage.ops`` or ``storage.cli``. Cloud backends import their
client libraries, so they load lazily (through the registry's table or the names
below)."""

from storage.backends._local import LocalFileSystem
from storage.backends._memory import MemoryFileSystem
from storage.backends._ranges import RangeMismatchError
from storage.backends._torch import TorchFileSystem
from storage.backends.base import FileSystemBase
from storage.backends.registry import LAZY_NAMES as _LAZY
from storage.backends.registry import filesystem_from_url, register_filesystem

# The lazy names (registry.LAZY_NAMES: FsspecFileSystem, S3FileSystem, GCSFileSystem)
# stay out of __all__: `from storage.backends import *` would import every client
# library and fail where one is not installed.
__all__ = [
    "FileSystemBase",
    "LocalFileSystem",
    "MemoryFileSystem",
    "RangeMismatchError",
    "TorchFileSystem",
    "filesystem_from_url",
    "register_filesystem",
]


def __getattr__(name: str) -> object:
    backend = _LAZY.get(name)
    if backend is not None:
        return backend.load(f"storage.{name}")
    raise AttributeError(f"module 'storage.backends' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
