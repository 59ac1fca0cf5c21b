"""The one place the S3 backend touches private names of s3fs, aiobotocore and botocore.

Each accessor names what it reaches, why, and the releases it was checked on; a name
gone in an installed release raises ``PrivateNameMissing`` naming the library and its
version (``_private.py``), here and nowhere else. Checked on the lowest pinned s3fs,
2024.12.0 (``constraints-lowest.txt``; ``tox -e lowest`` runs
``tests/backends/test_compat.py`` against it, with the aiobotocore 2.x and botocore it
resolves to) and on s3fs 2026.9.0 with aiobotocore 3.10.0 and botocore 1.43.117.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import s3fs

from storage.backends._private import private

S3FS = "2024.12.0 to 2026.9.0"
AIOBOTOCORE = "3.10.0, and the 2.x that s3fs 2024.12.0 resolves to"
BOTOCORE = "1.43.117, and the release that aiobotocore 2.x pins"


def call_s3(s3: s3fs.S3FileSystem, method: str, **kwargs: Any) -> Coroutine[Any, Any, Any]:
    """``S3FileSystem._call_s3`` (s3fs): one request on s3fs's aiobotocore client with
    its ``s3_additional_kwargs``, the request path every S3 call of the backend takes
    (its public methods read whole bodies and retry on their own)."""
    call = private(s3, "_call_s3", "s3fs", "sending requests through s3fs's client", S3FS)
    coroutine: Coroutine[Any, Any, Any] = call(method, **kwargs)
    return coroutine


def method_kwargs(s3: s3fs.S3FileSystem, method: Any, **kwargs: Any) -> dict[str, Any]:
    """``S3FileSystem._get_s3_method_kwargs`` (s3fs): the arguments s3fs adds to every
    call of ``method`` (``s3_additional_kwargs``, ``RequestPayer``); the direct path is
    refused where there are any."""
    purpose = "seeing the arguments s3fs adds to a request"
    found = private(s3, "_get_s3_method_kwargs", "s3fs", purpose, S3FS)
    args: dict[str, Any] = found(method, **kwargs)
    return args


def credentials(client: Any) -> Any:
    """``client._request_signer._credentials`` (botocore's ``RequestSigner``): the
    credentials the client signs with (refreshable), which the direct path signs its
    requests with; ``None`` for an anonymous client."""
    purpose = "signing direct-path requests with the client's credentials"
    signer = private(client, "_request_signer", "botocore", purpose, BOTOCORE)
    return private(signer, "_credentials", "botocore", purpose, BOTOCORE)


def _http_session(client: Any, purpose: str) -> Any:
    endpoint = private(client, "_endpoint", "botocore", purpose, BOTOCORE)
    return endpoint.http_session


def ssl_contexts(client: Any) -> Callable[[Any], Any] | None:
    """``client._endpoint.http_session._build_ssl_contexts`` (aiobotocore's
    ``AIOHTTPSession``): builds the TLS contexts of the client's configuration (verify,
    CA bundle, client certificate) for the direct path; ``None`` where this release
    does not have it (HTTPS then stays with s3fs, a fallback, not an error)."""
    session = _http_session(client, "reading the client's TLS settings")
    build: Callable[[Any], Any] | None = getattr(session, "_build_ssl_contexts", None)
    return build


def proxy_url_for(client: Any, url: str) -> str | None:
    """``client._endpoint.http_session._proxy_config.proxy_url_for(url)`` (aiobotocore):
    the proxy the client would send a request to ``url`` through (from its config or
    the environment); the direct path is refused where there is one."""
    purpose = "finding the proxy a request would go through"
    session = _http_session(client, purpose)
    proxies = private(session, "_proxy_config", "aiobotocore", purpose, AIOBOTOCORE)
    found: str | None = proxies.proxy_url_for(url)
    return found
