"""``ConnectionPool``: keep-alive ``http.client`` connections for a backend's direct
data path (reads with ``readinto`` straight into the caller's buffer, the GIL released
while the socket fills it).

One pool per client; connections are keyed by scheme, host and port, handed to one
caller at a time and given back only when their last response was read to the end.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
from collections.abc import Callable

from urllib3.util.wait import wait_for_read

_MAX_IDLE = 64


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
                host, port, timeout=self._connect_timeout, context=self._context()
            )
        else:
            conn = http.client.HTTPConnection(host, port, timeout=self._connect_timeout)
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

    def _context(self) -> ssl.SSLContext | None:
        with self._lock:
            if self._ssl is None:
                self._ssl = self._ssl_factory()
            return self._ssl
