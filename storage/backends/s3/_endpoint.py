"""Where one bucket's data requests go, for the direct path (``_http``); and, for
messages, the endpoint as configured and whether an error says it cannot be reached.

The s3fs client prepares and signs a ``HeadObject`` of a probe key but never sends it:
its URL gives the endpoint (the client's endpoint rules and addressing style), its
``Authorization`` header the signing region and service (none: anonymous access). A
client or a request carrying anything the direct path would not reproduce - another
signature scheme, a proxy, headers of its own, per-request arguments such as SSE-C
keys - raises :class:`Unsupported`, and its requests stay with s3fs.
"""

from __future__ import annotations

import functools
import os
import re
import socket
import urllib.parse
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import botocore.exceptions
import s3fs

from storage.backends.s3 import _compat as compat

Runner = Callable[..., Any]

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


class Unsupported(Exception):
    """The client's configuration asks for something only botocore does."""


@dataclass(frozen=True)
class Bucket:
    scheme: str
    host: str  # the Host header, as botocore signs it
    hostname: str
    port: int
    prefix: str  # the URL path before the key
    region: str | None  # None: requests go unsigned (anonymous access)
    service: str
    client: Any  # the aiobotocore client whose signer holds the credentials


def check_client(client: Any) -> Callable[[], Any] | None:
    """Refuse a client whose configuration asks for something only botocore does; the
    builder of the TLS contexts it would use (verify, CA bundle, client certificate), or
    None for an aiobotocore that does not expose it (HTTPS then stays with s3fs)."""
    config = client.meta.config
    retries = dict(config.retries or {})
    mode = retries.get("mode") or os.environ.get("AWS_RETRY_MODE", "")
    if mode == "adaptive":
        raise Unsupported("adaptive retries (client-side rate limiting)")
    if (config.s3 or {}).get("payload_signing_enabled") is not False:
        raise Unsupported("signed payloads")
    if config.proxies:
        raise Unsupported("a proxy")
    build = compat.ssl_contexts(client)
    return None if build is None else functools.partial(build, None)


def resolve(s3: s3fs.S3FileSystem, run: Runner, bucket: str, ssl: Callable[[], Any]) -> Bucket:
    """Where data requests to ``bucket`` go and how they are signed, read off a request
    the client prepares and signs but never sends; :class:`Unsupported` when a request
    of this client carries anything the direct path would not reproduce."""
    client = run(s3.get_s3, bucket)
    for method in (client.upload_part, client.get_object):
        args = compat.method_kwargs(s3, method, Bucket=bucket, Key=_PROBE_KEY)
        if set(args) - {"Bucket", "Key"}:
            raise Unsupported(f"{sorted(args)} on every {method.__name__}")
    request = run(_prepared_request, client, bucket)
    parts = urllib.parse.urlsplit(request.url)
    suffix = "/" + quote(_PROBE_KEY, "/~")
    if parts.scheme not in ("http", "https") or parts.hostname is None:
        raise Unsupported(f"an endpoint of another kind ({request.url})")
    if parts.query or not parts.path.endswith(suffix):
        raise Unsupported(f"object URLs of another form ({request.url})")
    if compat.proxy_url_for(client, request.url):
        raise Unsupported("a proxy")
    if parts.scheme == "https" and ssl() is None:
        raise Unsupported("TLS settings that cannot be read")
    headers = {k.lower(): _text(v) for k, v in request.headers.items()}
    extra = set(headers) - _PROBE_HEADERS
    if extra:
        raise Unsupported(f"headers of its own ({sorted(extra)})")
    region, service = None, "s3"
    authorization = headers.get("authorization")
    if authorization is not None:
        scope = _SIGV4_SCOPE.match(authorization)
        if scope is None or compat.credentials(client) is None:
            raise Unsupported(f"another signature ({authorization.split(' ')[0]})")
        if headers.get("x-amz-content-sha256") != "UNSIGNED-PAYLOAD":
            raise Unsupported("signed payloads")
        region, service = scope.group(1), scope.group(2)
    port = parts.port or {"http": 80, "https": 443}[parts.scheme]
    return Bucket(
        scheme=parts.scheme,
        host=host_header(parts.hostname, port, parts.scheme),
        hostname=parts.hostname,
        port=port,
        prefix=parts.path[: -len(suffix) + 1],
        region=region,
        service=service,
        client=client,
    )


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
        raise Unsupported("event handlers that send requests themselves")
    except _Probed as probed:
        request = probed.request
    finally:
        client.meta.events.unregister(event, unique_id=marker)
    # The probe key's last segment is the marker: keep the URL up to the probe key.
    request.url = request.url[: request.url.rindex("/")]
    return request


def _text(value: str | bytes) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else str(value)


def quote(text: str, safe: str) -> str:
    return urllib.parse.quote(text, safe=safe)


def host_header(hostname: str, port: int, scheme: str) -> str:
    # As botocore derives it from a URL: brackets around IPv6, no default port.
    host = f"[{hostname}]" if ":" in hostname else hostname
    return host if port == {"http": 80, "https": 443}[scheme] else f"{host}:{port}"


def configured_endpoint(options: dict[str, Any]) -> str | None:
    """The endpoint that ``storage_options`` (or the environment, as botocore reads
    it) give; ``None``: AWS's."""
    given = (
        options.get("endpoint_url")
        or (options.get("client_kwargs") or {}).get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
    )
    return str(given) if given else None


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) says the endpoint could not be
    reached at all: no such host, connection refused, no connection in time."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(
            error,
            (
                botocore.exceptions.EndpointConnectionError,
                botocore.exceptions.ConnectTimeoutError,
                socket.gaierror,
                ConnectionRefusedError,
            ),
        ) or type(error).__name__ in ("ClientConnectorError", "ClientConnectorDNSError"):
            return True
        error = error.__cause__ or error.__context__
    return False
