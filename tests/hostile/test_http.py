"""A store that misbehaves at the HTTP level, against our own S3 and GCS clients.

Each test runs a small hostile server (``tests.support.hostile_http``) in place of the
store and says what happened before the fix it guards."""

from __future__ import annotations

import socket
import threading
from typing import Any

import fsspec.asyn
import pytest

import storage
from storage.backends.cancel import Cancel
from storage.backends.gcs import _session
from tests.support.hostile_http import HostileServer, Request, head, send_chunked
from tests.support.servers import gcs_options, s3_options

pytestmark = pytest.mark.timeout(60)

BUCKET = "hostile"
FAST_S3 = {"retries": {"mode": "standard", "total_max_attempts": 2}, "read_timeout": 5}
#: What an endless body sends at most, before it ends (so a test of the unfixed code ends).
ENDLESS = 128 << 20


def _s3(url: str) -> storage.S3FileSystem:
    return storage.S3FileSystem(storage_options=s3_options(url, config_kwargs=FAST_S3))


def _gcs(url: str) -> storage.GCSFileSystem:
    return storage.GCSFileSystem(storage_options=gcs_options(url))


class _Endless:
    """Answers every request with ``status`` and a chunked body of :data:`ENDLESS` bytes;
    ``sent`` counts what went out before the client hung up."""

    def __init__(self, status: str, headers: dict[str, str]) -> None:
        self.status = status
        self.headers = headers
        self.sent = 0
        self.stopped = threading.Event()

    def __call__(self, request: Request, sock: socket.socket) -> bool:
        headers = {**self.headers, "Transfer-Encoding": "chunked"}
        sock.sendall(head(self.status, headers))
        self.sent += send_chunked(sock, ENDLESS, self.stopped)
        return False


def test_an_endless_answer_to_a_part_upload_is_not_read_whole() -> None:
    """Before, the S3 direct path read the whole body of an accepted part's answer: a
    store (or proxy) that kept sending held the upload forever and its memory grew with
    every byte."""
    answer = _Endless("200 OK", {"ETag": '"part"'})
    with HostileServer(answer) as server:
        direct = _s3(server.url).client.direct(BUCKET)
        assert direct is not None
        etag = direct.upload_part(BUCKET, "k", "upload", 1, memoryview(b"x" * 100), None, Cancel())
        assert etag == '"part"'
        server.close()
    assert answer.sent < ENDLESS // 4


@pytest.mark.parametrize("status", ["200 OK", "404 Not Found"])
def test_an_endless_answer_to_a_gcs_upload_request_is_not_read_whole(status: str) -> None:
    """Before, every request of a GCS upload (starting a session, each chunk, a single
    upload) read its answer's body whole, success or error: a store that kept sending
    held the save forever and its memory grew with every byte."""
    answer = _Endless(status, {"Content-Type": "application/json"})
    with HostileServer(answer) as server:
        gcs: Any = _gcs(server.url).fs
        url = f"{server.url}/upload/storage/v1/b/{BUCKET}/o"
        call = fsspec.asyn.sync
        if status.startswith("200"):
            call(gcs.loop, _session.request, gcs, "POST", url, data=b"{}")
        else:
            with pytest.raises(FileNotFoundError):
                call(gcs.loop, _session.request, gcs, "POST", url, data=b"{}")
        server.close()
    assert answer.sent < ENDLESS // 4
