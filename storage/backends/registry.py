"""URL scheme -> backend class. Cloud backends are imported only when a URL needs them."""

from __future__ import annotations

import importlib
import os
from typing import Any

from extensions.errors import MissingDependencyError
from storage.backends.base import FileSystemBase

# Values are classes or "module:Class" strings imported on first use.
_BACKENDS: dict[str, type[FileSystemBase] | str] = {
    "": "storage.backends._local:LocalFileSystem",
    "file": "storage.backends._local:LocalFileSystem",
    "dcpmem": "storage.backends._memory:MemoryFileSystem",
    "s3": "storage.backends.s3:S3FileSystem",
    "s3a": "storage.backends.s3:S3FileSystem",
    "gs": "storage.backends._gcs:GCSFileSystem",
    "gcs": "storage.backends._gcs:GCSFileSystem",
}
_FSSPEC_FALLBACK = "storage.backends._fsspec:FsspecFileSystem"
_EXTRAS = {
    "storage.backends.s3": "s3",
    "storage.backends._gcs": "gcs",
    "storage.backends._fsspec": "fsspec",
}


def register_filesystem(scheme: str, cls: type[FileSystemBase]) -> None:
    """Route URLs ``scheme://...`` to ``cls`` (replacing any earlier registration)."""
    if not isinstance(scheme, str) or not scheme.isidentifier() and scheme != "":
        raise ValueError(f"invalid URL scheme {scheme!r}")
    if not (isinstance(cls, type) and issubclass(cls, FileSystemBase)):
        raise TypeError(f"{cls!r} is not a storage.FileSystemBase subclass")
    _BACKENDS[scheme.lower()] = cls


def url_scheme(url: str | os.PathLike[str]) -> str:
    text = os.fspath(url)
    scheme, sep, _ = text.partition("://")
    return scheme.lower() if sep else ""


def _resolve(target: type[FileSystemBase] | str) -> type[FileSystemBase]:
    if not isinstance(target, str):
        return target
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if isinstance(exc, MissingDependencyError):
            raise
        extra = _EXTRAS.get(module_name, "all")
        raise MissingDependencyError(
            f"this URL needs an optional dependency ({exc.name or exc}); "
            f"install it with: pip install 'dcp-storage[{extra}]'"
        ) from exc
    cls: type[FileSystemBase] = getattr(module, attr)
    return cls


def filesystem_from_url(
    url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> tuple[FileSystemBase, str]:
    """The backend for ``url`` and the path in that backend's form.

    A plain path or ``file://`` is local disk; ``s3://`` S3; ``gs://``/``gcs://`` GCS;
    ``dcpmem://NAME/path`` the process-wide in-memory store ``NAME``; any other
    protocol fsspec knows goes through :class:`storage.FsspecFileSystem`.
    ``storage_options`` go to the client library unchanged."""
    if not isinstance(url, (str, os.PathLike)):
        raise TypeError(
            f"checkpoint location must be a path or URL string, got {type(url).__name__}"
        )
    if storage_options is not None and not isinstance(storage_options, dict):
        raise TypeError(f"storage_options must be a dict, got {type(storage_options).__name__}")
    scheme = url_scheme(url)
    target = _BACKENDS.get(scheme, _FSSPEC_FALLBACK)
    fs = _resolve(target).from_url(url, storage_options=storage_options)
    return fs, fs.init_path(url)
