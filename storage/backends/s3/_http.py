"""Part uploads and ranged GETs over pooled ``http.client`` connections.

The bodies of a checkpoint's data requests skip the aiobotocore stack: an ``UploadPart``
goes to the socket in one ``sendall`` of the part buffer, and a ranged ``GetObject``
lands in the caller's buffer with ``readinto``, both from the calling thread with the
GIL released. Measured on SeaweedFS, that halves the client CPU of uploads and of
ranged reads (benchmarks/NOTES.md, "Where our client CPU went"). Everything else -
creating, completing and aborting uploads, small PUTs, HEAD, listing, deleting - stays
on s3fs.

Nothing here decides where or how to send a request on its own: the object URL, the
signing region and whether to sign at all come from one request per bucket that the
s3fs client prepares and signs but never sends (``_endpoint``: its endpoint rules,
addressing style and configuration), the credentials from that client's signer (refreshed as it
refreshes them), TLS settings from its HTTP session, timeouts and attempts from its
configuration, and errors are turned into s3fs's exceptions. A configuration this
module does not reproduce exactly (a proxy, adaptive retries, signed payloads, another
signature scheme, per-request arguments such as SSE-C keys or ``RequestPayer``) gets
no :class:`DirectPath`, and its requests go through s3fs.
"""

from __future__ import annotations

import http.client
import inspect
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import botocore.exceptions
import s3fs
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from s3fs.errors import translate_boto_error

from storage.backends._clients import Shared
from storage.backends._connections import ConnectionPool, PooledResponse
from storage.backends._retry import Retry
from storage.backends._secrets import BY_FORM
from storage.backends.cancel import Cancel
from storage.backends.s3 import _compat as compat
from storage.backends.s3._endpoint import (
    Bucket,
    Runner,
    check_client,
    quote,
    resolve,
)

log = logging.getLogger(__name__)


# What botocore's standard retry mode retries besides connection errors and timeouts.
_TRANSIENT_STATUS = frozenset({500, 502, 503, 504})
_RETRIED_CODES = frozenset(
    {
        "BandwidthLimitExceeded",
        "EC2ThrottledException",
        "LimitExceededException",
        "PriorRequestNotComplete",
        "ProvisionedThroughputExceededException",
        "RequestLimitExceeded",
        "RequestThrottled",
        "RequestThrottledException",
        "RequestTimeout",
        "RequestTimeoutException",
        "SlowDown",
        "ThrottledException",
        "Throttling",
        "ThrottlingException",
        "TooManyRequestsException",
        "TransactionInProgressException",
    }
)
# Frozen credentials are asked for again after this long; refreshable ones refresh
# minutes before they expire, so a copy this old is still valid.
CREDENTIALS_TTL = 60.0
_ERROR_BODY_LIMIT = 1 << 16
_USER_AGENT = "dcp-storage"
_UNSAFE = re.compile(r"[\r\n\x00]")


