"""The direct data paths' connections (S3's ``_http``, GCS's ``_direct``): reads with
``readinto`` straight into the caller's buffer, the GIL released while the socket
fills it.

``ConnectionPool``: keep-alive ``http.client`` connections, one pool per client, keyed
by scheme, host and port, handed to one caller at a time and given back only when
their last response was read to the end. ``PooledResponse``: a response on one of
them, its body read into the caller's buffers, its connection given back (or closed)
when done.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
from collections.abc import Callable

from urllib3.util.wait import wait_for_read

from storage.backends.cancel import Cancel

_MAX_IDLE = 64
_ERROR_BODY_LIMIT = 1 << 16


class BodyBroken(ConnectionError):
    """A response body broke off: reset, timed out or shorter than announced."""


#: Interim ``100 Continue`` answers taken before a response's status.
MAX_INTERIM = 100


class _Response(http.client.HTTPResponse):
    """``http.client``'s response, but a server that sends ``100 Continue`` without end
    fails the request (an ``HTTPException``, retried as such): ``begin`` skips any
    number of them, each within the read timeout, so it would never return."""

    _interim = 0

    def _read_status(self) -> tuple[str, int, str]:
        version, status, reason = super()._read_status()  # type: ignore[misc]
        if status == http.client.CONTINUE:
            self._interim += 1
            if self._interim > MAX_INTERIM:
                raise http.client.HTTPException(
                    f"the server sent more than {MAX_INTERIM} interim '100 Continue' "
                    "answers and no response"
                )
        return version, status, reason


class ConnectionPool:
    """Idle connections by ``(scheme, host, port)``, at most 64 per key.

    ``connect_timeout`` bounds connecting, ``read_timeout`` every wait for bytes after
    that (``None``: no limit); ``ssl_context()`` gives the TLS settings of ``https``
    connections, asked for once, on the first one (reading CA bundles takes a while)."""

    def __init__(
        self,
        *,
        connect_timeout: float | None,
        read_timeout: float | None,
        ssl_context: Callable[[], ssl.SSLContext | None],
    ) -> None:
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._ssl_factory = ssl_context
        self._ssl: ssl.SSLContext | None = None
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, str, int], list[http.client.HTTPConnection]] = {}

    def take(self, scheme: str, host: str, port: int) -> http.client.HTTPConnection:
        """A connected connection to ``host:port``: an idle one that is still open,
        else a new one."""
        key = (scheme, host, port)
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
        if scheme == "https":
            conn = http.client.HTTPSConnection(
                host, port, timeout=self._connect_timeout, context=self.ssl_context()
            )
        else:
            conn = http.client.HTTPConnection(host, port, timeout=self._connect_timeout)
        conn.response_class = _Response
        conn.connect()
        assert conn.sock is not None
        conn.sock.settimeout(self._read_timeout)
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.timeout = self._read_timeout  # a reconnect after "Connection: close"
        return conn

    def give(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
        """Keep ``conn`` for reuse if ``response`` was its last and was read to the end;
        close it otherwise."""
        if conn.sock is None or not response.isclosed() or response.will_close:
            conn.close()
            return
        scheme = "https" if isinstance(conn, http.client.HTTPSConnection) else "http"
        with self._lock:
            idle = self._idle.setdefault((scheme, conn.host, conn.port), [])
            if len(idle) < _MAX_IDLE:
                idle.append(conn)
                return
        conn.close()

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS settings of ``https`` connections (built on first use)."""
        with self._lock:
            if self._ssl is None:
                self._ssl = self._ssl_factory()
            return self._ssl


class PooledResponse:
    """A response on a connection of ``pool``, its body read into the caller's
    buffers. While it is open, cancelling ``cancel`` shuts its connection down, so a
    read blocked on it returns. Closed, its connection goes back to the pool if the
    body was read to its end, and is closed otherwise."""

    def __init__(
        self,
        response: http.client.HTTPResponse,
        conn: http.client.HTTPConnection,
        pool: ConnectionPool,
        cancel: Cancel | None = None,
    ) -> None:
        self._response = response
        self._conn: http.client.HTTPConnection | None = conn
        self._pool = pool
        self._cancel = cancel
        self.status = response.status
        #: The body's ``Content-Encoding``: ``http.client`` decodes none.
        self.encoding = response.getheader("Content-Encoding")
        if cancel is not None:
            cancel.track(conn, True)

    def header(self, name: str) -> str | None:
        return self._response.getheader(name)

    def readinto(self, view: memoryview) -> int:
        """Up to ``len(view)`` bytes of the body; 0 at its end; :class:`BodyBroken`
        (the response closed) when it breaks off."""
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

    def error_body(self) -> bytes:
        """The start of an error answer's body (64 KiB at most); the response is closed."""
        try:
            body = self._response.read(_ERROR_BODY_LIMIT)
        except (OSError, http.client.HTTPException):
            body = b""
        self.close()
        return body

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._cancel is not None:
            self._cancel.track(conn, False)
        if self._response.length:
            conn.close()  # unread bytes would be the next response
        else:
            self._pool.give(conn, self._response)
