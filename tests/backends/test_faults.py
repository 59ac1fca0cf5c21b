"""Retries, timeouts and cleanup under injected faults (a proxy in front of moto)."""

from __future__ import annotations

import collections
import re
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

import storage
from extensions import ZStandard
from storage import S3FileSystem
from storage.backends._ranges import (
    PARALLEL_GETS,
    RangeMismatchError,
    check_range,
    parallel_gets,
)
from storage.checkpoint.deadline import DeadlineExceededError
from tests.support.servers import (
    FaultProxy,
    boto3_client,
    create_bucket,
    fake_gcs_endpoint,
    gcs_create_bucket,
    gcs_options,
    gcs_put,
    list_keys,
    moto_endpoint,
    open_uploads,
    s3_options,
)

BUCKET = "dcp-faults"
ATTEMPTS = 3
FAST = {"retries": {"mode": "standard", "total_max_attempts": ATTEMPTS}}


@pytest.fixture
def proxy() -> Iterator[FaultProxy]:
    endpoint = moto_endpoint()
    create_bucket(endpoint, BUCKET)
    with FaultProxy(endpoint, seed=1234) as p:
        yield p


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    state = {f"big{i}": torch.randn(3 << 19, generator=gen) for i in range(2)}  # 2 x 6 MiB
    state.update({f"small{i:02d}": torch.randn(1000, generator=gen) for i in range(12)})
    return state


def _fs(proxy: FaultProxy, direct: bool = True, **config: Any) -> S3FileSystem:
    opts = s3_options(proxy.url, config_kwargs={**FAST, **config})
    # 5 MiB parts: each 6 MiB data file is a two-part multipart upload.
    return S3FileSystem(storage_options=opts, part_size=5 << 20, direct=direct)


# Data requests go out through the direct path by default, or through s3fs.
PATHS = pytest.mark.parametrize("direct", [True, False], ids=["direct", "s3fs"])


def _round_trip(
    proxy: FaultProxy, fs: S3FileSystem, chain: str = "plain", reader_fs: S3FileSystem | None = None
) -> None:
    """Save through ``fs`` and load through ``reader_fs`` (``fs`` if None), bit-exact."""
    url = f"s3://{BUCKET}/{uuid.uuid4().hex}/ckpt"
    state = _state()
    transforms = [ZStandard()] if chain == "zstd" else []
    # A file per item: small ones go up in one PUT, big ones as multipart uploads.
    writer = storage.CheckpointWriter(
        url, filesystem=fs, transforms=transforms, thread_count=4, single_file_per_rank=False
    )
    dcp.save(state, storage_writer=writer)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    reader = storage.CheckpointReader(url, filesystem=reader_fs or fs)
    dcp.load(target, storage_reader=reader)
    for k in state:
        assert torch.equal(target[k], state[k]), k


@pytest.mark.parametrize(
    "kind,method,path",
    [
        ("503", "PUT", r"\.distcp\?.*partNumber"),  # SlowDown on a part upload
        ("500", "PUT", r"\.distcp$"),  # InternalError on a single PUT
        ("reset", "POST", r"uploadId="),  # reset while completing a multipart upload
        ("503", "GET", r"\.distcp"),
        ("reset", "GET", r"\.distcp"),
        ("truncate", "GET", r"\.distcp"),  # body cut in half: resumed from there
        ("truncate", "GET", r"\.metadata"),
    ],
)
@PATHS
def test_each_transient_fault_is_retried(
    proxy: FaultProxy, kind: str, method: str, path: str, direct: bool
) -> None:
    fault = proxy.add(kind, method=method, path=path, count=2)
    _round_trip(proxy, _fs(proxy, direct))
    assert fault.hits == 2


@PATHS
def test_read_timeout_is_enforced_and_retried(proxy: FaultProxy, direct: bool) -> None:
    # One data GET is held and never answered (until the proxy closes): the load
    # completes only if the client gives it up at its read timeout and asks again. The
    # short timeout is the reader's alone, with attempts to spare: a loaded machine can
    # stall moto past it on any request (before: 1 s on every request, the writes too).
    fault = proxy.add("delay", method="GET", path=r"\.distcp", count=1, delay=600)
    reader = _fs(
        proxy, direct, read_timeout=5, retries={"mode": "standard", "total_max_attempts": 5}
    )
    _round_trip(proxy, _fs(proxy, direct), reader_fs=reader)
    assert fault.hits == 1
    gets = [t for m, t in proxy.arrivals if m == "GET" and ".distcp" in t]
    # The delayed request was abandoned by the client and asked again.
    assert len(set(gets)) < len(gets)


@pytest.mark.parametrize("chain", ["plain", "zstd"])
def test_random_transient_faults(proxy: FaultProxy, chain: str) -> None:
    # ~8% of all requests fail in one of the ways S3 fails; the save and load still
    # complete bit-exact (with the default 5 attempts).
    for kind in ("503", "500", "reset"):
        proxy.add(kind, probability=0.027)
    proxy.add("truncate", method="GET", probability=0.03)
    fs = S3FileSystem(storage_options=s3_options(proxy.url), part_size=5 << 20)
    _round_trip(proxy, fs, chain)
    assert any(r.fault for r in proxy.records)


