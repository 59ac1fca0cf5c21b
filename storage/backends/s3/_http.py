"""Part uploads and ranged GETs over pooled ``http.client`` connections.

The bodies of a checkpoint's data requests skip the aiobotocore stack: an ``UploadPart``
goes to the socket in one ``sendall`` of the part buffer, and a ranged ``GetObject``
lands in the caller's buffer with ``readinto``, both from the calling thread with the
GIL released. Measured on SeaweedFS, that halves the client CPU of uploads and of
ranged reads (docs/benchmarks.md). Everything else - creating, completing and aborting
uploads, small PUTs, HEAD, listing, deleting - stays on s3fs.

Nothing here decides where or how to send a request on its own: the object URL, the
signing region and whether to sign at all come from one request per bucket that the
s3fs client prepares and signs but never sends (its endpoint rules, addressing style
and configuration), the credentials from that client's signer (refreshed as it
refreshes them), TLS settings from its HTTP session, timeouts and attempts from its
configuration, and errors are turned into s3fs's exceptions. A configuration this
module does not reproduce exactly (a proxy, adaptive retries, signed payloads, another
signature scheme, per-request arguments such as SSE-C keys or ``RequestPayer``) gets
no :class:`DirectPath`, and its requests go through s3fs.
"""

from __future__ import annotations

import concurrent.futures
import functools
import http.client
import inspect
import logging
import os
import random
import re
import socket
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import botocore.exceptions
import s3fs
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from s3fs.errors import translate_boto_error
from urllib3.util.wait import wait_for_read

log = logging.getLogger(__name__)

Runner = Callable[..., Any]

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
# A request of these headers only is plain SigV4 (or unsigned) with nothing added by the
# client's configuration: anything else (S3 Express session tokens, headers a user's
# event handler adds, ...) is left to s3fs.
_PROBE_HEADERS = frozenset(
    {
        "authorization",
        "amz-sdk-invocation-id",
        "amz-sdk-request",
        "host",
        "user-agent",
        "x-amz-content-sha256",
        "x-amz-date",
        "x-amz-security-token",
    }
)
_PROBE_KEY = "dcp-storage-probe"
_SIGV4_SCOPE = re.compile(r"AWS4-HMAC-SHA256 Credential=[^/]*/\d{8}/([^/,]+)/([^/,]+)/")
# Frozen credentials are asked for again after this long; refreshable ones refresh
# minutes before they expire, so a copy this old is still valid.
CREDENTIALS_TTL = 60.0
_MAX_IDLE = 64
_ERROR_BODY_LIMIT = 1 << 16
_USER_AGENT = "dcp-storage"


class _Unsupported(Exception):
    """The client's configuration asks for something only botocore does."""


class BodyBroken(ConnectionError):
    """A response body broke off: reset, timed out or shorter than announced."""


class PartGroup:
    """The part uploads of one multipart upload, so that an abort can stop them: no new
    attempt starts once :meth:`halt` is called, and connections in use are shut down."""

    def __init__(self) -> None:
        self.tasks: list[Any] = []  # asyncio tasks of parts sent through s3fs
        self.halted = threading.Event()
        self._lock = threading.Lock()
        self._connections: set[http.client.HTTPConnection] = set()

    def track(self, conn: http.client.HTTPConnection, busy: bool) -> None:
        with self._lock:
            if busy:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)
        if busy and self.halted.is_set():
            _shut(conn)

    def halt(self) -> None:
        self.halted.set()
        with self._lock:
            busy = list(self._connections)
        for conn in busy:
            _shut(conn)


def _shut(conn: http.client.HTTPConnection) -> None:
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


@dataclass(frozen=True)
class _Bucket:
    scheme: str
    host: str  # the Host header, as botocore signs it
    hostname: str
    port: int
    prefix: str  # the URL path before the key
    region: str | None  # None: requests go unsigned (anonymous access)
    service: str
    client: Any  # the aiobotocore client whose signer holds the credentials


