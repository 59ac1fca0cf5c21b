"""``FsspecFileSystem``: any fsspec URL (``memory://``, ``file://``, ``hdfs://``, ...).

The base of the S3 and GCS backends, which override the paths where a generic fsspec
filesystem cannot give the contract's guarantees (exact ranged streaming, parallel
multipart uploads, conditional creates).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import posixpath
from collections.abc import Iterator
from typing import IO, Any

import fsspec
from fsspec.core import split_protocol
from fsspec.implementations.local import LocalFileSystem as FsspecLocalFileSystem
from fsspec.spec import AbstractBufferedFile

from extensions.errors import printable
from storage.backends import _local_files, _local_links, _local_removal, _local_writes
from storage.backends._fsspec_client import FsspecClientBackend
from storage.backends._ranges import RangeMismatchError, WindowReader

log = logging.getLogger(__name__)


class FsspecFileSystem(FsspecClientBackend):
    """Checkpoints on any filesystem fsspec knows.

    ``storage_options`` are the keyword arguments of the fsspec filesystem class for the
    URL's protocol, passed unchanged (``fsspec.filesystem(protocol, **storage_options)``).
    Paths are in fsspec's form for that protocol (the protocol stripped, as
    ``_strip_protocol`` does); :meth:`url` puts it back for messages. The protocol comes
    from the first URL given to :meth:`init_path`, or from ``protocol=``.

    Writes go through the filesystem's own file objects; a failed write discards the
    file (or deletes what became visible). Slices are read as exact ranged reads
    (``cat_file(path, start, end)``) in windows of 16 MiB. ``memory://`` is fsspec's
    process-global store: it lives in this process (:attr:`in_process`)."""

    # --- paths ---------------------------------------------------------------------

    @property
    def in_process(self) -> bool:
        return self._protocol == "memory"

    def init_path(self, path: str | os.PathLike[str]) -> str:
        text = os.fspath(path)
        protocol, _ = split_protocol(text)
        if protocol is not None:
            cls = fsspec.get_filesystem_class(protocol)
            known = cls.protocol if isinstance(cls.protocol, (tuple, list)) else (cls.protocol,)
            if self._protocol is None:
                self._protocol = protocol
            elif protocol != self._protocol and self._protocol not in known:
                raise ValueError(
                    f"{text!r} is not a {self._protocol}:// URL; {type(self).__name__} "
                    f"here serves {self._protocol}://"
                )
        elif self._protocol is None:
            raise ValueError(
                f"{text!r} has no protocol; give a URL such as 'memory://ckpt' "
                "(plain paths are local disk: use storage.LocalFileSystem)"
            )
        stripped: str = fsspec.get_filesystem_class(self._protocol)._strip_protocol(text)
        return stripped.rstrip("/") or stripped

    def concat_path(self, path: str, suffix: str) -> str:
        if not path:
            return suffix
        return posixpath.join(path, suffix)

    def url(self, path: str) -> str:
        if self._protocol is None:
            return path
        return f"{self._protocol}://{path}"

    # --- streams -------------------------------------------------------------------

    @contextlib.contextmanager
    def create_stream(self, path: str, mode: str, *, sync: bool = False) -> Iterator[IO[bytes]]:
        if mode == "rb":
            if self.local_disk:
                with _local_files.open_regular(path) as stream:
                    yield stream
                return
            with self._errors(path, "opening for reading"):
                stream = self.fs.open(path, "rb")
            with stream:
                yield stream
            return
        if mode != "wb":
            raise ValueError(f"unsupported mode {mode!r}: use 'rb' or 'wb'")
        if self.local_disk:
            with _local_files.write_stream(path, sync=sync) as stream:
                yield stream
            return
        self._prepare_parent(path)
        with self._errors(path, "opening for writing"):
            stream = self._open_for_write(path)
        try:
            yield stream
        except BaseException:
            self._abandon(stream, path)
            raise
        with self._errors(path, "writing"):
            stream.close()  # commits; sync=True needs nothing more: close completes the upload

    @property
    def local_disk(self) -> bool:
        """Whether this is fsspec's local filesystem (``file://``): its files are written
        and read as the local backend writes and reads them
        (:mod:`~storage.backends._local_files`): never through a link, never into or from
        a FIFO (which would block), never into another user's file planted at the name,
        where fsspec's own ``open`` and ``cat_file`` would."""
        return isinstance(self.fs, FsspecLocalFileSystem)

    def _open_for_write(self, path: str) -> Any:
        return self.fs.open(path, "wb")

    def _prepare_parent(self, path: str) -> None:
        parent = posixpath.dirname(path)
        if parent:
            self.mkdir(parent)

    @contextlib.contextmanager
    def _errors(self, path: str, action: str) -> Iterator[None]:
        """Re-raise client errors as the built-in a caller expects, naming the URL, with
        every credential removed from them (:attr:`redactor`)."""
        try:
            yield
        except (FileNotFoundError, FileExistsError, IsADirectoryError) as exc:
            cause = self.redactor.scrub(exc)
            if cause is not None and self.url(path) in str(exc):
                raise
            message = f"{self.url(path)}: {action}: {self._describe(exc)}"
            raise type(exc)(message) from cause
        except PermissionError as exc:
            raise PermissionError(self._denied(path, action, exc)) from self.redactor.scrub(exc)
        except Exception as exc:  # the subclasses' translations come next
            if self.redactor.scrub(exc) is not None:
                raise
            message = f"{self.url(path)}: {action} failed: {self._describe(exc)}"
            raise OSError(message) from None

    def _describe(self, exc: BaseException) -> str:
        """The first line of ``exc``'s message, credentials removed."""
        text = self.redactor.redact(str(exc)).strip()
        return text.splitlines()[0] if text else type(exc).__name__

    def _denied(self, path: str, action: str, exc: BaseException) -> str:
        return (
            f"{self.url(path)}: access denied while {action} ({self._describe(exc)}); check "
            "the credentials in storage_options"
        )

    def _abandon(self, stream: Any, path: str) -> None:
        """Throw away a half-written file without publishing it.

        A buffered object-store upload (``AbstractBufferedFile``: S3, GCS, Azure, ...)
        is cancelled and has touched nothing at ``path``, so an object already there
        stays, as the contract says. Other streams wrote to ``path`` directly (local
        files, ``memory://``): what they wrote is removed."""
        try:
            if isinstance(stream, AbstractBufferedFile):
                # close() would upload what is buffered; discard() cancels instead.
                stream.discard()
                stream.closed = True
                return
            stream.close()
            if self._request("exists", path):
                self._request("rm_file", path)
        except Exception as exc:  # the caller's error is the one to report
            log.warning(
                "could not discard the partial write of %s: %s",
                self.url(path),
                self.redactor.redact(str(exc)),
            )

    def open_slice(
        self, path: str, offset: int, length: int
    ) -> contextlib.AbstractContextManager[IO[bytes]]:
        if self.local_disk:
            return _local_files.open_slice(path, offset, length)
        if self._empty_slice(path, offset, length):
            return contextlib.nullcontext(io.BytesIO())
        reader = WindowReader(self._fetch_range, path, offset, length)
        reader.prefetch()
        return contextlib.closing(reader)  # type: ignore[return-value,arg-type]

    @contextlib.contextmanager
    def _reading(self, path: str) -> Iterator[None]:
        """:meth:`_errors` of a read, and a client's own error that is no ``OSError``
        (aiohttp's body cut short of its ``Content-Length``, botocore's checksum that
        did not match) as an ``OSError`` naming the URL: raised raw, it named no object,
        and one raised while an item decodes read as damage to the item."""
        try:
            with self._errors(path, "reading"):
                yield
        except OSError:
            raise
        except Exception as exc:
            raise OSError(f"{self.url(path)}: reading failed: {self._describe(exc)}") from exc

    def _fetch_range(self, path: str, start: int, end: int) -> bytes:
        with self._reading(path):
            data: bytes = self._request("cat_file", path, start=start, end=end)
        # fsspec hands back the body alone: a server that ignored the range (the whole
        # object) shows as more bytes than asked for, which are the range only from byte
        # 0; the S3 and GCS backends check the status and Content-Range of every answer.
        if len(data) > end - start:
            if start == 0:
                return data[:end]
            raise RangeMismatchError(
                f"{self.url(path)}: asked for bytes {start}-{end - 1} and got {len(data)} "
                "bytes: the server ignored the range (sent the whole object?); reading them "
                "would load other bytes. The store must support range requests"
            )
        return data

    def read_bytes(self, path: str, *, limit: int | None = None) -> bytes:
        if self.local_disk:  # through create_stream: the guarded open
            return super().read_bytes(path, limit=limit)
        length = self._read_length(limit)
        if length is not None:  # one ranged request
            return self._fetch_range(path, 0, length)
        with self._reading(path):
            data: bytes = self._request("cat_file", path)
        return data

    def write_atomic(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        if self.local_disk:  # fsspec's pipe_file writes the file in place, through a link
            _local_files.write_atomic(path, bytes(data), exclusive=exclusive)
            return
        self._prepare_parent(path)
        payload = bytes(data)
        try:
            with self._errors(path, "publishing"):
                # fsspec's "create" mode is the store's conditional create where it has one.
                self._request(
                    "pipe_file", path, payload, mode="create" if exclusive else "overwrite"
                )
        except FileExistsError:
            # A retried create whose first attempt landed is refused too: that one is ours.
            with contextlib.suppress(OSError):
                if self.read_bytes(path, limit=len(payload)) == payload:  # another's may be huge
                    return
            raise

    def create_stream_in(
        self, directory: str, name: str, mode: str = "wb", *, sync: bool = False
    ) -> contextlib.AbstractContextManager[IO[bytes]]:
        if mode == "wb" and self._walks("create_stream"):  # never through a link on the way
            return _local_writes.write_stream_in(directory, name, sync=sync)
        return super().create_stream_in(directory, name, mode, sync=sync)

    def write_atomic_in(
        self, directory: str, name: str, data: bytes, *, exclusive: bool = False
    ) -> None:
        if self._walks("write_atomic"):
            _local_writes.write_atomic_in(directory, name, bytes(data), exclusive=exclusive)
            return
        super().write_atomic_in(directory, name, data, exclusive=exclusive)

    def _walks(self, method: str) -> bool:
        """Whether writes of ``method``'s kind walk directory handles: on local disk,
        unless a subclass wraps ``method`` (it then sees them by path)."""
        return self.local_disk and not _local_writes.overridden(self, FsspecFileSystem, method)

    # --- metadata and namespace ----------------------------------------------------

    def size(self, path: str) -> int:
        with self._errors(path, "reading the size"):
            info = self._request("info", path)
        if info.get("type") == "directory":
            raise IsADirectoryError(f"{self.url(path)} is a directory")
        return int(info["size"])

    def exists(self, path: str) -> bool:
        with self._errors(path, "checking existence"):
            return bool(self._request("exists", path))

    def modified(self, path: str) -> float | None:
        try:
            return float(self._request("modified", path).timestamp())
        except (NotImplementedError, AttributeError, KeyError, TypeError):
            return None

    def rm_file(self, path: str) -> None:
        with self._errors(path, "deleting"):
            info = self._request("info", path)  # FileNotFoundError if missing, as the contract says
            if info.get("type") == "directory":
                raise IsADirectoryError(f"{self.url(path)} is a directory")
            self._request("rm_file", path)

    def rm_file_in(self, directory: str, name: str) -> None:
        if self.local_disk:  # never through a link (_local_removal.remove_file)
            _local_removal.remove_file(directory, name)
            return
        super().rm_file_in(directory, name)

    def rm_dir_in(self, directory: str, name: str = "") -> None:
        if self.local_disk:
            with contextlib.suppress(OSError):  # as rm_dir: only an empty directory goes
                _local_removal.remove_dir(directory, name)
            return
        super().rm_dir_in(directory, name)

    def rename_in(self, directory: str, name: str, new_name: str) -> None:
        if self.local_disk:
            _local_removal.rename_in(directory, name, new_name)
            return
        super().rename_in(directory, name, new_name)

    def rename(self, path: str, new_path: str) -> None:
        if self.local_disk:  # fsspec's mv moves into a directory planted at new_path
            os.replace(path, new_path)
            return
        with self._errors(path, f"renaming to {self.url(new_path)}"):
            self.size(path)  # FileNotFoundError (or IsADirectoryError) before anything
            self._request("mv", path, new_path)  # the client's copy (server-side where it can)

    def is_link(self, path: str) -> bool:
        islink = getattr(self.fs, "islink", None)  # fsspec's local filesystem has links
        return bool(islink(path)) if callable(islink) else False

    def realpath(self, path: str) -> str:
        # fsspec's local filesystem (the one with links) takes plain absolute paths.
        return os.path.realpath(path) if callable(getattr(self.fs, "islink", None)) else path

    def resolve_link(self, path: str) -> str:
        if self.local_disk:
            return _local_links.trusted_target(path)
        return super().resolve_link(path)

    def ls(self, path: str) -> list[str]:
        with self._errors(path, "listing"):
            entries = self._request("ls", path, detail=False, refresh=True)
        strip = type(self.fs)._strip_protocol  # entries in the form paths have here
        # Some filesystems list a file as itself.
        keys = [k for e in entries if (k := str(strip(str(e)))).rstrip("/") != path.rstrip("/")]
        return sorted(listed_names(keys, path.rstrip("/") + "/" if path else "", self.url(path)))

    def mkdir(self, path: str) -> None:
        with self._errors(path, "creating the directory"):
            self._request("makedirs", path, exist_ok=True)

    def rm_dir(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError, OSError, NotImplementedError):
            if self._request("isdir", path) and not self._request("ls", path, detail=False):
                self._request("rmdir", path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        protocol, _ = split_protocol(os.fspath(checkpoint_id))
        if protocol is None:
            return False
        return cls.protocol is None or protocol == cls.protocol


def listed_names(keys: list[str], prefix: str, url: str) -> set[str]:
    """The names right under ``prefix`` (it ends with ``/``, or is empty) that listed
    ``keys`` give: the part after the prefix, up to the next ``/``. A store (or proxy)
    may list keys outside the prefix, or ``.`` and ``..``: cut to a name, each would
    stand for some other object (and a deletion remove it); they are left out, with a
    warning naming ``url``."""
    names: set[str] = set()
    strays = []
    for key in keys:
        name = key[len(prefix) :].split("/", 1)[0] if key.startswith(prefix) else None
        if name is None or name in (".", ".."):
            strays.append(key)
        elif name:
            names.add(name)
    if strays:
        log.warning(
            "%s: the listing named %d key(s) that are not under it, left out (the store or "
            "a proxy answers listings wrongly): %s",
            url,
            len(strays),
            printable(repr(strays[:3]), 200),
        )
    return names