@PATHS
def test_permanent_fault_fails_bounded_and_leaves_nothing(proxy: FaultProxy, direct: bool) -> None:
    prefix = f"{uuid.uuid4().hex}/ckpt"
    url = f"s3://{BUCKET}/{prefix}"
    proxy.add("503", method="PUT", path=r"\.distcp")  # every data upload, forever
    fs = _fs(proxy, direct)
    with pytest.raises(OSError, match=rf"{url}/__0_\d+-\w+\.distcp: .*failed \(after up to 3"):
        storage.save(_state(), url, filesystem=fs, thread_count=4)
    s3 = boto3_client(moto_endpoint())
    assert list_keys(s3, BUCKET, prefix) == []  # no data objects, no .metadata
    assert open_uploads(s3, BUCKET, prefix) == []
    # Bounded: each request was tried at most ATTEMPTS times (one retry layer, not two).
    attempts = collections.Counter(
        re.sub(r"\?x-id=\w+$", "", r.target) for r in proxy.records if r.fault
    )
    assert attempts and max(attempts.values()) <= ATTEMPTS


# --- ranged answers that are not the range asked for ---------------


def _stock_checkpoint(backend: str, url: str) -> tuple[dict[str, torch.Tensor], Any]:
    """Items a and b (same shape, other values) in one data file written by stock DCP
    (no checksums), straight to the server; the filesystem that reads through the proxy."""
    state = {"a": torch.full((256,), 1.0), "b": torch.full((256,), 2.0)}
    if backend == "gcs":
        server = fake_gcs_endpoint()
        gcs_create_bucket(server, BUCKET)
        dcp.save(state, storage_writer=FsspecWriter(url, **gcs_options(server)))
    else:
        server = moto_endpoint()
        dcp.save(state, storage_writer=FsspecWriter(url, **s3_options(server)))
    return state, server


@pytest.mark.parametrize("kind", ["whole", "shift"])
@pytest.mark.parametrize("backend", ["direct", "s3fs", "fsspec", "gcs"])
def test_a_ranged_get_answered_with_other_bytes_is_refused(kind: str, backend: str) -> None:
    """Before, the S3 direct path read a ``200`` (the whole object) to b's ranged GET as
    b's bytes, and every path read a ``206`` for another range as asked: a stock
    checkpoint loaded item a's values into b without a word."""
    scheme = "gs" if backend == "gcs" else "s3"
    url = f"{scheme}://{BUCKET}/{uuid.uuid4().hex}/ckpt"
    state, server = _stock_checkpoint(backend, url)
    with FaultProxy(server) as proxy:
        fs: Any
        if backend == "gcs":
            fs = storage.GCSFileSystem(storage_options=gcs_options(proxy.url))
        elif backend == "fsspec":
            fs = storage.FsspecFileSystem(storage_options=s3_options(proxy.url), protocol="s3")
        else:
            fs = _fs(proxy, direct=backend == "direct")
        target = {"b": torch.zeros(256)}  # b alone: its GET starts past byte 0
        storage.load(target, url, filesystem=fs)
        assert torch.equal(target["b"], state["b"])
        proxy.add(kind, method="GET", path=r"\.distcp")
        if backend == "fsspec" and kind == "shift":
            # fsspec hands back the body alone: the same number of other bytes cannot be
            # told apart there (docs/backends.md); the S3 and GCS backends check headers.
            return
        with pytest.raises(OSError, match="ignored the range|not the bytes asked for"):
            storage.load(target, url, filesystem=fs)
        # A range from byte 0 answered with the whole object is the range asked for.
        proxy.clear()
        proxy.add("whole", method="GET", path=r"\.distcp")
        target = {"a": torch.zeros(256)}
        storage.load(target, url, filesystem=fs)
        assert torch.equal(target["a"], state["a"])


@pytest.mark.parametrize(
    "header",
    ["bytes ²-9/100", "bytes 5-٩/100", "bytes 5-9/" + "9" * 5000, "bytes " + "1" * 5000 + "-9/*"],
)
def test_a_content_range_that_is_no_number_is_a_mismatch_named_briefly(header: str) -> None:
    """A server's Content-Range is read as ASCII digits of any object size: before,
    non-ASCII digits matched and a 5000-digit one failed with int()'s digit limit."""
    with pytest.raises(RangeMismatchError, match="not the bytes asked for") as caught:
        check_range(206, header, 5, 9, "s3://bucket/ckpt/__0_0.distcp")
    assert len(str(caught.value)) < 600


# --- every request inside timeout= -----------------------------------

