"""URL scheme -> backend class, in one table.

The built-in backends are rows of :data:`BUILTIN`: where the class lives and which
extra installs its client library. :func:`register_filesystem` adds or replaces a
scheme for this process; installed packages advertise more under the
``dcp_storage.filesystems`` entry-point group (name: the URL scheme, value:
``module:Class``), scanned once per process and only when a URL's scheme is not
otherwise known. Any other scheme goes to fsspec. A backend's module is imported only
when a URL (or its public name, ``storage.S3FileSystem``) asks for it; a client
library that is missing then raises ``MissingDependencyError`` naming what to install.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import threading
from importlib import metadata as importlib_metadata
from typing import Any

from extensions.errors import MissingDependencyError
from storage.backends.base import FileSystemBase

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "dcp_storage.filesystems"


@dataclasses.dataclass(frozen=True)
class Backend:
    """One row of the table: the class (or ``"module:Class"``, imported on first use)
    and what to install when importing it fails (``extra``: a dcp-storage extra;
    ``hint``: any other advice)."""

    target: type[FileSystemBase] | str
    extra: str | None = None
    hint: str | None = None

    @property
    def name(self) -> str:
        if isinstance(self.target, str):
            return self.target.rpartition(":")[2].rpartition(".")[2]
        return self.target.__name__

    def load(self, needed_by: str) -> type[FileSystemBase]:
        """The class; ``needed_by`` (``"s3:// URLs"``) says what asked, in errors."""
        if not isinstance(self.target, str):
            return self.target
        module_name, _, attr = self.target.partition(":")
        try:
            found: Any = importlib.import_module(module_name)
        except ImportError as exc:
            if isinstance(exc, MissingDependencyError):
                raise
            if self.extra is not None:
                advice = f"install it with: pip install 'dcp-storage[{self.extra}]'"
            else:
                advice = self.hint or "install the package that provides it"
            raise MissingDependencyError(
                f"{self.name} (for {needed_by}) needs a dependency that is not installed "
                f"({exc.name or exc}); {advice}"
            ) from exc
        for part in attr.split("."):
            found = getattr(found, part)
        if not (isinstance(found, type) and issubclass(found, FileSystemBase)):
            raise TypeError(f"{self.target} ({needed_by}) is not a storage.FileSystemBase subclass")
        return found


_LOCAL = Backend("storage.backends._local:LocalFileSystem")
_S3 = Backend("storage.backends.s3:S3FileSystem", extra="s3")
_GCS = Backend("storage.backends.gcs:GCSFileSystem", extra="gcs")
FSSPEC = Backend("storage.backends._fsspec:FsspecFileSystem", extra="fsspec")

#: The built-in backends by URL scheme (``""``: a plain path); any other scheme that
#: nothing registered goes to :data:`FSSPEC`.
BUILTIN: dict[str, Backend] = {
    "": _LOCAL,
    "file": _LOCAL,
    "dcpmem": Backend("storage.backends._memory:MemoryFileSystem"),
    "s3": _S3,
    "s3a": _S3,
    "gs": _GCS,
    "gcs": _GCS,
}

#: Public names of the backends whose client library is optional, resolved on first
#: use (``storage.S3FileSystem``); they stay out of ``__all__``.
LAZY_NAMES: dict[str, Backend] = {b.name: b for b in (*BUILTIN.values(), FSSPEC) if b.extra}

_registered: dict[str, Backend] = {}
_plugins: dict[str, Backend] = {}
_plugins_loaded = False
_lock = threading.Lock()


def register_filesystem(scheme: str, cls: type[FileSystemBase]) -> None:
    """Route URLs ``scheme://...`` to ``cls`` in this process, before the built-in
    backends and the installed plugins (replacing any earlier registration)."""
    _check_scheme(scheme)
    if not (isinstance(cls, type) and issubclass(cls, FileSystemBase)):
        raise TypeError(f"{cls!r} is not a storage.FileSystemBase subclass")
    with _lock:
        _registered[scheme.lower()] = Backend(cls)


def _check_scheme(scheme: object) -> None:
    if not isinstance(scheme, str) or not scheme.isidentifier() and scheme != "":
        raise ValueError(f"invalid URL scheme {scheme!r}")


def url_scheme(url: str | os.PathLike[str]) -> str:
    text = os.fspath(url)
    scheme, sep, _ = text.partition("://")
    return scheme.lower() if sep else ""


def serves(url: object) -> bool:
    """Whether :func:`filesystem_from_url` has a backend for ``url``: a plain path, a
    scheme registered, built in or a plugin's, or a protocol fsspec knows (what torch's
    writers and readers answer in ``validate_checkpoint_id``, which DCP and frameworks
    ask to pick a storage for a ``checkpoint_id``). Nothing is imported but fsspec."""
    if not isinstance(url, (str, os.PathLike)):
        return False
    scheme = url_scheme(url)
    with _lock:
        if scheme in _registered or scheme in BUILTIN:
            return True
    if scheme in _load_plugins():
        return True
    try:
        import fsspec
    except ImportError:
        return False
    return scheme in fsspec.available_protocols()


def backend_for(scheme: str) -> Backend:
    """The row that serves ``scheme``: registered, built in, a plugin's, or fsspec."""
    with _lock:
        found = _registered.get(scheme) or BUILTIN.get(scheme)
    if found is None:
        found = _load_plugins().get(scheme, FSSPEC)
    return found


def _load_plugins() -> dict[str, Backend]:
    """The backends of the installed packages' entry points, read once per process
    (their modules are imported only when a URL needs them)."""
    global _plugins_loaded
    with _lock:
        if _plugins_loaded:
            return _plugins
        for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
            where = f"{ep.value} (entry point {ep.name!r} of {_dist_name(ep)})"
            try:
                _check_scheme(ep.name)
            except ValueError as exc:
                log.warning("filesystem plugin %s ignored: %s", where, exc)
                continue
            scheme = ep.name.lower()
            if scheme in BUILTIN:
                log.warning(
                    "filesystem plugin %s ignored: %s:// is built in "
                    "(storage.register_filesystem replaces it explicitly)",
                    where,
                    scheme,
                )
                continue
            _plugins.setdefault(
                scheme, Backend(ep.value, hint=f"check the installation of {_dist_name(ep)}")
            )
        _plugins_loaded = True
        return _plugins


def _dist_name(ep: importlib_metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return str(dist.name) if dist is not None else "its package"


def filesystem_from_url(
    url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> tuple[FileSystemBase, str]:
    """The backend for ``url`` and the path in that backend's form.

    A plain path or ``file://`` is local disk; ``s3://`` S3; ``gs://``/``gcs://`` GCS;
    ``dcpmem://NAME/path`` the process-wide in-memory store ``NAME``; a scheme
    registered with :func:`register_filesystem` or by an installed plugin its backend;
    any other protocol fsspec knows goes through :class:`storage.FsspecFileSystem`.
    ``storage_options`` go to the client library unchanged."""
    if not isinstance(url, (str, os.PathLike)):
        raise TypeError(
            f"checkpoint location must be a path or URL string, got {type(url).__name__}"
        )
    if storage_options is not None and not isinstance(storage_options, dict):
        raise TypeError(f"storage_options must be a dict, got {type(storage_options).__name__}")
    scheme = url_scheme(url)
    cls = backend_for(scheme).load(f"{scheme}:// URLs" if scheme else "local paths")
    fs = cls.from_url(url, storage_options=storage_options)
    return fs, fs.init_path(url)