def retryable(exc: BaseException) -> bool:
    """botocore's standard retry rule: connection errors and timeouts, 5xx, throttling."""
    if isinstance(exc, (OSError, http.client.HTTPException)):
        return True
    status = (
        (getattr(exc, "response", None) or {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
    )
    return status in _TRANSIENT_STATUS or error_code(exc) in _RETRIED_CODES


def error_code(exc: BaseException) -> str:
    """The S3 error code of a botocore error (or of its cause), else ``""``."""
    for err in (exc, exc.__cause__):
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            return str(response.get("Error", {}).get("Code", ""))
    return ""


class DirectPath:
    """Signed ``UploadPart`` and ranged ``GetObject`` requests for one s3fs client.

    ``run`` runs a coroutine function on the client's event loop (presigning, credential
    refresh); ``max_attempts``, the timeouts and the TLS context are the client's."""

    def __init__(
        self,
        s3: s3fs.S3FileSystem,
        *,
        run: Runner,
        config: Any,
        max_attempts: int,
        ssl_contexts: Callable[[], Any] | None,
    ) -> None:
        self._s3 = s3
        self._run = run
        self._config = config
        self.retry = Retry(max_attempts, retryable)
        # TLS settings built on first use (reading CA bundles costs ~20 ms).
        self._pool = ConnectionPool(
            connect_timeout=config.connect_timeout,
            read_timeout=config.read_timeout,
            ssl_context=lambda: ssl_contexts()[0] if ssl_contexts is not None else None,
        )
        self._lock = threading.Lock()
        self._buckets: dict[str, Bucket | None] = {}
        self._frozen: dict[int, tuple[Any, float]] = {}

    # --- where and how ------------------------------------------------------------

    def serves(self, bucket: str) -> bool:
        """Whether requests to ``bucket`` can go this way (else through s3fs)."""
        with self._lock:
            if bucket in self._buckets:
                return self._buckets[bucket] is not None
        found: Bucket | None = None
        try:
            found = resolve(self._s3, self._run, bucket, self._pool.ssl_context)
        except Exception as exc:  # s3fs raises it (or its own) on the request, if real
            log.debug("s3://%s: requests go through s3fs: %s", bucket, BY_FORM.redact(str(exc)))
        with self._lock:
            self._buckets[bucket] = found
        return found is not None

    def _credentials(self, target: Bucket) -> Any:
        now = time.monotonic()
        with self._lock:
            cached = self._frozen.get(id(target.client))
        if cached is not None and now - cached[1] < CREDENTIALS_TTL:
            return cached[0]
        credentials = compat.credentials(target.client)
        frozen = self._run(_freeze, credentials)
        with self._lock:
            self._frozen[id(target.client)] = (frozen, now)
        return frozen

    # --- requests -----------------------------------------------------------------

    def upload_part(
        self,
        bucket: str,
        key: str,
        upload_id: str,
        number: int,
        body: memoryview,
        checksum: str | None,
        group: Cancel,
    ) -> str:
        """Upload one part; its ETag."""
        query = f"partNumber={number}&uploadId={quote(upload_id, '')}"
        headers = {"x-amz-checksum-crc32c": checksum} if checksum else {}
        response, conn = self._send(
            "PUT", bucket, key, query, headers, body, "UploadPart", (200,), group
        )
        etag = response.getheader("ETag")
        # S3 answers with an empty body; a longer one is not read on (the connection
        # is closed, not reused): a store that keeps sending must not hold the part.
        response.read(_ERROR_BODY_LIMIT)
        self._pool.give(conn, response)
        if etag is None:
            raise OSError(f"part {number} was accepted without an ETag")
        return etag

    def get_object(
        self,
        bucket: str,
        key: str,
        byte_range: str | None,
        if_match: str | None,
        cancel: Cancel | None = None,
    ) -> dict[str, Any]:
        """A GET of ``key`` (``byte_range``: a ``Range`` header value), pinned to
        ``if_match``; ``ETag``, ``ContentRange``, ``ContentEncoding``, ``Body`` (a
        ``PooledResponse``) and the status in ``ResponseMetadata``, as botocore
        answers. ``cancel`` interrupts the request and the reading of its body."""
        headers = {}
        if byte_range is not None:
            headers["Range"] = byte_range
        if if_match is not None:
            headers["If-Match"] = if_match
        response, conn = self._send(
            "GET", bucket, key, "", headers, None, "GetObject", (200, 206), cancel
        )
        return {
            "ETag": response.getheader("ETag"),
            "ContentRange": response.getheader("Content-Range"),
            "ContentEncoding": response.getheader("Content-Encoding"),
            "ResponseMetadata": {"HTTPStatusCode": response.status},
            "Body": PooledResponse(response, conn, self._pool, cancel),
        }

    def _send(
        self,
        method: str,
        bucket: str,
        key: str,
        query: str,
        headers: Mapping[str, str],
        body: memoryview | None,
        operation: str,
        ok: tuple[int, ...],
        group: Cancel | None,
    ) -> tuple[http.client.HTTPResponse, http.client.HTTPConnection]:
        target = self._buckets[bucket]
        assert target is not None
        path = target.prefix + quote(key, "/~") + (f"?{query}" if query else "")
        attempt = 0
        while True:
            attempt += 1
            if group is not None:
                group.check()
            try:
                signed = self._sign(target, method, path, headers)
                response, conn = self._exchange(target, method, path, signed, body, group)
            except (OSError, http.client.HTTPException) as exc:
                if attempt >= self.retry.attempts or _halted(group):
                    raise
                log.debug("%s %s: %s, attempt %d", method, path, BY_FORM.redact(repr(exc)), attempt)
            else:
                if response.status in ok:
                    return response, conn
                error = self._error(response, conn, operation)
                if not retryable(error) or attempt >= self.retry.attempts or _halted(group):
                    raise translate_boto_error(error)
                log.debug("%s %s: %s, attempt %d", method, path, error_code(error), attempt)
            self.retry.wait(attempt, group)

    def _sign(
        self, target: Bucket, method: str, path: str, headers: Mapping[str, str]
    ) -> dict[str, str]:
        signed = {"host": target.host, "User-Agent": _USER_AGENT, **headers}
        if target.region is None:
            return signed
        request = AWSRequest(method=method, url=f"{target.scheme}://{target.host}{path}")
        for name, value in signed.items():
            request.headers[name] = value
        # Unsigned payload: the CRC32C header is what the store checks the body against.
        request.context["client_config"] = self._config
        auth = S3SigV4Auth(self._credentials(target), target.service, target.region)
        auth.add_auth(request)
        signed = dict(request.headers.items())
        for name, value in signed.items():
            # http.client would refuse it quoting the value: a signature, a token.
            if _UNSAFE.search(value):
                raise ValueError(
                    f"a credential holds a line break or control character: it reaches the "
                    f"{name} header of every request (a key or token read from a file with its "
                    "trailing newline?); fix the credentials"
                )
        return signed

    def _exchange(
        self,
        target: Bucket,
        method: str,
        path: str,
        headers: dict[str, str],
        body: memoryview | None,
        group: Cancel | None,
    ) -> tuple[http.client.HTTPResponse, http.client.HTTPConnection]:
        conn = self._pool.take(target.scheme, target.hostname, target.port)
        if group is not None:
            group.track(conn, True)
        try:
            try:
                conn.request(method, path, body=body, headers=headers)
            except OSError:
                # The server may have answered (an error) and stopped reading the body;
                # that answer says more than the broken pipe.
                if conn.sock is None:
                    raise
                conn.sock.settimeout(1.0)
                response = conn.getresponse()
                response.will_close = True  # the request was not sent whole
                return response, conn
            return conn.getresponse(), conn
        except BaseException:
            conn.close()
            raise
        finally:
            if group is not None:
                group.track(conn, False)

    def _error(
        self, response: http.client.HTTPResponse, conn: http.client.HTTPConnection, operation: str
    ) -> botocore.exceptions.ClientError:
        try:
            payload = response.read(_ERROR_BODY_LIMIT)
        except (OSError, http.client.HTTPException):
            payload = b""
        self._pool.give(conn, response)
        text = payload.decode("utf-8", "replace")
        code = _xml_field(text, "Code") or str(response.status)
        message = _xml_field(text, "Message") or response.reason
        details: dict[str, Any] = {"Code": code, "Message": message}
        condition = _xml_field(text, "Condition")
        if condition:
            details["Condition"] = condition
        parsed: dict[str, Any] = {
            "Error": details,
            "ResponseMetadata": {
                "HTTPStatusCode": response.status,
                "HTTPHeaders": {k.lower(): v for k, v in response.getheaders()},
            },
        }
        return botocore.exceptions.ClientError(parsed, operation)  # type: ignore[arg-type]


async def _freeze(credentials: Any) -> Any:
    frozen = credentials.get_frozen_credentials()
    return await frozen if inspect.isawaitable(frozen) else frozen


def _halted(group: Cancel | None) -> bool:
    return group is not None and group.cancelled.is_set()


def _xml_field(text: str, name: str) -> str:
    found = re.search(rf"<{name}>(.*?)</{name}>", text, re.S)
    return found.group(1).strip() if found else ""


# One DirectPath per s3fs client (and so per process and set of options).
_PATHS: Shared[DirectPath | None] = Shared()


def direct_path(s3: s3fs.S3FileSystem, run: Runner, max_attempts: int) -> DirectPath | None:
    """The direct path of ``s3``'s client, or ``None`` when its configuration asks for
    something only botocore does (see the module docstring)."""
    return _PATHS.of(s3, lambda: _build(s3, run, max_attempts))


def _build(s3: s3fs.S3FileSystem, run: Runner, max_attempts: int) -> DirectPath | None:
    try:
        client = run(s3.set_session)
        config = client.meta.config
        ssl_contexts = check_client(client)
        return DirectPath(
            s3, run=run, config=config, max_attempts=max_attempts, ssl_contexts=ssl_contexts
        )
    except Exception as exc:
        log.debug("requests go through s3fs: %s", BY_FORM.redact(str(exc)))
        return None