STALLS = {
    # (what stalls, fault, method, target): before, each blocked past the deadline.
    "load: reading .metadata (2 B/s)": ("load", "trickle", "GET", r"/\.metadata"),
    "load: checking the base": ("load-incremental", "delay", "HEAD", r"/base/\.metadata"),
    "save: is a checkpoint there?": ("save-exclusive", "delay", "HEAD", r"/ckpt/\.metadata"),
    "save: reading the base (2 B/s)": ("save-incremental", "trickle", "GET", r"/base/\.metadata"),
    "save: listing before the commit (2 B/s)": ("save", "trickle", "GET", r"list-type=2"),
    "save: publishing .metadata": ("save", "delay", "PUT", r"/ckpt/\.metadata"),
}


@pytest.mark.parametrize("case", list(STALLS), ids=list(STALLS))
def test_timeout_covers_every_request_of_a_save_or_load(proxy: FaultProxy, case: str) -> None:
    what, kind, method, target = STALLS[case]
    before = set(threading.enumerate())  # a thread an earlier test left is not this call's
    root = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    server = S3FileSystem(storage_options=s3_options(moto_endpoint()))
    state = {"w": torch.randn(1000)}
    storage.save(state, f"{root}/base", filesystem=server, fingerprint=True)
    if what.startswith("load"):
        if what == "load-incremental":
            storage.save(state, f"{root}/ckpt", filesystem=server, base=f"{root}/base")
        else:
            storage.save(state, f"{root}/ckpt", filesystem=server)
    # The default socket timeouts (60 s between bytes) never fire on a trickle.
    fs = S3FileSystem(storage_options=s3_options(proxy.url))
    proxy.add(kind, method=method, path=target, delay=60.0)
    with pytest.raises(DeadlineExceededError, match=r"within the 2 s deadline") as info:
        if what.startswith("load"):
            storage.load({"w": torch.zeros(1000)}, f"{root}/ckpt", filesystem=fs, timeout=2)
        else:
            base = {"base": f"{root}/base"} if what == "save-incremental" else {}
            overwrite = what != "save-exclusive"
            storage.save(
                state, f"{root}/ckpt", filesystem=fs, timeout=2, overwrite=overwrite, **base
            )
    assert info.value.url is not None and info.value.url.startswith(f"{root}/")
    # Interrupted, not left behind: before, the HEADs, LISTs and the metadata PUT went
    # through the client outside the deadline's reach, so the error came 5 s late (the
    # grace for joining) and the thread stayed in the stalled request.
    workers = ("dcp-storage-saving", "dcp-storage-loading")
    left = [t for t in threading.enumerate() if t.name.startswith(workers) and t not in before]
    assert [t.name for t in left] == []


# --- a failed parallel read leaves the caller's buffer alone ----------------------------


def _pool_idle(backend: str) -> None:
    """Return once every thread of ``backend``'s ranged-GET pool has finished what it
    was given before: each takes a task that waits for all the others."""
    barrier = threading.Barrier(PARALLEL_GETS + 1)
    pool = parallel_gets(backend)
    for _ in range(PARALLEL_GETS):
        pool.submit(barrier.wait, 120)
    barrier.wait(120)


@pytest.mark.parametrize("backend", ["direct", "s3fs", "gcs"])
def test_a_failed_parallel_read_writes_nothing_after_it_raised(backend: str) -> None:
    """A large read is split into window-sized GETs run in parallel, each writing into
    its slice of the caller's buffer. One fails for good while a later one is held by
    the proxy: the read must stop the held one before raising. Before, the S3 reader
    raised at the first failed piece and left the others running, so the held piece
    wrote into the buffer after the error had reached the caller (a buffer it may
    already have reused or freed)."""
    name = f"{uuid.uuid4().hex}/obj"
    window = (1 if backend == "gcs" else 5) << 20
    data = b"d" * (4 * window)
    fs: Any
    if backend == "gcs":
        server = fake_gcs_endpoint()
        gcs_create_bucket(server, BUCKET)
        gcs_put(server, BUCKET, name, data)
    else:
        server = moto_endpoint()
        create_bucket(server, BUCKET)
        boto3_client(server).put_object(Bucket=BUCKET, Key=name, Body=data)
    with FaultProxy(server) as proxy:
        if backend == "gcs":
            fs = storage.GCSFileSystem(storage_options=gcs_options(proxy.url), part_size=window)
        else:
            fs = _fs(proxy, direct=backend == "direct")
        # The first window is read alone; the other three are fetched in parallel: the
        # second of them answered with the whole object (refused), the third held.
        proxy.add("whole", method="GET", range=rf"^bytes={2 * window}-", count=1)
        release = threading.Event()
        proxy.add("delay", method="GET", range=rf"^bytes={3 * window}-", delay=600, release=release)
        buffer = bytearray(4 * window)
        view = memoryview(buffer)
        try:
            with fs.open_slice(f"{BUCKET}/{name}", 0, len(data)) as reader:
                got = 0
                while got < window:
                    got += reader.readinto(view[got:window])
                with pytest.raises(OSError, match="ignored the range"):
                    reader.readinto(view[window:])
            before = bytes(buffer)
        finally:
            release.set()
        _pool_idle("gcs" if backend == "gcs" else "s3")
    assert bytes(buffer) == before, "a piece wrote into the buffer after the read raised"
    assert buffer[3 * window :] == bytes(window)
