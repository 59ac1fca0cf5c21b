"""``GCSFileSystem``: Google Cloud Storage through gcsfs."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, ClassVar

from extensions.errors import CheckpointNotFoundError, MissingDependencyError
from storage.backends._fsspec import FsspecFileSystem

# gcsfs otherwise probes every bucket for hierarchical namespaces over gRPC/TLS, which
# hangs for a minute against emulators and private endpoints.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

try:
    import aiohttp
    import gcsfs
    from gcsfs.retry import HttpError
except ImportError as _exc:  # pragma: no cover - exercised without the extra installed
    raise MissingDependencyError(
        f"gs:// URLs need gcsfs ({_exc.name or _exc}); install it with: "
        "pip install 'dcp-storage[gcs]'"
    ) from _exc

DEFAULT_PART_SIZE = 16 << 20
DEFAULT_CONNECT_TIMEOUT = 10
DEFAULT_READ_TIMEOUT = 60
_CHUNK_UNIT = 256 << 10  # resumable upload chunks are multiples of 256 KiB


class GCSFileSystem(FsspecFileSystem):
    """Checkpoints in Google Cloud Storage (``gs://bucket/prefix`` or ``gcs://``).

    ``storage_options`` go to ``gcsfs.GCSFileSystem`` (``project``, ``token``,
    ``endpoint_url``, ``requester_pays``, ``session_kwargs``, ...). Unless given,
    ``requests_timeout`` bounds every request at 10 s to connect and 60 s between
    received bytes (no total limit, so large uploads are not cut off).

    Retries are gcsfs's single layer: 6 attempts with exponential backoff and jitter
    (sleeps of about 1, 2, 4, 8, 16 s) on 5xx, 408, 429 and connection errors; nothing
    stacks on top of it.

    Writes buffer ``part_size`` bytes (default 16 MiB, a multiple of 256 KiB): objects
    that fit go up in one request, larger ones as a resumable upload in ``part_size``
    chunks (sequential within a file, as the protocol requires; files upload in
    parallel). A failed write cancels its resumable session. ``write_atomic(...,
    exclusive=True)`` uses ``ifGenerationMatch=0``."""

    protocol: ClassVar[str | None] = "gs"
    io_concurrency: int = 16

    def __init__(
        self,
        *,
        storage_options: dict[str, Any] | None = None,
        part_size: int | None = None,
        io_concurrency: int | None = None,
    ) -> None:
        super().__init__(storage_options=storage_options)
        size = int(part_size or self.storage_options.get("block_size") or DEFAULT_PART_SIZE)
        if size < _CHUNK_UNIT or size % _CHUNK_UNIT:
            raise ValueError(f"part_size must be a multiple of 256 KiB, got {part_size}")
        self.part_size = size
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
        return gcsfs.GCSFileSystem(**options)

    def url(self, path: str) -> str:
        return f"gs://{path}"

    def init_path(self, path: str | os.PathLike[str]) -> str:
        text = os.fspath(path)
        if text.startswith("gcs://"):
            text = "gs://" + text[len("gcs://") :]
        return super().init_path(text)

    # --- overrides -----------------------------------------------------------------

    def _open_for_write(self, path: str) -> Any:
        return self.fs.open(path, "wb", block_size=self.part_size)

    def _prepare_parent(self, path: str) -> None:
        pass  # no directories in GCS

    @contextlib.contextmanager
    def _errors(self, path: str, action: str) -> Iterator[None]:
        try:
            with super()._errors(path, action):
                yield
        except HttpError as exc:
            if exc.code in (401, 403):
                raise PermissionError(self._denied(path, action, exc)) from exc
            raise OSError(f"{self.url(path)}: {action} failed after retries: {exc}") from exc
        except OSError as exc:
            if str(exc).startswith("Forbidden"):
                raise PermissionError(self._denied(path, action, exc)) from exc
            raise

    def _denied(self, path: str, action: str, exc: BaseException) -> str:
        return (
            f"{self.url(path)}: access denied while {action} ({exc}); check the credentials "
            "(token in storage_options: a service-account JSON, 'google_default', 'cloud', "
            "or GOOGLE_APPLICATION_CREDENTIALS) and the bucket's IAM policy"
        )

    def _fetch_range(self, path: str, start: int, end: int) -> bytes:
        try:
            return super()._fetch_range(path, start, end)
        except HttpError as exc:
            if exc.code == 416:  # the range starts past the end: a short read
                return b""
            raise

    def exists(self, path: str) -> bool:
        bucket, _, key = path.partition("/")
        if not key:
            return super().exists(path)
        return super().exists(path) or bool(self._has_prefix(path))

    def _has_prefix(self, path: str) -> bool:
        with contextlib.suppress(FileNotFoundError):
            return bool(self.fs.ls(path, detail=False, refresh=True))
        return False

    def mkdir(self, path: str) -> None:
        # No directories; but a missing bucket is worth saying before any upload.
        bucket = path.partition("/")[0]
        try:
            self.fs.info(bucket)
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
