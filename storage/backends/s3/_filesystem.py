"""``S3FileSystem``: S3 (and S3-compatible stores) through s3fs's botocore client.

s3fs supplies the client, credentials, configuration and ``s3_additional_kwargs``; the
data path is ours (``_io``, through ``_client``): one exact ranged GET streamed per
slice (resumed where a body breaks off), concurrent multipart uploads with bounded
memory and CRC32C checksums, conditional creates.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
from collections.abc import Iterator
from typing import IO, Any, ClassVar

import s3fs  # noqa: F401 - first, so a missing extra is reported as s3fs (registry.py)

from extensions.errors import CheckpointNotFoundError
from storage.backends._fsspec import FsspecFileSystem, listed_names
from storage.backends.base import PendingUpload
from storage.backends.s3 import _swap, _uploads
from storage.backends.s3._client import (
    S3Client,
    shared_s3fs,
    split_path,
)
from storage.backends.s3._endpoint import configured_endpoint, unreachable
from storage.backends.s3._http import error_code
from storage.backends.s3._io import MultipartWriter, open_reader

log = logging.getLogger(__name__)

DEFAULT_PART_SIZE = 8 << 20
MIN_PART_SIZE = 5 << 20
DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_CONNECT_TIMEOUT = 10
DEFAULT_READ_TIMEOUT = 60


class S3FileSystem(FsspecFileSystem):
    """Checkpoints in S3 or an S3-compatible store (``s3://bucket/prefix``).

    ``storage_options`` go to ``s3fs.S3FileSystem`` (``endpoint_url``, ``key``,
    ``secret``, ``token``, ``client_kwargs``, ``config_kwargs``,
    ``s3_additional_kwargs``, ``requester_pays``, ...). Retries belong to botocore
    alone: unless ``config_kwargs`` says otherwise, ``{"retries": {"mode": "standard",
    "total_max_attempts": 5}, "connect_timeout": 10, "read_timeout": 60}``, and s3fs's
    own retry loop is switched off, so a permanent failure costs 5 attempts, never
    5 x 5. A response body that breaks off mid-stream is resumed with a ranged GET
    from the last byte received (the same number of attempts without progress).

    Writes buffer ``part_size`` bytes (default 8 MiB, or s3fs's ``default_block_size``)
    and upload parts concurrently: at most ``max_concurrency`` parts (default 16, or
    s3fs's ``max_concurrency``) are in flight across all streams of this filesystem, so
    client memory peaks near ``part_size x (max_concurrency + open streams)``. Objects
    under one part go up in a single PUT. A failed write aborts its multipart upload.

    Integrity on the wire: with ``checksum=True`` (default) every upload carries the
    CRC32C of its body (``x-amz-checksum-crc32c``; multipart uploads are created with
    ``ChecksumAlgorithm=CRC32C``), which S3 verifies and refuses on a mismatch. The
    payload is therefore not SHA-256-hashed for the SigV4 signature and botocore adds
    no CRC32 of its own (``config_kwargs`` ``s3.payload_signing_enabled``,
    ``request_checksum_calculation`` and ``response_checksum_validation`` override
    this); reads are verified by the items' own CRC32C. ``checksum=False`` is for
    stores that reject checksum headers; then nothing checks a body in transit.

    Data requests (part uploads, ranged GETs) go out over pooled HTTP connections from
    worker threads, signed with the s3fs client's credentials for the URL its endpoint
    rules give, with the same timeouts, attempts and errors; about half the client CPU
    of the aiobotocore stack. Configurations only botocore handles (a proxy, adaptive
    retries, signed payloads, SSE-C keys, requester pays, another signature scheme)
    send them through s3fs, as does ``direct=False``.

    Filesystem objects of one process with the same ``storage_options`` share one
    s3fs client (building one costs about 0.1 s of CPU).
    """

    protocol: ClassVar[str | None] = "s3"
    io_concurrency: int = 16
    interruptible: ClassVar[bool] = True

    def __init__(
        self,
        *,
        storage_options: dict[str, Any] | None = None,
        part_size: int | None = None,
        max_concurrency: int | None = None,
        io_concurrency: int | None = None,
        checksum: bool = True,
        direct: bool = True,
    ) -> None:
        super().__init__(storage_options=storage_options)
        opts = self.storage_options
        self.part_size = int(part_size or opts.get("default_block_size") or DEFAULT_PART_SIZE)
        if self.part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size must be at least 5 MiB (S3's minimum), got {part_size}")
        self.max_concurrency = int(max_concurrency or opts.get("max_concurrency") or 16)
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if io_concurrency is not None:
            self.io_concurrency = int(io_concurrency)
        self.checksum = checksum
        self.direct = direct
        self._client: S3Client | None = None
        # The client holds the upload slots: two first uploads racing to build it would
        # each get slots of their own and together exceed max_concurrency.
        self._client_lock = threading.Lock()

    # --- client --------------------------------------------------------------------

    def _client_options(self) -> dict[str, Any]:
        opts = dict(self.storage_options)
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault(
            "retries", {"mode": "standard", "total_max_attempts": DEFAULT_MAX_ATTEMPTS}
        )
        config.setdefault("connect_timeout", DEFAULT_CONNECT_TIMEOUT)
        config.setdefault("read_timeout", DEFAULT_READ_TIMEOUT)
        config.setdefault(
            "max_pool_connections", max(64, 2 * (self.io_concurrency + self.max_concurrency))
        )
        # Integrity without hashing every byte in Python: our uploads carry a CRC32C
        # the store verifies, and every item carries one the reader verifies. So the
        # payload is not SHA-256-signed (botocore signs it over plain HTTP by default)
        # and botocore computes no CRC32 of its own on requests or responses.
        config["s3"] = {"payload_signing_enabled": False, **(config.get("s3") or {})}
        config.setdefault("request_checksum_calculation", "when_required")
        config.setdefault("response_checksum_validation", "when_required")
        opts["config_kwargs"] = config
        # A private instance: we switch its retry loop off without touching the user's.
        opts.setdefault("skip_instance_cache", True)
        opts.setdefault("use_listings_cache", False)
        return opts

    def _make_client(self, protocol: str, options: dict[str, Any]) -> Any:
        return shared_s3fs(options)

    @property
    def client(self) -> S3Client:
        """Where this filesystem's requests go (built on first use, once per process)."""
        self._in_this_process()
        with self._client_lock:
            if self._client is None:
                self._client = S3Client(
                    self.fs,
                    translate=self._translate,
                    url=self.url,
                    max_attempts=self.max_attempts,
                    part_size=self.part_size,
                    max_concurrency=self.max_concurrency,
                    checksum=self.checksum,
                    direct=self.direct,
                )
            return self._client

    def _forget_clients(self) -> None:
        # Its upload slots, pool threads and direct path are the parent's.
        self._client = None
        self._client_lock = threading.Lock()

    @property
    def max_attempts(self) -> int:
        retries = dict(self._client_options()["config_kwargs"].get("retries") or {})
        if "total_max_attempts" in retries:
            return max(1, int(retries["total_max_attempts"]))
        return max(1, int(retries.get("max_attempts", DEFAULT_MAX_ATTEMPTS - 1)) + 1)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_client"] = None
        del state["_client_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._client_lock = threading.Lock()

    def _call(self, method: str, path: str, action: str, **kwargs: Any) -> Any:
        return self.client.call(method, path, action, **kwargs)

    def _secrets(self) -> list[str]:
        # Beside storage_options: what botocore's chain reads from the environment.
        names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
        return super()._secrets() + [os.environ[n] for n in names if os.environ.get(n)]

    def _translate(self, exc: BaseException, path: str, action: str) -> BaseException:
        """``exc`` (a client error of ``action`` on ``path``) as the contract's error,
        naming the URL; its ``__cause__`` is ``exc`` with every credential removed, or
        none where that cannot be done (raise it ``from`` its ``__cause__``)."""
        cause = self.redactor.scrub(exc)
        error = self._translated(exc, path, action)
        error.__cause__, error.__suppress_context__ = cause, True
        return error

    def _translated(self, exc: BaseException, path: str, action: str) -> BaseException:
        url = self.url(path)
        bucket = split_path(path)[0]
        code = error_code(exc)
        text = self.redactor.redact(str(exc))
        if code == "NoSuchBucket":
            return FileNotFoundError(
                f"{url}: bucket {bucket!r} does not exist ({action}); create it or fix the URL"
            )
        if isinstance(exc, FileNotFoundError) or code in ("NoSuchKey", "404", "NotFound"):
            return FileNotFoundError(f"{url}: no such object ({action})")
        if isinstance(exc, PermissionError) or code in ("AccessDenied", "403"):
            return PermissionError(
                f"{url}: access denied while {action} ({text}); check the credentials "
                "(key/secret/token in storage_options, or AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY / AWS_PROFILE) and the bucket policy"
            )
        if isinstance(exc, FileExistsError):
            return FileExistsError(f"{url} already exists ({action})")
        attempts = self.max_attempts
        if unreachable(exc):
            return ConnectionError(
                f"{url}: cannot reach the S3 endpoint {self._endpoint()} while {action} (after "
                f"up to {attempts} attempts): {text}; check endpoint_url in storage_options "
                "(a custom endpoint is needed by readers as well as writers)"
            )
        return OSError(f"{url}: {action} failed (after up to {attempts} attempts): {text}")

    def _endpoint(self) -> str:
        """The endpoint requests go to, as configured, for messages."""
        given = configured_endpoint(self.storage_options)
        if not given:
            return "of AWS (no endpoint_url given)"
        return self.redactor.redact(given)

    # --- streams -------------------------------------------------------------------

    @contextlib.contextmanager
    def create_stream(self, path: str, mode: str, *, sync: bool = False) -> Iterator[IO[bytes]]:
        if mode == "rb":
            with contextlib.closing(open_reader(self.client, path, 0, None)) as reader:
                yield reader  # type: ignore[misc]
            return
        if mode != "wb":
            raise ValueError(f"unsupported mode {mode!r}: use 'rb' or 'wb'")
        writer = MultipartWriter(self.client, path)
        try:
            yield writer  # type: ignore[misc]
        except BaseException:
            writer.abort()
            raise
        writer.finish()  # sync=True needs nothing more: the upload is complete here

    def open_slice(
        self, path: str, offset: int, length: int
    ) -> contextlib.AbstractContextManager[IO[bytes]]:
        if self._empty_slice(path, offset, length):
            return contextlib.nullcontext(io.BytesIO())
        return contextlib.closing(open_reader(self.client, path, offset, length))  # type: ignore[return-value,arg-type]

    def read_bytes(self, path: str, *, limit: int | None = None) -> bytes:
        # One GET either way: bounded, its range is the whole bound (one window).
        length = self._read_length(limit)
        reader = open_reader(self.client, path, 0, length, window=length)
        with contextlib.closing(reader):
            return reader.readall()

    def write_atomic(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        bucket, key = split_path(path)
        payload = bytes(data)
        condition = {"IfNoneMatch": "*"} if exclusive else {}
        try:
            self._call(
                "put_object",
                path,
                "publishing",
                Bucket=bucket,
                Key=key,
                Body=payload,
                **condition,
                **self.client.checksum_args(payload),
            )
        except OSError as exc:
            code = error_code(exc.__cause__ or exc)
            conflict = code in ("PreconditionFailed", "412", "ConditionalRequestConflict")
            if not exclusive or not (conflict or isinstance(exc, FileExistsError)):
                raise
            # A retried PUT whose first attempt landed also gets 412: that object is ours.
            with contextlib.suppress(OSError):
                if self.read_bytes(path, limit=len(payload)) == payload:  # another's may be huge
                    return
            raise FileExistsError(f"{self.url(path)} already exists") from exc

    # Compare and swap (``storage.backends.swap``): ETags and conditional requests.
    def read_versioned(self, path: str, *, limit: int) -> tuple[bytes, str]:
        return _swap.read_versioned(self, path, limit)

    def replace_if(self, directory: str, name: str, data: bytes, version: str | None) -> bool:
        return _swap.replace_if(self, self.concat_path(directory, name), data, version)

    def remove_if(self, directory: str, name: str, version: str) -> bool:
        return _swap.remove_if(self, self.concat_path(directory, name), version)

    # --- namespace -----------------------------------------------------------------

    def _head(self, path: str, action: str) -> dict[str, Any]:
        bucket, key = split_path(path)
        if not key:
            raise IsADirectoryError(f"{self.url(path)} is a bucket, not an object")
        result: dict[str, Any] = self._call("head_object", path, action, Bucket=bucket, Key=key)
        return result

    def size(self, path: str) -> int:
        return int(self._head(path, "reading the size")["ContentLength"])

    def modified(self, path: str) -> float | None:
        stamp = self._head(path, "reading the modification time").get("LastModified")
        return float(stamp.timestamp()) if stamp is not None else None

    def exists(self, path: str) -> bool:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            self._head(path, "checking existence")
            return True
        return bool(self._list(path, limit=1))

    def rm_file(self, path: str) -> None:
        self._head(path, "deleting")  # S3 deletes missing keys silently; the contract does not
        bucket, key = split_path(path)
        self._call("delete_object", path, "deleting", Bucket=bucket, Key=key)

    def _list(self, path: str, limit: int | None = None) -> list[str]:
        bucket, key = split_path(path)
        prefix = key.rstrip("/") + "/" if key else ""
        names: set[str] = set()
        token: dict[str, str] = {}
        seen: set[object] = set()
        while True:
            page = self._call(
                "list_objects_v2",
                path,
                "listing",
                Bucket=bucket,
                Prefix=prefix,
                Delimiter="/",
                **({"MaxKeys": limit} if limit else {}),
                **token,
            )
            keys = [o["Key"] for o in page.get("Contents", [])]
            keys += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
            names.update(listed_names(keys, prefix, self.url(path)))
            if limit and names or not page.get("IsTruncated"):
                return sorted(names)
            marker = _uploads.next_page(page.get("NextContinuationToken"), seen, path)
            token = {"ContinuationToken": marker}

    def ls(self, path: str) -> list[str]:
        names = self._list(path)
        if not names:
            raise FileNotFoundError(f"{self.url(path)}: nothing under this prefix")
        return names

    def mkdir(self, path: str) -> None:
        # No directories on S3; but a missing bucket is worth saying before any upload.
        bucket = split_path(path)[0]
        try:
            self._call("head_bucket", path, "checking the bucket", Bucket=bucket)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"{self.url(path)}: bucket {bucket!r} does not exist; create it first, "
                "or fix the URL"
            ) from None
        except OSError:
            pass  # HeadBucket may be forbidden to writers that may still PUT objects

    def rm_dir(self, path: str) -> None:
        # No directories on S3. Stores that keep one for every prefix (SeaweedFS's
        # filer) drop an empty one when its marker key is deleted; elsewhere that
        # delete is a no-op. Only ever for a prefix with nothing under it.
        bucket, key = split_path(path)
        if key.strip("/") and not self._list(path, limit=1):
            marker = key.rstrip("/") + "/"
            self._call("delete_object", path, "removing", Bucket=bucket, Key=marker)

    def pending_uploads(self, path: str) -> list[PendingUpload]:
        return _uploads.pending(self.client, path)

    def abort_upload(self, upload: PendingUpload) -> None:
        _uploads.abort(self.client, upload)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return os.fspath(checkpoint_id).startswith(("s3://", "s3a://"))
