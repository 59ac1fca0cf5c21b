"""FaultProxy's records are complete once the client is done, however late the
proxy's handler thread gets to record (a loaded machine can hold it for seconds)."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.support import servers
from tests.support.servers import FaultProxy


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def upstream() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_record_made_late_is_waited_for(upstream: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: settle() gave up after 5 s and returned the records without it, so a
    # count of requests or bytes came out short on a machine that stalled the thread.
    release = threading.Event()
    record = servers._Handler._record

    def late(self: Any, *args: Any, **kwargs: Any) -> None:
        release.wait(120)  # the client has its answer; the record comes later
        record(self, *args, **kwargs)

    monkeypatch.setattr(servers._Handler, "_record", late)
    with FaultProxy(upstream) as proxy:
        with urllib.request.urlopen(f"{proxy.url}/x", timeout=60) as resp:
            assert resp.read() == b"ok"
        timer = threading.Timer(6.0, release.set)  # a stall longer than the old bound
        timer.start()
        try:
            assert [(r.method, r.target, r.body_bytes) for r in proxy.records] == [("GET", "/x", 2)]
        finally:
            timer.cancel()
            release.set()


def test_a_held_request_is_not_waited_for(upstream: str) -> None:
    with FaultProxy(upstream) as proxy:
        proxy.add("delay", path=r"/held", delay=600)
        held = threading.Thread(
            target=lambda: pytest.raises(OSError, urllib.request.urlopen, f"{proxy.url}/held"),
            daemon=True,
        )
        held.start()
        while not proxy.arrivals:
            threading.Event().wait(0.01)
        with urllib.request.urlopen(f"{proxy.url}/x", timeout=60) as resp:
            resp.read()
        assert [r.target for r in proxy.settle(timeout=600)] == ["/x"]
    held.join(60)
