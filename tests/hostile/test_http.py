"""A store that misbehaves at the HTTP level, against our own S3 and GCS clients.

Each test runs a small hostile server (``tests.support.hostile_http``) in place of the
store and says what happened before the fix it guards."""

from __future__ import annotations

import contextlib
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


class _Resumable:
    """A GCS resumable-upload endpoint that keeps the first chunk and then answers the
    final one with a ``308`` whose ``Range`` says ``final`` (``"stuck"``: no byte of it
    kept, :data:`_GIVE_IN` times before it gives in; ``"backwards"``: fewer bytes than
    it confirmed for the first chunk, once)."""

    def __init__(self, final: str) -> None:
        self.final = final
        self.puts: list[str] = []  # the Content-Range of every chunk

    def __call__(self, request: Request, sock: socket.socket) -> bool:
        if request.method == "POST":
            location = f"http://{request.headers['host']}/session"
            sock.sendall(head("200 OK", {"Location": location, "Content-Length": "0"}))
            return True
        if request.method != "PUT":
            sock.sendall(head("204 No Content", {}))
            return True
        sent = request.headers["content-range"]
        self.puts.append(sent)
        first, last = (int(n) for n in sent.split(" ")[1].split("/")[0].split("-"))
        kept = last
        if not sent.endswith("/*"):  # the final chunk
            finals = sum(not p.endswith("/*") for p in self.puts)
            if self.final == "stuck" and finals < _GIVE_IN:
                kept = first - 1
            elif self.final == "backwards" and finals == 1:
                kept = 99
            else:
                sock.sendall(head("200 OK", {"Content-Length": "2"}) + b"{}")
                return True
        sock.sendall(
            head("308 Resume Incomplete", {"Range": f"bytes=0-{kept}", "Content-Length": "0"})
        )
        return True


_GIVE_IN = 30


@pytest.mark.parametrize("final", ["stuck", "backwards"])
def test_a_resumable_upload_whose_server_keeps_nothing_fails(final: str) -> None:
    """Before, a chunk answered ``308`` with no byte of it kept was sent again at once,
    without a wait and without end (here until the server gave in after 30 tries, the
    save then reported as done); a ``308`` saying the server kept fewer bytes than it had
    confirmed sent the end of the chunk as the bytes at that offset."""
    answer = _Resumable(final)
    part = 256 << 10
    with HostileServer(answer) as server:
        fs = storage.GCSFileSystem(
            storage_options=gcs_options(server.url), part_size=part, single_request_size=0
        )
        fs.fs.retries = 2
        stream = fs.create_stream(f"{BUCKET}/obj", "wb")
        with pytest.raises(OSError, match="kept"), stream as file:
            file.write(b"x" * (part + 100))
    assert len(answer.puts) <= 3
    # Every chunk went out at the offset it belongs at.
    assert answer.puts[1:] == [f"bytes {part}-{part + 99}/{part + 100}"] * (len(answer.puts) - 1)


class _Replaced:
    """Serves a 1000-byte object: the first GET breaks off after 500 bytes of version
    ``1``; every later GET ignores its precondition (``If-Match``, ``generation=``)
    and serves version ``2``, whose bytes differ, saying so in ``header``."""

    def __init__(self, header: str) -> None:
        self.header = header
        self.gets = 0

    def __call__(self, request: Request, sock: socket.socket) -> bool:
        self.gets += 1
        first, last = (int(n) for n in request.headers["range"][6:].split("-"))
        version, byte = ("1", b"a") if self.gets == 1 else ("2", b"b")
        headers = {
            self.header: f'"{version}"' if self.header == "ETag" else version,
            "Content-Range": f"bytes {first}-{last}/1000",
            "Content-Length": str(last - first + 1),
        }
        sock.sendall(head("206 Partial Content", headers))
        if self.gets == 1:
            sock.sendall(byte * 500)
            return False  # broken off: the rest is asked for again
        sock.sendall(byte * (last - first + 1))
        return True


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_a_resumed_read_never_takes_another_version(backend: str) -> None:
    """Before, a resumed GET's answer was taken whatever version it said it served: a
    store or proxy that ignored the pin (``If-Match``, ``generation=``) had the read
    stitch two versions together (here 500 bytes of each) and hand them over as the
    object's."""
    answer = _Replaced("ETag" if backend == "s3" else "X-Goog-Generation")
    with HostileServer(answer) as server:
        fs: Any = _s3(server.url) if backend == "s3" else _gcs(server.url)
        stream = fs.open_slice(f"{BUCKET}/obj", 0, 1000)
        with pytest.raises(OSError, match="replaced or deleted"), stream as file:
            file.read()
    assert answer.gets == 2


