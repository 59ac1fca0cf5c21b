"""A hostile object store: an HTTP server on 127.0.0.1 that answers however a test says.

:class:`HostileServer` reads each request (its head and a ``Content-Length`` body) and
hands it to the test's ``answer(request, sock)``, which writes raw bytes to the socket:
a wrong status, an ETag that changed, a body that never ends. It stops with its ``with``
block (connections shut down), so nothing it does can outlive the test."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class Request:
    method: str
    target: str
    headers: dict[str, str]  # names lower-cased
    body: bytes


#: ``answer(request, sock)``: write the answer; return ``False`` to close the connection.
Answer = Callable[[Request, socket.socket], bool]


class HostileServer:
    def __init__(self, answer: Answer) -> None:
        self._answer = answer
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.requests: list[Request] = []
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        try:
            while not self.stopped.is_set():
                line = reader.readline(65536)
                if not line:
                    return
                method, target, _ = line.decode("latin-1").split(" ", 2)
                headers: dict[str, str] = {}
                while (line := reader.readline(65536)) not in (b"\r\n", b"\n", b""):
                    name, _, value = line.decode("latin-1").partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = reader.read(int(headers.get("content-length", 0)))
                request = Request(method, target, headers, body)
                with self._lock:
                    self.requests.append(request)
                if not self._answer(request, conn):
                    return
        except (OSError, ValueError):
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            with contextlib.suppress(OSError):
                reader.close()
                conn.close()

    def close(self) -> None:
        self.stopped.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept(); close() would not
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)

    def __enter__(self) -> HostileServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def head(status: str, headers: dict[str, str]) -> bytes:
    """A response head: ``status`` (``"200 OK"``) and ``headers``."""
    lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def send_chunked(sock: socket.socket, total: int, stopped: threading.Event) -> int:
    """Up to ``total`` bytes as a chunked body (64 KiB chunks), then its end; the bytes
    sent before the client went away (or all of them)."""
    chunk = b"x" * (64 << 10)
    sent = 0
    try:
        while sent < total and not stopped.is_set():
            sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            sent += len(chunk)
        sock.sendall(b"0\r\n\r\n")
    except OSError:
        pass
    return sent