class DirectBody:
    """The body of a ranged GET, read straight into the caller's buffers."""

    def __init__(
        self,
        response: http.client.HTTPResponse,
        conn: http.client.HTTPConnection,
        owner: DirectPath,
    ) -> None:
        self._response = response
        self._conn: http.client.HTTPConnection | None = conn
        self._owner = owner

    def readinto(self, view: memoryview) -> int:
        response = self._response
        try:
            n = response.readinto(view)
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise BodyBroken(f"response body broke off: {exc!r}") from exc
        if not n and view.nbytes and response.length:
            self.close()
            raise BodyBroken(f"response body ended {response.length} bytes early")
        return n

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._response.length:
            conn.close()  # unread bytes would be the next response
        else:
            self._owner.release(conn, self._response)


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
        self.max_attempts = max_attempts
        self._connect_timeout = config.connect_timeout
        self._read_timeout = config.read_timeout
        self._ssl_contexts = ssl_contexts
        self._ssl_context: Any = None  # built on first use (reading CA bundles costs ~20 ms)
        self._lock = threading.Lock()
        self._buckets: dict[str, _Bucket | None] = {}
        self._frozen: dict[int, tuple[Any, float]] = {}
        self._idle: dict[tuple[str, str, int], list[http.client.HTTPConnection]] = {}

    # --- where and how ------------------------------------------------------------

    def serves(self, bucket: str) -> bool:
        """Whether requests to ``bucket`` can go this way (else through s3fs)."""
        with self._lock:
            if bucket in self._buckets:
                return self._buckets[bucket] is not None
        found: _Bucket | None = None
        try:
            found = self._resolve(bucket)
        except Exception as exc:  # s3fs raises it (or its own) on the request, if real
            log.debug("s3://%s: requests go through s3fs: %s", bucket, exc)
        with self._lock:
            self._buckets[bucket] = found
        return found is not None

    def _resolve(self, bucket: str) -> _Bucket:
        client = self._run(self._s3.get_s3, bucket)
        for method in (client.upload_part, client.get_object):
            args = self._s3._get_s3_method_kwargs(method, Bucket=bucket, Key=_PROBE_KEY)
            if set(args) - {"Bucket", "Key"}:
                raise _Unsupported(f"{sorted(args)} on every {method.__name__}")
        request = self._run(_prepared_request, client, bucket)
        parts = urllib.parse.urlsplit(request.url)
        suffix = "/" + _quote(_PROBE_KEY, "/~")
        if parts.scheme not in ("http", "https") or parts.hostname is None:
            raise _Unsupported(f"an endpoint of another kind ({request.url})")
        if parts.query or not parts.path.endswith(suffix):
            raise _Unsupported(f"object URLs of another form ({request.url})")
        if client._endpoint.http_session._proxy_config.proxy_url_for(request.url):
            raise _Unsupported("a proxy")
        if parts.scheme == "https" and self._ssl() is None:
            raise _Unsupported("TLS settings that cannot be read")
        headers = {k.lower(): _text(v) for k, v in request.headers.items()}
        extra = set(headers) - _PROBE_HEADERS
        if extra:
            raise _Unsupported(f"headers of its own ({sorted(extra)})")
        region, service = None, "s3"
        authorization = headers.get("authorization")
        if authorization is not None:
            scope = _SIGV4_SCOPE.match(authorization)
            if scope is None or client._request_signer._credentials is None:
                raise _Unsupported(f"another signature ({authorization.split(' ')[0]})")
            if headers.get("x-amz-content-sha256") != "UNSIGNED-PAYLOAD":
                raise _Unsupported("signed payloads")
            region, service = scope.group(1), scope.group(2)
        port = parts.port or {"http": 80, "https": 443}[parts.scheme]
        return _Bucket(
            scheme=parts.scheme,
            host=_host_header(parts.hostname, port, parts.scheme),
            hostname=parts.hostname,
            port=port,
            prefix=parts.path[: -len(suffix) + 1],
            region=region,
            service=service,
            client=client,
        )

    def _ssl(self) -> Any:
        with self._lock:
            if self._ssl_context is None and self._ssl_contexts is not None:
                self._ssl_context, _ = self._ssl_contexts()
            return self._ssl_context

    def _credentials(self, target: _Bucket) -> Any:
        now = time.monotonic()
        with self._lock:
            cached = self._frozen.get(id(target.client))
        if cached is not None and now - cached[1] < CREDENTIALS_TTL:
            return cached[0]
        credentials = target.client._request_signer._credentials
        frozen = self._run(_freeze, credentials)
        with self._lock:
            self._frozen[id(target.client)] = (frozen, now)
        return frozen

    # --- connections --------------------------------------------------------------

    def _connection(self, target: _Bucket) -> http.client.HTTPConnection:
        key = (target.scheme, target.host, target.port)
        while True:
            with self._lock:
                idle = self._idle.get(key)
                conn = idle.pop() if idle else None
            if conn is None:
                break
            # A pooled connection the server closed (or wrote to) is readable now.
            if conn.sock is not None and not wait_for_read(conn.sock, timeout=0.0):
                return conn
            conn.close()
        if target.scheme == "https":
            conn = http.client.HTTPSConnection(
                target.hostname,
                target.port,
                timeout=self._connect_timeout,
                context=self._ssl(),
            )
        else:
            conn = http.client.HTTPConnection(
                target.hostname, target.port, timeout=self._connect_timeout
            )
        conn.connect()
        assert conn.sock is not None
        conn.sock.settimeout(self._read_timeout)
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.timeout = self._read_timeout  # a reconnect after "Connection: close"
        return conn

    def release(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
        """Keep ``conn`` for reuse if ``response`` was its last and was read to the end."""
        if conn.sock is None or not response.isclosed() or response.will_close:
            conn.close()
            return
        scheme = "https" if isinstance(conn, http.client.HTTPSConnection) else "http"
        key = (scheme, _host_header(conn.host, conn.port, scheme), conn.port)
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if len(idle) < _MAX_IDLE:
                idle.append(conn)
                return
        conn.close()

    # --- requests -----------------------------------------------------------------

    def upload_part(
        self,
        bucket: str,
        key: str,
        upload_id: str,
        number: int,
        body: memoryview,
        checksum: str | None,
        group: PartGroup,
    ) -> str:
        """Upload one part; its ETag."""
        query = f"partNumber={number}&uploadId={_quote(upload_id, '')}"
        headers = {"x-amz-checksum-crc32c": checksum} if checksum else {}
        response, conn = self._send(
            "PUT", bucket, key, query, headers, body, "UploadPart", (200,), group
        )
        etag = response.getheader("ETag")
        response.read()
        self.release(conn, response)
        if etag is None:
            raise OSError(f"part {number} was accepted without an ETag")
        return etag

    def get_object(
        self, bucket: str, key: str, byte_range: str | None, if_match: str | None
    ) -> dict[str, Any]:
        """A GET of ``key`` (``byte_range``: a ``Range`` header value), pinned to
        ``if_match``; ``{"ETag": ..., "Body": DirectBody}`` as botocore answers."""
        headers = {}
        if byte_range is not None:
            headers["Range"] = byte_range
        if if_match is not None:
            headers["If-Match"] = if_match
        response, conn = self._send(
            "GET", bucket, key, "", headers, None, "GetObject", (200, 206), None
        )
        return {"ETag": response.getheader("ETag"), "Body": DirectBody(response, conn, self)}

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
        group: PartGroup | None,
    ) -> tuple[http.client.HTTPResponse, http.client.HTTPConnection]:
        target = self._buckets[bucket]
        assert target is not None
        path = target.prefix + _quote(key, "/~") + (f"?{query}" if query else "")
        attempt = 0
        while True:
            attempt += 1
            if group is not None and group.halted.is_set():
                raise concurrent.futures.CancelledError()
            try:
                signed = self._sign(target, method, path, headers)
                response, conn = self._exchange(target, method, path, signed, body, group)
            except (OSError, http.client.HTTPException) as exc:
                if attempt >= self.max_attempts or _halted(group):
                    raise
                log.debug("%s %s: %r, attempt %d", method, path, exc, attempt)
            else:
                if response.status in ok:
                    return response, conn
                error = self._error(response, conn, operation)
                code = str(error.response["Error"].get("Code", ""))
                retried = response.status in _TRANSIENT_STATUS or code in _RETRIED_CODES
                if not retried or attempt >= self.max_attempts or _halted(group):
                    raise translate_boto_error(error)
                log.debug("%s %s: %s, attempt %d", method, path, code, attempt)
            # Full jitter, as botocore's standard mode waits: at most 1, 2, 4, ... 20 s.
            delay = random.random() * min(20.0, 2.0 ** (attempt - 1))
            if group is not None:
                group.halted.wait(delay)
            else:
                time.sleep(delay)

    def _sign(
        self, target: _Bucket, method: str, path: str, headers: Mapping[str, str]
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
        return dict(request.headers.items())

    def _exchange(
        self,
        target: _Bucket,
        method: str,
        path: str,
        headers: dict[str, str],
        body: memoryview | None,
        group: PartGroup | None,
    ) -> tuple[http.client.HTTPResponse, http.client.HTTPConnection]:
        conn = self._connection(target)
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
        self.release(conn, response)
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


class _Probed(Exception):
    def __init__(self, request: Any) -> None:
        super().__init__("probe")
        self.request = request


async def _prepared_request(client: Any, bucket: str) -> Any:
    """The request the client would send for a HEAD of a probe key in ``bucket``:
    endpoint rules applied, headers added, signed - stopped just before it is sent."""
    marker = f"{_PROBE_KEY}-{uuid.uuid4().hex}"

    def stop(request: Any, **_: Any) -> None:
        if marker in request.url:
            raise _Probed(request)

    event = "before-send.s3.HeadObject"
    client.meta.events.register_first(event, stop, unique_id=marker)
    try:
        await client.head_object(Bucket=bucket, Key=f"{_PROBE_KEY}/{marker}")
        raise _Unsupported("event handlers that send requests themselves")
    except _Probed as probed:
        request = probed.request
    finally:
        client.meta.events.unregister(event, unique_id=marker)
    # The probe key's last segment is the marker: keep the URL up to the probe key.
    request.url = request.url[: request.url.rindex("/")]
    return request


async def _freeze(credentials: Any) -> Any:
    frozen = credentials.get_frozen_credentials()
    return await frozen if inspect.isawaitable(frozen) else frozen


def _text(value: str | bytes) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else str(value)


def _halted(group: PartGroup | None) -> bool:
    return group is not None and group.halted.is_set()


def _quote(text: str, safe: str) -> str:
    return urllib.parse.quote(text, safe=safe)


def _xml_field(text: str, name: str) -> str:
    found = re.search(rf"<{name}>(.*?)</{name}>", text, re.S)
    return found.group(1).strip() if found else ""


def _host_header(hostname: str, port: int, scheme: str) -> str:
    # As botocore derives it from a URL: brackets around IPv6, no default port.
    host = f"[{hostname}]" if ":" in hostname else hostname
    return host if port == {"http": 80, "https": 443}[scheme] else f"{host}:{port}"


# One DirectPath per s3fs client (and so per process and set of options).
_PATHS: dict[int, tuple[s3fs.S3FileSystem, DirectPath | None]] = {}
_PATHS_LOCK = threading.Lock()


def direct_path(s3: s3fs.S3FileSystem, run: Runner, max_attempts: int) -> DirectPath | None:
    """The direct path of ``s3``'s client, or ``None`` when its configuration asks for
    something only botocore does (see the module docstring)."""
    with _PATHS_LOCK:
        found = _PATHS.get(id(s3))
        if found is not None and found[0] is s3:
            return found[1]
        path = _build(s3, run, max_attempts)
        _PATHS[id(s3)] = (s3, path)
        return path


def _build(s3: s3fs.S3FileSystem, run: Runner, max_attempts: int) -> DirectPath | None:
    try:
        client = run(s3.set_session)
        config = client.meta.config
        retries = dict(config.retries or {})
        mode = retries.get("mode") or os.environ.get("AWS_RETRY_MODE", "")
        if mode == "adaptive":
            raise _Unsupported("adaptive retries (client-side rate limiting)")
        if (config.s3 or {}).get("payload_signing_enabled") is not False:
            raise _Unsupported("signed payloads")
        if config.proxies:
            raise _Unsupported("a proxy")
        # The TLS settings aiobotocore would use (verify, CA bundle, client certificate);
        # an aiobotocore without this method leaves HTTPS endpoints to s3fs.
        build = getattr(client._endpoint.http_session, "_build_ssl_contexts", None)
        ssl_contexts = None if build is None else functools.partial(build, None)
        return DirectPath(
            s3, run=run, config=config, max_attempts=max_attempts, ssl_contexts=ssl_contexts
        )
    except Exception as exc:
        log.debug("requests go through s3fs: %s", exc)
        return None