class _Interim:
    """Answers every request with ``100 Continue`` over and over (up to :data:`_INTERIM`
    of them, so a test of the unfixed code ends), and never with a response."""

    def __init__(self) -> None:
        self.stopped = threading.Event()

    def __call__(self, request: Request, sock: socket.socket) -> bool:
        with contextlib.suppress(OSError):
            for _ in range(_INTERIM // 1000):
                if self.stopped.is_set():
                    break
                sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n" * 1000)
        return False


_INTERIM = 300_000


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_endless_interim_answers_fail_the_request(backend: str) -> None:
    """Before, ``http.client`` skipped any number of ``100 Continue`` answers while
    waiting for a response, each well within the read timeout: a server sending them
    without end held a read forever (here until it stopped after 300,000)."""
    answer = _Interim()
    with HostileServer(answer) as server:
        fs: Any = _s3(server.url) if backend == "s3" else _gcs(server.url)
        if backend == "gcs":
            fs.fs.retries = 2
        with pytest.raises(OSError, match="interim"):
            fs.open_slice(f"{BUCKET}/obj", 0, 1000)
        answer.stopped.set()


_S3_XML = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'
#: Pages a looping listing answers before it ends (so a test of the unfixed code ends).
_PAGES = 300


class _Looping:
    """Answers every listing with the same truncated page (the same marker to go on
    from, up to :data:`_PAGES` times, then a last page) and anything else with 404."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.pages = 0

    def __call__(self, request: Request, sock: socket.socket) -> bool:
        self.pages += 1
        more = "true" if self.pages < _PAGES else "false"
        if self.kind == "objects":
            body = (
                f"<ListBucketResult {_S3_XML}><Name>{BUCKET}</Name><Prefix>root/</Prefix>"
                f"<Delimiter>/</Delimiter><MaxKeys>1000</MaxKeys><KeyCount>1</KeyCount>"
                f"<IsTruncated>{more}</IsTruncated><Contents><Key>root/a</Key><Size>1</Size>"
                "</Contents><NextContinuationToken>same</NextContinuationToken></ListBucketResult>"
            )
        else:
            body = (
                f"<ListMultipartUploadsResult {_S3_XML}><Bucket>{BUCKET}</Bucket>"
                "<NextKeyMarker>root/a</NextKeyMarker><NextUploadIdMarker>u1</NextUploadIdMarker>"
                f"<MaxUploads>1000</MaxUploads><IsTruncated>{more}</IsTruncated><Upload>"
                "<Key>root/a</Key><UploadId>u1</UploadId><Initiated>2024-01-01T00:00:00.000Z"
                "</Initiated></Upload></ListMultipartUploadsResult>"
            )
        data = body.encode()
        headers = {"Content-Type": "application/xml", "Content-Length": str(len(data))}
        sock.sendall(head("200 OK", headers) + data)
        return True


@pytest.mark.parametrize("kind", ["objects", "uploads"])
def test_a_listing_that_does_not_move_on_is_refused(kind: str) -> None:
    """Before, an S3 listing went on from whatever marker the store gave: one that gave
    the same truncated page again and again kept ``ls`` (and ``gc``'s look for
    incomplete uploads, each page's uploads appended again) going as long as it did,
    here 300 pages, without end for a store that never stops."""
    answer = _Looping(kind)
    with HostileServer(answer) as server:
        fs = _s3(server.url)
        with pytest.raises(OSError, match="already used marker"):
            if kind == "objects":
                fs.ls(f"{BUCKET}/root")
            else:
                fs.pending_uploads(f"{BUCKET}/root")
    assert answer.pages == 2
