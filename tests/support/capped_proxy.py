"""A "capped bucket": a TCP relay that limits bandwidth and adds latency per request.

:class:`CappedProxy` sits on 127.0.0.1 in front of an object store (SeaweedFS, moto,
fake-gcs-server) and plays a bucket that many ranks share: every byte, both directions
and all connections together, passes one token bucket of ``rate`` bytes per second, and
each request waits ``latency`` seconds before it is forwarded.

Why a TCP relay and not :class:`tests.support.servers.FaultProxy` with a rate option: the fault
proxy parses HTTP in Python, reads each request body whole before forwarding it and
opens a new upstream connection per request, so it stores and forwards every part (a
part's latency grows with its size) and spends interpreter time per byte on a machine
whose two cores the trainer and the server already share. The relay never parses: two
threads per connection move up to ``chunk`` bytes per ``recv_into``/``sendall`` through
big socket buffers, keep-alive connections stay open end to end, and the GIL is released
during every socket call (benchmarks/NOTES.md, "In the training loop", has its measured
CPU cost and the rate it reaches). What it cannot do is what needs HTTP: per-request
faults and byte counts by path, which stay the fault proxy's job.

Latency is charged per request without parsing HTTP: the first bytes a client sends on
a connection that is new, or whose server has answered since the client last sent,
wait ``latency`` before they go on (one wait per request/response exchange on a
keep-alive connection; a ``100 Continue`` answer counts as an exchange).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable

_BUFFER = 4 << 20  # socket send/receive buffers: a few chunks in flight per direction


class TokenBucket:
    """``rate`` bytes per second with ``burst`` bytes of credit, shared by its callers.

    Kept as a theoretical arrival time (GCRA): :meth:`take` books ``n`` bytes right
    after those already booked and sleeps until the bucket would have held them."""

    def __init__(self, rate: float, burst: int) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"rate and burst must be > 0, got rate={rate}, burst={burst}")
        self.rate = float(rate)
        self._tolerance = burst / self.rate
        self._booked = 0.0
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._booked = max(self._booked, now) + n / self.rate
            wait = self._booked - self._tolerance - now
        if wait > 0:
            time.sleep(wait)


class _Link:
    """One client connection and its upstream connection."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client, self.server = client, server
        self.answered = True  # the next bytes from the client start a request


class CappedProxy:
    """A TCP relay on 127.0.0.1 in front of ``upstream`` (``http://host:port``); see the
    module docstring. ``rate`` in bytes per second for all traffic together (None: no
    cap), ``latency`` in seconds per request, ``burst`` the bucket's credit in bytes.

    ``url`` is the address to give clients; ``bytes_up`` / ``bytes_down`` count what it
    relayed to and from the server; :meth:`cpu_seconds` is the CPU its own threads used."""

    def __init__(
        self,
        upstream: str,
        *,
        rate: float | None = 100e6,
        latency: float = 0.005,
        burst: int = 1 << 20,
        chunk: int = 1 << 20,
    ) -> None:
        if latency < 0:
            raise ValueError(f"latency must be >= 0, got {latency}")
        parsed = urllib.parse.urlsplit(upstream)
        self._upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.bucket = TokenBucket(rate, burst) if rate is not None else None
        self.latency = latency
        self._chunk = chunk
        self.bytes_up = 0
        self.bytes_down = 0
        self._lock = threading.Lock()
        self._links: set[_Link] = set()
        self._threads: set[int] = set()  # native ids of the live relay threads
        self._cpu_done = 0.0  # CPU seconds of the relay threads that have finished
        self._closed = False
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        host, port = self._listener.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self._spawn(self._accept, "capped-accept")

    # --- threads ----------------------------------------------------------------------

    def _spawn(self, target: Callable[..., None], name: str, *args: object) -> None:
        def run() -> None:
            with self._lock:
                self._threads.add(threading.get_native_id())
            try:
                target(*args)
            finally:
                with self._lock:
                    self._threads.discard(threading.get_native_id())
                    self._cpu_done += time.thread_time()

        threading.Thread(target=run, name=name, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(self._upstream, timeout=30)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUFFER)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUFFER)
            link = _Link(client, server)
            with self._lock:
                if self._closed:
                    client.close()
                    server.close()
                    return
                self._links.add(link)
            self._spawn(self._pump, "capped-up", link, True)
            self._spawn(self._pump, "capped-down", link, False)

    def _pump(self, link: _Link, up: bool) -> None:
        src, dst = (link.client, link.server) if up else (link.server, link.client)
        buf = bytearray(self._chunk)
        view = memoryview(buf)
        try:
            while True:
                n = src.recv_into(buf)
                if n == 0:
                    break
                if up and link.answered:
                    link.answered = False
                    if self.latency:
                        time.sleep(self.latency)
                if self.bucket is not None:
                    self.bucket.take(n)
                with self._lock:  # counted before it is sent: a reader that has it sees it
                    if up:
                        self.bytes_up += n
                    else:
                        self.bytes_down += n
                dst.sendall(view[:n])
                if not up:
                    link.answered = True
        except OSError:
            pass  # a side hung up or the proxy closed
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
            if not up:
                self._forget(link)

    def _forget(self, link: _Link) -> None:
        with self._lock:
            self._links.discard(link)
        for sock in (link.client, link.server):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the other direction's recv
            sock.close()

    # --- measuring --------------------------------------------------------------------

    def cpu_seconds(self) -> float:
        """User + system CPU seconds its threads have used so far (Linux ``/proc``)."""
        with self._lock:
            live, total = list(self._threads), self._cpu_done
        tick = os.sysconf("SC_CLK_TCK")
        for tid in live:
            with contextlib.suppress(OSError):
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
        return total

    # --- lifetime ---------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links = list(self._links)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self._listener.close()
        for link in links:
            self._forget(link)

    def __enter__(self) -> CappedProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
