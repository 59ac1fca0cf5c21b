"""GETs of GCS objects over pooled ``http.client`` connections: the direct path.

A body lands in the caller's buffer (the target tensor) with ``readinto``, the GIL
released while the socket fills it: no aiohttp chunk objects, no copy from them into
the tensor, no hop to gcsfs's event-loop thread, which all reads of the process would
otherwise share (benchmarks/NOTES.md, "Reads straight into the tensor").

Nothing about where or how to send is decided here: the URL (endpoint or emulator
host, object name, generation, ``userProject``) and the headers (credentials, refreshed
as gcsfs refreshes them; user agent) come from the gcsfs client, the timeouts from its
``requests_timeout``, and TLS is what aiohttp's default is (the system's CA store,
certificates verified). A client configured in a way this does not reproduce -
``session_kwargs`` (a proxy, a connector, ...), a client certificate (mTLS), a total
request timeout - gets no direct path: its GETs go through gcsfs's session
(``_session.StreamedGet``).
"""

from __future__ import annotations

import ssl
import urllib.parse

import aiohttp
import gcsfs

from storage.backends._clients import Shared
from storage.backends._connections import ConnectionPool, PooledResponse
from storage.backends.cancel import Cancel
from storage.backends.gcs import _compat as compat
from storage.backends.gcs._session import Answer, range_header


class DirectGet:
    """GETs for one gcsfs client (a :data:`~storage.backends.gcs._session.Get`)."""

    def __init__(
        self, gcs: gcsfs.GCSFileSystem, connect_timeout: float | None, read_timeout: float | None
    ) -> None:
        self._gcs = gcs
        self._pool = ConnectionPool(
            connect_timeout=connect_timeout, read_timeout=read_timeout, ssl_context=_tls
        )

    def __call__(
        self,
        path: str,
        first: int | None,
        last: int | None,
        generation: str | None,
        cancel: Cancel,
    ) -> Answer:
        gcs = self._gcs
        url = urllib.parse.urlsplit(gcs.url(path, generation=generation))
        query = url.query
        params = compat.params(gcs, {})
        if params:
            query = f"{query}&{urllib.parse.urlencode(params)}"
        headers = compat.headers(gcs, range_header(first, last))
        port = url.port or (443 if url.scheme == "https" else 80)
        conn = self._pool.take(url.scheme, url.hostname or "", port)
        cancel.track(conn, True)
        try:
            conn.request("GET", f"{url.path}?{query}", headers=headers)
            response = conn.getresponse()
        except BaseException:
            cancel.track(conn, False)
            conn.close()
            raise
        answer: Answer = PooledResponse(response, conn, self._pool, cancel)
        return answer


def _tls() -> ssl.SSLContext:
    # aiohttp's default for a verified connection.
    context = ssl.create_default_context()
    context.set_alpn_protocols(["http/1.1"])
    return context


# One DirectGet per gcsfs client (and so per process and set of options).
_GETS: Shared[DirectGet | None] = Shared()


def direct_get(gcs: gcsfs.GCSFileSystem) -> DirectGet | None:
    """The direct path of ``gcs``, or ``None`` when its configuration asks for what
    only its aiohttp session does (see the module docstring)."""
    return _GETS.of(gcs, lambda: _build(gcs))


def _build(gcs: gcsfs.GCSFileSystem) -> DirectGet | None:
    if gcs.session_kwargs or compat.uses_client_cert(gcs):
        return None
    if urllib.parse.urlsplit(compat.location(gcs)).scheme not in ("http", "https"):
        return None
    timeout = gcs.requests_timeout
    if not isinstance(timeout, aiohttp.ClientTimeout) or timeout.total is not None:
        return None  # a limit on a whole request: only aiohttp keeps one
    return DirectGet(gcs, timeout.sock_connect or timeout.connect, timeout.sock_read)
