"""The GCS data path against fake-gcs-server through the fault proxy: resumable chunks
retried and cancelled, ranged GETs resumed from the next byte, bytes on the wire."""

from __future__ import annotations

import threading
import traceback
import uuid
from collections.abc import Iterator

import pytest
import torch
from google.oauth2.credentials import Credentials

import storage
from extensions import ZStandard
from storage import GCSFileSystem
from storage.backends._buffers import BufferPool
from storage.backends.gcs import _direct as gcs_direct
from storage.backends.gcs import _upload as gcs_upload
from tests.support.servers import (
    FaultProxy,
    Record,
    fake_gcs_endpoint,
    gcs_create_bucket,
    gcs_list,
    gcs_options,
    gcs_put,
)

BUCKET = "dcp-gcs-io"
MiB = 1 << 20


@pytest.fixture
def proxy() -> Iterator[FaultProxy]:
    endpoint = fake_gcs_endpoint()
    gcs_create_bucket(endpoint, BUCKET)
    with FaultProxy(endpoint, seed=11) as p:
        yield p


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    state = {f"big{i}": torch.randn(3 * MiB // 4, generator=gen) for i in range(2)}  # 3 MiB
    state.update({f"small{i:02d}": torch.randn(1000, generator=gen) for i in range(10)})
    return state


# How GETs are sent: over pooled http.client connections (the default), or through
# gcsfs's aiohttp session (what a client with session_kwargs gets).
TRANSPORTS = ["direct", "streamed"]


def _fs(
    proxy: FaultProxy, attempts: int | None = None, single: int = MiB, transport: str = "direct"
) -> GCSFileSystem:
    # 1 MiB chunks (and read windows), no single request past one: every 3 MiB item is
    # a resumable upload of several chunks, read in several GETs.
    extra = {"session_kwargs": {"trust_env": False}} if transport == "streamed" else {}
    fs = GCSFileSystem(
        storage_options=gcs_options(proxy.url, **extra), part_size=MiB, single_request_size=single
    )
    assert (gcs_direct.direct_get(fs.fs) is not None) == (transport == "direct")
    if attempts is not None:
        fs.fs.retries = attempts  # this proxy's own client: gcsfs's attempts, lowered
    return fs


def _round_trip(fs: GCSFileSystem, url: str, transforms: list | None = None) -> None:
    state = _state()
    storage.save(state, url, filesystem=fs, transforms=transforms or [], single_file_per_rank=False)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    storage.load(target, url, filesystem=fs)
    assert all(torch.equal(target[k], state[k]) for k in state)


def _prefix(url: str) -> str:
    return url.removeprefix(f"gs://{BUCKET}/")


@pytest.mark.parametrize("kind", ["gcs503", "reset"])
def test_chunk_faults_are_retried(proxy: FaultProxy, kind: str) -> None:
    fault = proxy.add(kind, method="PUT", path=r"/upload/", count=2)
    _round_trip(_fs(proxy), f"gs://{BUCKET}/{uuid.uuid4().hex}/ckpt")
    assert fault.hits == 2


def test_permanent_chunk_failure_cancels_and_leaves_nothing(proxy: FaultProxy) -> None:
    url = f"gs://{BUCKET}/{uuid.uuid4().hex}/ckpt"
    proxy.add("gcs503", method="PUT", path=r"/upload/")  # every chunk, forever
    with pytest.raises(OSError, match=rf"{url}/__0_\d+-\w+\.distcp: uploading failed"):
        storage.save(_state(), url, filesystem=_fs(proxy, attempts=2), single_file_per_rank=False)
    assert gcs_list(proxy.url, BUCKET, _prefix(url)) == []  # no data objects, no .metadata
    puts = [t for m, t in proxy.arrivals if m == "PUT"]
    deletes = {t for m, t in proxy.arrivals if m == "DELETE"}
    assert puts and set(puts) <= deletes  # every resumable session was cancelled


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("kind", ["truncate", "cut"])
def test_broken_bodies_resume_from_the_next_byte(
    proxy: FaultProxy, kind: str, transport: str
) -> None:
    url = f"gs://{BUCKET}/{uuid.uuid4().hex}/ckpt"
    fs = _fs(proxy, transport=transport)
    state = _state()
    storage.save(state, url, filesystem=fs, single_file_per_rank=False)
    proxy.clear()
    fault = proxy.add(kind, method="GET", path=r"\.distcp", count=2)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    storage.load(target, url, filesystem=fs)
    assert all(torch.equal(target[k], state[k]) for k in state)
    assert fault.hits == 2
    gets = [r for r in proxy.records if r.method == "GET" and ".distcp" in r.target]
    for broken in (r for r in gets if r.fault == kind):
        # The same range's rest: other runs of the file are read meanwhile, so the
        # resumed GET is the later one of that object that ends where the broken one did.
        again = [
            r
            for r in gets
            if _object(r) == _object(broken)
            and r.start > broken.start
            and _last_byte(r) == _last_byte(broken)
        ]
        # Asked again for the rest only, pinned to the object's generation. After a
        # reset the client may have lost bytes it was sent; after a clean cut the
        # direct path has them all, so the next GET starts exactly where the cut one
        # stopped (aiohttp drops what it buffered once it sees the early close).
        assert again and "generation=" in again[0].target
        resumed, stopped = _first_byte(again[0]), _first_byte(broken) + broken.body_bytes
        exact = kind == "cut" and transport == "direct"
        assert resumed == stopped if exact else resumed <= stopped


def _object(record: Record) -> str:
    return record.target.partition("?")[0]


def _first_byte(record: Record) -> int:
    assert record.range is not None and record.range.startswith("bytes=")
    return int(record.range.removeprefix("bytes=").partition("-")[0])


def _last_byte(record: Record) -> str:
    assert record.range is not None
    return record.range.partition("-")[2]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("chain", ["plain", "zstd"])
def test_full_load_fetches_stored_bytes_once(proxy: FaultProxy, chain: str, transport: str) -> None:
    url = f"gs://{BUCKET}/{uuid.uuid4().hex}/ckpt"
    fs = _fs(proxy, transport=transport)
    _round_trip(fs, url, [ZStandard()] if chain == "zstd" else [])
    root = fs.init_path(url)
    data = sum(fs.size(f"{root}/{n}") for n in fs.ls(root) if n.endswith(".distcp"))
    state = _state()
    proxy.clear()
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    storage.load(target, url, filesystem=fs)
    assert proxy.get_bytes(r"\.distcp") == data  # ratio 1.00


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_partial_load_fetches_only_that_item(proxy: FaultProxy, transport: str) -> None:
    url = f"gs://{BUCKET}/{uuid.uuid4().hex}/ckpt"
    fs = _fs(proxy, transport=transport)
    _round_trip(fs, url)
    md = storage.CheckpointReader(url, filesystem=fs).read_metadata()
    (info,) = [i for idx, i in md.storage_data.items() if idx.fqn == "big1"]
    proxy.clear()
    target = {"big1": torch.zeros(3 * MiB // 4)}
    storage.load(target, url, filesystem=fs)
    assert torch.equal(target["big1"], _state()["big1"])
    assert proxy.get_bytes(r"\.distcp") == info.length


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_large_item_is_fetched_by_parallel_ranged_gets_once(
    proxy: FaultProxy, transport: str
) -> None:
    """Before: one streamed GET per run of items, however large the item, so a big
    tensor came down one connection. Now the part past the first window is fetched as
    window-sized GETs in parallel, straight into the tensor, every byte once."""
    url = f"gs://{BUCKET}/{uuid.uuid4().hex}/ckpt"
    fs = _fs(proxy, transport=transport)
    state = {"big": torch.randn(6 * MiB // 4, generator=torch.Generator().manual_seed(5))}
    storage.save(state, url, filesystem=fs)  # one item, so one reader thread reads it
    root = fs.init_path(url)
    data = sum(fs.size(f"{root}/{n}") for n in fs.ls(root) if n.endswith(".distcp"))
    proxy.clear()
    # The GETs after the first window are held until three are in flight, so those
    # sent together overlap whatever the scheduling of this machine (a hold of 0.2 s,
    # then 1 s, was within what a loaded machine can keep a thread from sending).
    proxy.add("delay", method="GET", path=r"\.distcp", gather=3, skip=1, delay=60)
    target = {"big": torch.zeros_like(state["big"])}
    storage.load(target, url, filesystem=fs)
    assert torch.equal(target["big"], state["big"])
    assert proxy.get_bytes(r"\.distcp") == data
    assert proxy.max_concurrent("GET", r"\.distcp") >= 3
    # A piece whose body is cut off is resumed from where it stopped.
    proxy.clear()
    fault = proxy.add("truncate", method="GET", path=r"\.distcp", count=3)
    target = {"big": torch.zeros_like(state["big"])}
    storage.load(target, url, filesystem=fs)
    assert torch.equal(target["big"], state["big"]) and fault.hits == 3


def test_direct_path_only_for_what_it_reproduces(proxy: FaultProxy) -> None:
    """GETs skip aiohttp only where nothing of the client's configuration is lost."""
    plain = GCSFileSystem(storage_options=gcs_options(proxy.url))
    assert gcs_direct.direct_get(plain.fs) is not None
    for extra in (
        {"session_kwargs": {"trust_env": True}},  # proxies from the environment
        {"requests_timeout": 30},  # a limit on each whole request
    ):
        fs = GCSFileSystem(storage_options=gcs_options(proxy.url, **extra))
        assert gcs_direct.direct_get(fs.fs) is None


def test_upload_buffers_are_reused(proxy: FaultProxy) -> None:
    fs = _fs(proxy)
    root = fs.init_path(f"gs://{BUCKET}/{uuid.uuid4().hex}")
    gcs_upload.BUFFERS.clear()
    kept = []
    for name in ("a", "b", "c"):
        with fs.create_stream(f"{root}/{name}", "wb") as stream:
            stream.write(b"x" * (2 * MiB + 5))  # a resumable upload of three chunks
        kept.append(list(gcs_upload.BUFFERS._idle))
    assert len(kept[0]) == 1 and all(k == kept[0] and k[0] is kept[0][0] for k in kept)
    assert fs.read_bytes(f"{root}/c") == b"x" * (2 * MiB + 5)


def test_objects_up_to_the_limit_go_up_in_one_request(proxy: FaultProxy) -> None:
    fs = _fs(proxy, single=4 * MiB)
    root = fs.init_path(f"gs://{BUCKET}/{uuid.uuid4().hex}")
    data = bytes(range(256)) * (3 * MiB // 256) + b"tail"  # 3 MiB and a bit: 4 buffers
    for name in ("one", "two"):
        with fs.create_stream(f"{root}/{name}", "wb") as stream:
            for start in range(0, len(data), 100_000):
                stream.write(data[start : start + 100_000])
    assert fs.read_bytes(f"{root}/one") == fs.read_bytes(f"{root}/two") == data
    uploads = [(m, t) for m, t in proxy.arrivals if "/upload/" in t]
    assert len(uploads) == 2 and all("uploadType=media" in t for _, t in uploads)
    assert gcs_upload.HELD._used == 0  # the held buffers went back


def test_held_budget_bounds_single_requests(
    proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No room to hold buffers: a 3 MiB object goes up as a resumable upload instead.
    monkeypatch.setattr(gcs_upload, "HELD", gcs_upload._Budget(MiB))
    fs = _fs(proxy, single=64 * MiB)
    root = fs.init_path(f"gs://{BUCKET}/{uuid.uuid4().hex}")
    with fs.create_stream(f"{root}/obj", "wb") as stream:
        stream.write(b"y" * (3 * MiB + 1))
    assert fs.read_bytes(f"{root}/obj") == b"y" * (3 * MiB + 1)
    puts = [t for m, t in proxy.arrivals if m == "PUT"]
    assert len(puts) == 4  # three full chunks (the held one among them), then the last byte
    assert gcs_upload.HELD._used == 0
    with pytest.raises(RuntimeError, match="boom"), fs.create_stream(f"{root}/x", "wb") as s:
        s.write(b"z" * (MiB + 1))  # one buffer held
        assert gcs_upload.HELD._used == MiB
        raise RuntimeError("boom")
    assert gcs_upload.HELD._used == 0 and not fs.exists(f"{root}/x")


def test_buffer_pool_keeps_what_fits() -> None:
    pool = BufferPool(20)
    for size in (5, 5, 5, 5, 5):
        pool.give(bytearray(size))
    assert [len(b) for b in pool._idle] == [5, 5, 5, 5]  # the fifth did not fit
    pool.give(bytearray(8))  # other sizes make room
    assert sorted(len(b) for b in pool._idle) == [5, 5, 8]
    eight = pool._idle[-1]
    assert pool.take(8) is eight and len(pool.take(8)) == 8
    pool.clear()
    assert pool._idle == []


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_deadlines_cancel_stalled_uploads_and_reads(proxy: FaultProxy, transport: str) -> None:
    """Before: a chunk upload or ranged GET that got no answer kept its worker thread
    (for the upload, inside torch's archive writer) in the request past the deadline,
    where it woke up when the process exited, and crashed it. Now both requests are
    cancelled and the workers joined before the deadline error is raised."""
    before = set(threading.enumerate())
    fs = _fs(proxy, transport=transport)
    url = f"gs://{BUCKET}/{uuid.uuid4().hex}"
    storage.save(_state(), url + "/good", filesystem=fs)
    proxy.add("delay", method="PUT", path=r"/upload/", delay=600.0)
    proxy.add("delay", method="GET", path=r"\.distcp", delay=600.0)
    with pytest.raises(storage.DeadlineExceededError, match="saving item 'big"):
        storage.save(_state(), url + "/bad", filesystem=fs, timeout=2)
    assert _workers(before) == []
    with pytest.raises(storage.DeadlineExceededError, match="loading item"):
        storage.load(_state(), url + "/good", filesystem=fs, timeout=2)
    assert _workers(before) == []
    proxy.clear()
    assert not [k for k in gcs_list(proxy.url, BUCKET, _prefix(url) + "/bad") if "metadata" in k]


GCS_STALLS = {
    # (what stalls: fault, method, target): before, gcsfs's request ran outside the
    # deadline's reach and its worker thread was left in it.
    "save: is a checkpoint there?": ("delay", "GET", r"/o/[^?]*\.metadata"),
    "save: listing before the commit": ("delay", "GET", r"/o\?.*prefix="),
}


@pytest.mark.parametrize("case", list(GCS_STALLS), ids=list(GCS_STALLS))
def test_deadlines_cancel_stalled_control_requests(proxy: FaultProxy, case: str) -> None:
    """The one-off requests of a save (an existence check, a listing) are interrupted at
    the deadline like its data requests, and no worker thread is left in them."""
    kind, method, target = GCS_STALLS[case]
    before = set(threading.enumerate())
    fs = _fs(proxy)
    url = f"gs://{BUCKET}/{uuid.uuid4().hex}/ckpt"
    proxy.add(kind, method=method, path=target, delay=600.0)
    with pytest.raises(storage.DeadlineExceededError, match="within the 2 s deadline"):
        storage.save(_state(), url, filesystem=fs, timeout=2, overwrite=False)
    assert _workers(before) == []


def _workers(before: set[threading.Thread]) -> list[str]:
    """The deadline's worker threads alive now that were not in ``before``: those of the
    calls since (a thread an earlier test of this process left is not theirs)."""
    names = ("dcp-storage-saving", "dcp-storage-loading")
    return [t.name for t in threading.enumerate() if t.name.startswith(names) and t not in before]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("split", [False, True], ids=["window", "parallel"])
def test_an_object_replaced_while_read_is_never_stitched(
    proxy: FaultProxy, transport: str, split: bool
) -> None:
    """The GETs after the first are pinned to the first one's generation: an object
    replaced between them fails the read, naming it, instead of handing back the old
    version's first window and the new one's rest. Before, the failure was gcsfs's
    bare 404 ("Not Found"), as though the object had never been there."""
    fs = _fs(proxy, transport=transport)
    key = uuid.uuid4().hex
    name = f"{key}/obj"
    old, new = b"o" * (4 * MiB), b"n" * (4 * MiB)
    gcs_put(proxy.url, BUCKET, name, old)
    path = f"{BUCKET}/{name}"
    target = bytearray(4 * MiB)
    view = memoryview(target)
    with fs.open_slice(path, 0, 4 * MiB) as reader:
        got = 0
        while got < MiB:  # the first window, the GET the reader opened
            got += reader.readinto(view[got:MiB])
        gcs_put(proxy.url, BUCKET, name, new)
        rest = view[MiB:] if split else view[MiB : 2 * MiB]  # parallel GETs, or the next window
        with pytest.raises(OSError, match=rf"gs://{path}: the object was replaced or deleted"):
            while rest:
                n = reader.readinto(rest)
                assert n
                rest = rest[n:]
    assert b"n" not in target
    gets = [t for m, t in proxy.arrivals if m == "GET" and key in t]
    assert len(gets) >= 2 and all("generation=" in t for t in gets[1:])
    assert fs.read_bytes(path) == new  # a fresh read gets the new version


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_read_errors_name_the_object_and_hold_no_token(proxy: FaultProxy, transport: str) -> None:
    """A read that fails for good says which object and why, after gcsfs's attempts;
    the access token the client sends with every GET is in none of it. Before, resets
    that outlasted the attempts surfaced as a bare ``ConnectionResetError`` (either
    transport) that named no object."""
    token = "ya29.SECRET-" + uuid.uuid4().hex
    extra: dict = {"token": Credentials(token=token)}
    if transport == "streamed":
        extra["session_kwargs"] = {"trust_env": False}
    fs = GCSFileSystem(storage_options=gcs_options(proxy.url, **extra), part_size=MiB)
    fs.fs.retries = 2
    assert (gcs_direct.direct_get(fs.fs) is not None) == (transport == "direct")
    key = uuid.uuid4().hex
    name = f"{key}/obj"
    gcs_put(proxy.url, BUCKET, name, b"x" * (2 * MiB))
    path = f"{BUCKET}/{name}"
    assert fs.read_bytes(path) == b"x" * (2 * MiB)
    assert {r.authorization for r in proxy.settle() if r.method == "GET"} == {f"Bearer {token}"}
    failures = []
    for kind in ("gcs503", "reset"):
        proxy.clear()
        proxy.add(kind, method="GET", path=key)
        with pytest.raises(OSError) as info:
            fs.read_bytes(path)
        failures.append(info.value)
    proxy.clear()
    with pytest.raises(FileNotFoundError) as missing:
        fs.read_bytes(f"{path}-missing")
    failures.append(missing.value)
    for exc in failures:
        text = "".join(traceback.format_exception(exc))
        assert f"gs://{path}" in str(exc) and token not in text
