"""``GCSFileSystem``: Google Cloud Storage through gcsfs.

gcsfs supplies the client, credentials, configuration and retry rule; the data path is
ours: uploads from reused buffers (``_upload``), ranged GETs straight into the target
(``_read``; over ``_direct``, else through gcsfs's session, ``_session``)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.client
import io
import os
from collections.abc import Iterator
from typing import IO, Any, ClassVar

import aiohttp
import gcsfs
from gcsfs.retry import HttpError

from extensions.errors import CheckpointNotFoundError
from storage.backends._clients import Shared, options_key
from storage.backends._fsspec import FsspecFileSystem
from storage.backends.gcs import _swap
from storage.backends.gcs._direct import direct_get
from storage.backends.gcs._read import open_reader
from storage.backends.gcs._session import Get, StreamedGet
from storage.backends.gcs._upload import Upload

DEFAULT_PART_SIZE = 16 << 20
DEFAULT_SINGLE_REQUEST_SIZE = 64 << 20
DEFAULT_CONNECT_TIMEOUT = 10
DEFAULT_READ_TIMEOUT = 60
_CHUNK_UNIT = 256 << 10  # resumable upload chunks are multiples of 256 KiB

# gcsfs clients shared by the filesystem objects of one process that have the same
# options: each save and load would otherwise open new connections (TLS handshakes)
# and fetch a new access token.
_CLIENTS: Shared[gcsfs.GCSFileSystem] = Shared()


class GCSFileSystem(FsspecFileSystem):
    """Checkpoints in Google Cloud Storage (``gs://bucket/prefix`` or ``gcs://``).

    ``storage_options`` go to ``gcsfs.GCSFileSystem`` (``project``, ``token``,
    ``endpoint_url``, ``requester_pays``, ``session_kwargs``, ...). Unless given,
    ``requests_timeout`` bounds every request at 10 s to connect and 60 s between
    received bytes (no total limit, so large uploads are not cut off).

    Retries are gcsfs's single layer: 6 attempts with exponential backoff and jitter
    on 5xx, 408, 429 and connection errors (the requests of our data path follow the
    same rule and attempts, ``_session.policy``); nothing stacks on top of it.
    Filesystem objects of one process with equal options share one gcsfs client (its
    connections and access token).

    Writes fill ``part_size`` buffers (default 16 MiB, a multiple of 256 KiB) kept for
    reuse across saves. Objects up to ``single_request_size`` (default 64 MiB) go up in
    one request (``uploadType=media``): one round trip, no session to cancel; their
    full buffers are held until the object ends, within a process-wide budget of 256
    MiB (``storage.backends.gcs._upload.HELD``), past which they go up as resumable
    uploads. Larger objects go up as resumable uploads in ``part_size`` chunks
    (sequential within a file, as the protocol requires; files upload in parallel).
    Memory: one buffer per file being written plus at most the held budget. Bodies go
    to the socket as slices of the buffers, never copied whole. A failed write cancels
    its resumable session. ``write_atomic(..., exclusive=True)`` uses
    ``ifGenerationMatch=0``; ``replace_if`` (``storage.backends.swap``) uses
    ``ifGenerationMatch`` with the generation ``read_versioned`` answered.

    A slice is read in windows of ``part_size`` bytes, one ranged GET each, whose body
    lands straight in the caller's buffer (the target tensor); a read that reaches a
    window or more past the current GET is split into window-sized GETs run in
    parallel. GETs go over pooled ``http.client`` connections (``_direct``) unless the
    client's configuration needs its aiohttp session (``session_kwargs``, a client
    certificate, a total ``requests_timeout``). A body that breaks off is resumed from
    the next byte, pinned to the object's generation."""

    protocol: ClassVar[str | None] = "gs"
    io_concurrency: int = 16
    interruptible: ClassVar[bool] = True

    def __init__(
        self,
        *,
        storage_options: dict[str, Any] | None = None,
        part_size: int | None = None,
        single_request_size: int = DEFAULT_SINGLE_REQUEST_SIZE,
        io_concurrency: int | None = None,
    ) -> None:
        super().__init__(storage_options=storage_options)
        size = int(part_size or self.storage_options.get("block_size") or DEFAULT_PART_SIZE)
        if size < _CHUNK_UNIT or size % _CHUNK_UNIT:
            raise ValueError(f"part_size must be a multiple of 256 KiB, got {part_size}")
        self.part_size = size
        self.single_request_size = int(single_request_size)
        if io_concurrency is not None:
            self.io_concurrency = int(io_concurrency)

    def _client_options(self) -> dict[str, Any]:
        opts = dict(self.storage_options)
        opts.setdefault(
            "requests_timeout",
            aiohttp.ClientTimeout(
                total=None, sock_connect=DEFAULT_CONNECT_TIMEOUT, sock_read=DEFAULT_READ_TIMEOUT
            ),
        )
        opts.setdefault("skip_instance_cache", True)
        opts.setdefault("use_listings_cache", False)
        return opts

    def _make_client(self, protocol: str, options: dict[str, Any]) -> Any:
        return _CLIENTS.get(options_key(options), lambda: gcsfs.GCSFileSystem(**options))

    def url(self, path: str) -> str:
        return f"gs://{path}"

    def init_path(self, path: str | os.PathLike[str]) -> str:
        text = os.fspath(path)
        if text.startswith("gcs://"):
            text = "gs://" + text[len("gcs://") :]
        return super().init_path(text)

    # --- overrides -----------------------------------------------------------------

    @contextlib.contextmanager
    def create_stream(self, path: str, mode: str, *, sync: bool = False) -> Iterator[IO[bytes]]:
        if mode == "rb":  # one streamed GET of the whole object, resumed where it breaks
            with self._open_range(path) as reader:
                yield reader
            return
        if mode != "wb":
            raise ValueError(f"unsupported mode {mode!r}: use 'rb' or 'wb'")
        upload = Upload(
            self.fs,
            path,
            functools.partial(self._errors, path),
            part_size=self.part_size,
            single_request_size=self.single_request_size,
        )
        try:
            yield upload  # type: ignore[misc]
        except BaseException:
            upload.abort()
            raise
        upload.finish()  # sync=True needs nothing more: the object is complete

    def open_slice(
        self, path: str, offset: int, length: int
    ) -> contextlib.AbstractContextManager[IO[bytes]]:
        if self._empty_slice(path, offset, length):
            return contextlib.nullcontext(io.BytesIO())
        return self._open_range(path, offset, length)

    def _open_range(
        self, path: str, offset: int = 0, length: int | None = None, *, window: int | None = None
    ) -> contextlib.AbstractContextManager[IO[bytes]]:
        reader = open_reader(
            self.fs,
            self._getter(),
            path,
            offset,
            length,
            functools.partial(self._errors, path),
            window=window or self.part_size,
        )
        return contextlib.closing(reader)  # type: ignore[return-value,arg-type]

    def read_bytes(self, path: str, *, limit: int | None = None) -> bytes:
        # The metadata of a load: the same GET as the data (no aiohttp session to build),
        # one either way: bounded, its range is the whole bound (one window).
        length = self._read_length(limit)
        with self._open_range(path, 0, length, window=length) as reader:
            return reader.read()

    # Compare and swap of replacements (``storage.backends.swap``): generations and
    # ``ifGenerationMatch``; removals stay unconditional (``_swap`` says why).
    def read_versioned(self, path: str, *, limit: int) -> tuple[bytes, str]:
        return _swap.read_versioned(self, path, limit)

    def replace_if(self, directory: str, name: str, data: bytes, version: str | None) -> bool:
        return _swap.replace_if(self, self.concat_path(directory, name), data, version)

    def _getter(self) -> Get:
        """How GETs are sent: the direct path where this client allows it."""
        client = self.fs
        return direct_get(client) or StreamedGet(client)

    def _prepare_parent(self, path: str) -> None:
        pass  # no directories in GCS

    @contextlib.contextmanager
    def _errors(self, path: str, action: str) -> Iterator[None]:
        try:
            with super()._errors(path, action):
                yield
        except HttpError as exc:  # already scrubbed by the base class
            if exc.code in (401, 403):
                raise PermissionError(self._denied(path, action, exc)) from exc
            message = f"{self.url(path)}: {action} failed after retries: {self._describe(exc)}"
            raise OSError(message) from exc
        except (aiohttp.ClientError, asyncio.TimeoutError, http.client.HTTPException) as exc:
            # HTTPException: a malformed answer on the direct path (after the attempts).
            text = self.redactor.redact(repr(exc))
            if isinstance(exc, OSError):  # a connection that failed (after gcsfs's attempts)
                raise ConnectionError(f"{self.url(path)}: {action} failed: {text}") from exc
            raise OSError(f"{self.url(path)}: {action} failed: {text}") from exc
        except OSError as exc:
            if str(exc).startswith("Forbidden"):
                raise PermissionError(self._denied(path, action, exc)) from exc
            builtin = type(exc).__module__ == "builtins"  # not ours, nor a deadline's
            if builtin and isinstance(exc, (ConnectionError, TimeoutError)):
                # The direct path's socket errors name no object: say which, and that
                # gcsfs's attempts are spent.
                message = f"{self.url(path)}: {action} failed after retries: {self._describe(exc)}"
                raise type(exc)(message) from exc
            raise

    def _denied(self, path: str, action: str, exc: BaseException) -> str:
        return (
            f"{self.url(path)}: access denied while {action} ({self._describe(exc)}); check "
            "the credentials "
            "(token in storage_options: a service-account JSON, 'google_default', 'cloud', "
            "or GOOGLE_APPLICATION_CREDENTIALS) and the bucket's IAM policy"
        )

    def exists(self, path: str) -> bool:
        bucket, _, key = path.partition("/")
        if not key:
            return super().exists(path)
        return super().exists(path) or bool(self._has_prefix(path))

    def _has_prefix(self, path: str) -> bool:
        with contextlib.suppress(FileNotFoundError), self._errors(path, "listing"):
            return bool(self._request("ls", path, detail=False, refresh=True))
        return False

    def mkdir(self, path: str) -> None:
        # No directories; but a missing bucket is worth saying before any upload.
        bucket = path.partition("/")[0]
        try:
            self._request("info", bucket)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"{self.url(path)}: bucket {bucket!r} does not exist; create it first, "
                "or fix the URL"
            ) from None
        except Exception:
            pass  # reading bucket metadata may be forbidden to writers that may still write

    def rm_dir(self, path: str) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return os.fspath(checkpoint_id).startswith(("gs://", "gcs://"))
