"""Eight gloo ranks on CPU: save, load, resharded load and read-once load on local disk
and on S3 (moto), and saves and loads in which one rank fails or stalls; past a
deadline, no worker thread is left in the stalled request and the process exits
normally.

Each 8-rank test is one ``mp.spawn`` of 8 small processes (KBs to MBs of state), marked
``ranks8``; the single-process tests check the pieces. Bytes and requests
are counted per rank by our own backend (tests/support/scale_fs.py) on local disk and by the
proxy in front of moto on S3."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import storage
from storage.checkpoint import read_once as sharing
from storage.checkpoint.deadline import CheckpointRankError, DeadlineExceededError
from tests.support.distributed import gloo_group, process, spawn
from tests.support.scale_fs import ProbeFileSystem, load_counts
from tests.support.servers import (
    FaultProxy,
    boto3_client,
    create_bucket,
    list_keys,
    moto_endpoint,
    s3_options,
)

WORLD = 8
BUCKET = "dcp-scale"
ranks8 = pytest.mark.ranks8


def _full() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Replicated tensors (4 x 64 KiB) and one tensor to shard (24 KiB)."""
    gen = torch.Generator().manual_seed(0)
    replicated = {f"rep{i}": torch.randn(64, 256, generator=gen) for i in range(4)}
    return replicated, torch.randn(64, 96, generator=gen)


def _location(path: str, endpoint: str | None) -> dict[str, Any]:
    if endpoint is None:
        return {"filesystem": ProbeFileSystem()}
    return {"storage_options": s3_options(endpoint)}


def _round_trip_worker(rank: int, store: str, path: str, out: str, endpoint: str | None) -> None:
    with gloo_group(rank, WORLD, store):
        mesh = init_device_mesh("cpu", (WORLD,))
        replicated, full = _full()
        where = _location(path, endpoint)
        fs = where.get("filesystem")
        state = {**replicated, "sharded": distribute_tensor(full, mesh, [Shard(0)]), "step": 7}
        # On S3, data files go under 4 key prefixes (rank % 4).
        prefixes = 0 if endpoint is None else 4
        storage.save(state, path, overwrite=False, key_prefixes=prefixes, **where)
        if fs is not None:
            fs.dump(os.path.join(out, f"save-{rank}.json"))
        for read_once in (False, True):
            if fs is not None:
                fs.reset()
            target = {k: torch.zeros_like(v) for k, v in replicated.items()}
            storage.load(target, path, read_once=read_once, **where)
            assert all(torch.equal(target[k], v) for k, v in replicated.items())
            if fs is not None:
                fs.dump(os.path.join(out, f"load-{read_once}-{rank}.json"))
            if endpoint is not None:  # the parent reads the proxy's count between loads
                torch.distributed.barrier()
                if rank == 0:
                    Path(out, f"loaded-{read_once}").touch()
                    _wait_for(Path(out, f"counted-{read_once}"))
                torch.distributed.barrier()
        # Resharded: saved in row blocks, loaded in column blocks; every rank needs
        # every stored block.
        resharded: dict[str, Any] = {
            "sharded": distribute_tensor(torch.zeros_like(full), mesh, [Shard(1)]),
            "step": 0,
        }
        storage.load(resharded, path, read_once=True, **where)
        assert isinstance(resharded["sharded"], DTensor)
        assert torch.equal(resharded["sharded"].full_tensor(), full)
        assert resharded["step"] == 7


def _wait_for(path: Path, procs: list[Any] | None = None) -> None:
    while not path.exists():
        if procs is not None and any(p.exitcode not in (None, 0) for p in procs):
            raise AssertionError("a rank failed; see its output above")
        time.sleep(0.1)


def _needed_bytes(path: str, **where: Any) -> int:
    """Stored bytes of the replicated items (what each load's plans need)."""
    reader = storage.CheckpointReader(path, **where)
    md = reader.read_metadata()
    return sum(i.length for idx, i in md.storage_data.items() if idx.fqn.startswith("rep"))


@ranks8
def test_local_save_load_resharded_read_once(tmp_path: Path) -> None:
    path, out = str(tmp_path / "ckpt"), str(tmp_path)
    spawn(
        _round_trip_worker,
        args=(str(tmp_path / "store"), path, out, None),
        nprocs=WORLD,
        join=True,
    )
    needed = _needed_bytes(path)
    stock = sum(c["data_bytes"] for c in load_counts(out, "load-False", WORLD))
    once = load_counts(out, "load-True", WORLD)
    assert stock / needed >= WORLD - 0.01  # every rank reads every replicated byte
    assert sum(c["data_bytes"] for c in once) / needed <= 1.05
    # The fetches are spread: no rank reads more than twice its fair share.
    assert max(c["data_bytes"] for c in once) <= 2 * needed / WORLD
    # One metadata read per load (the coordinator's), not one per rank.
    assert [c["requests"].get("read_bytes", 0) for c in once] == [1] + [0] * (WORLD - 1)
    # One overwrite check per save (the coordinator's), not one per rank.
    saves = load_counts(out, "save", WORLD)
    assert [c["requests"].get("exists", 0) for c in saves[1:]] == [0] * (WORLD - 1)
    assert saves[0]["requests"].get("exists", 0) >= 1


@pytest.fixture(scope="module")
def proxy() -> Any:
    endpoint = moto_endpoint()
    create_bucket(endpoint, BUCKET)
    with FaultProxy(endpoint) as p:
        yield p


@ranks8
def test_s3_save_load_resharded_read_once(tmp_path: Path, proxy: FaultProxy) -> None:
    url = f"s3://{BUCKET}/{uuid.uuid4().hex}/ckpt"
    out = str(tmp_path)
    procs = [
        process(_round_trip_worker, (r, str(tmp_path / "store"), url, out, proxy.url))
        for r in range(WORLD)
    ]
    # Saving fetches no data file: the proxy's count is the first load's.
    proxy.clear()
    for p in procs:
        p.start()
    per_load: dict[bool, int] = {}
    for read_once in (False, True):
        _wait_for(Path(out, f"loaded-{read_once}"), procs)
        per_load[read_once] = proxy.get_bytes(r"\.distcp")
        proxy.clear()
        Path(out, f"counted-{read_once}").touch()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    needed = _needed_bytes(url, storage_options=s3_options(proxy.url))
    assert per_load[True] / needed <= 1.05
    assert per_load[False] / needed >= WORLD - 0.01
    # Eight ranks' files under four prefixes, two each; stock DCP reads them.
    keys = list_keys(boto3_client(proxy.url), BUCKET, url.removeprefix(f"s3://{BUCKET}/"))
    data = [k.rsplit("/", 2)[-2] for k in keys if k.endswith(".distcp")]
    assert sorted(set(data)) == ["00", "01", "02", "03"], keys
    replicated, _ = _full()
    stock = {k: torch.zeros_like(v) for k, v in replicated.items()}
    reader = FsspecReader(url, **s3_options(proxy.url))
    dcp.load(stock, storage_reader=reader, no_dist=True)
    assert all(torch.equal(stock[k], v) for k, v in replicated.items())


def _small() -> dict[str, torch.Tensor]:
    """16 replicated items: DCP's dedup gives every one of 8 ranks two to write."""
    gen = torch.Generator().manual_seed(1)
    return {f"t{i:02d}": torch.randn(32, 64, generator=gen) for i in range(16)}


def _failure_worker(rank: int, store: str, path: str, mode: str) -> None:
    with gloo_group(rank, WORLD, store):
        state = _small()
        good = os.path.join(path, "good")
        storage.save(state, good, filesystem=ProbeFileSystem())
        if mode == "fail":
            saving, loading = ProbeFileSystem(fail=(3, "write")), ProbeFileSystem(fail=(5, "read"))
            options: dict[str, Any] = {}
            expected: type[Exception] = CheckpointRankError
        else:
            saving, loading = (
                ProbeFileSystem(stall=(3, "write")),
                ProbeFileSystem(stall=(5, "read")),
            )
            options, expected = {"timeout": 3.0}, DeadlineExceededError
        try:
            with pytest.raises(expected) as info:
                storage.save(state, os.path.join(path, "bad"), filesystem=saving, **options)
            message = str(info.value)
            assert "rank 3: saving item 't" in message, message
            assert f"{path}/bad/__3_" in message and ".distcp" in message, message
            if mode == "stall":
                assert "within the 3 s deadline" in message, message
            target = {k: torch.zeros_like(v) for k, v in state.items()}
            # A failing rank without read-once, a stalled one with it: every rank hears.
            with pytest.raises(expected) as info:
                storage.load(target, good, filesystem=loading, read_once=mode == "stall", **options)
            message = str(info.value)
            assert "rank 5: loading item 't" in message, message
            assert f"{good}/__" in message and ".distcp" in message, message
            if mode == "fail":
                # The coordinator finds the metadata missing; every rank hears why.
                missing = ProbeFileSystem()
                with pytest.raises(storage.CheckpointNotFoundError, match="not a committed"):
                    storage.load(target, path, filesystem=missing)
                # One read and one listing, the coordinator's, for all ranks.
                asked = (missing.requests["read_bytes"], missing.requests["ls"])
                assert asked == ((1, 1) if rank == 0 else (0, 0)), asked
        finally:
            saving.release.set()
            loading.release.set()


@ranks8
@pytest.mark.parametrize("mode", ["fail", "stall"])
def test_failing_or_stalled_rank_fails_every_rank_naming_it(tmp_path: Path, mode: str) -> None:
    spawn(
        _failure_worker,
        args=(str(tmp_path / "store"), str(tmp_path), mode),
        nprocs=WORLD,
        join=True,
    )
    assert not os.path.exists(tmp_path / "bad" / ".metadata")


# --- single process -------------------------------------------------------------------


def test_assign_gives_each_shared_item_one_owner_balanced_by_bytes() -> None:
    stored = {
        MetadataIndex(f"t{i}", torch.Size([0])): SimpleNamespace(length=100) for i in range(16)
    }
    chunks = {idx: (torch.Size([25]), torch.float32) for idx in stored}

    def req(idx: MetadataIndex) -> ReadItem:
        return ReadItem(LoadItemType.TENSOR, idx, idx.offset, idx, idx.offset, torch.Size([25]))

    shared = [req(idx) for idx in stored]
    solo = MetadataIndex("solo", torch.Size([0]))
    stored[solo] = SimpleNamespace(length=300)
    chunks[solo] = (torch.Size([75]), torch.float32)
    plans = [LoadPlan(list(shared) + ([req(solo)] if r == 0 else [])) for r in range(WORLD)]
    out = sharing.assign(plans, stored, chunks)
    owners = Counter(
        s.owner for p in out for s in p.storage_data.shares if s.owner == p.storage_data.rank
    )
    # Rank 0 reads "solo" (300 bytes) itself, so it owns fewer of the shared items.
    assert owners[0] == 0 and all(owners[r] in (2, 3) for r in range(1, WORLD))
    assert sum(owners.values()) == 16
    assert all(len(p.storage_data.shares) == 16 for p in out)
    assert sharing.assign([LoadPlan([req(solo)])], stored, chunks)[0].storage_data is None


def test_stalled_save_and_load_time_out_naming_the_item(tmp_path: Path) -> None:
    fs = ProbeFileSystem(stall=(0, "write"))
    try:
        with pytest.raises(DeadlineExceededError, match="this process: saving item 't0") as info:
            storage.save(_small(), str(tmp_path / "a"), filesystem=fs, timeout=1)
        assert "within the 1 s deadline" in str(info.value) and ".distcp" in str(info.value)
        assert "timed out" in str(info.value)  # what torchft and users match a timeout by
        assert not (tmp_path / "a" / ".metadata").exists()
        storage.save(_small(), str(tmp_path / "b"))
        fs.stall = (0, "read")
        with pytest.raises(DeadlineExceededError, match="this process: loading item 't"):
            storage.load(_small(), str(tmp_path / "b"), filesystem=fs, timeout=1)
    finally:
        fs.release.set()
    with pytest.raises(TypeError, match="timeout"):
        storage.CheckpointReader(str(tmp_path), timeout=0)


def _s3_stall_worker(rank: int, store: str, url: str, endpoint: str) -> None:
    with gloo_group(rank, WORLD, store, exit_process=False):
        with pytest.raises(DeadlineExceededError) as info:
            storage.save(_small(), url, storage_options=s3_options(endpoint), timeout=5.0)
        message = str(info.value)
        assert "rank 3: saving item 't" in message, message
        assert f"{url}/__3_0-" in message and "within the 5 s deadline" in message, message
    # Each rank then exits through the interpreter's own shutdown, which rank 3 used to
    # die in (SIGSEGV), its upload thread left in the stalled request.


@ranks8
def test_s3_stalled_upload_fails_every_rank_naming_it(tmp_path: Path, proxy: FaultProxy) -> None:
    url = f"s3://{BUCKET}/{uuid.uuid4().hex}/ckpt"
    proxy.clear()
    # Rank 3's data upload gets no answer for a minute: an upload that never completes.
    proxy.add("delay", path=r"/__3_0-[0-9a-z]+\.distcp", delay=60.0)
    try:
        spawn(
            _s3_stall_worker,
            args=(str(tmp_path / "store"), url, proxy.url),
            nprocs=WORLD,
            join=True,
        )
    finally:
        proxy.clear()


# --- a deadline, then the process exits ---------------------------------------------


def _workers_left(before: set[threading.Thread] | None = None) -> list[str]:
    """run_tasks's worker threads still alive in this process, other than those in
    ``before`` (a thread an earlier test of this process left is not the call's)."""
    known = before or set()
    return [t.name for t in threading.enumerate() if t.name.startswith(_WORKERS) and t not in known]


_WORKERS = ("dcp-storage-saving", "dcp-storage-loading")


@pytest.mark.parametrize("interruptible", [True, False])
def test_deadline_cancels_the_stalled_request_and_joins_its_thread(
    tmp_path: Path, interruptible: bool
) -> None:
    """Before: past the deadline the worker thread was left in the stalled request,
    here inside torch's C++ archive writer (a 4 MiB tensor is written straight to the
    data stream). Now the request is cancelled, or, where the backend cannot interrupt
    it (a request that ends after 2 s), the next write is refused; the thread is
    joined before the error is raised."""
    state = {"w": torch.randn(1 << 20)}
    storage.save(state, str(tmp_path / "good"))
    before = set(threading.enumerate())
    for kind in ("write", "read"):
        fs = ProbeFileSystem(
            stall=(0, kind),
            interruptible=interruptible,
            stall_seconds=None if interruptible else 2.0,
        )
        try:
            with pytest.raises(DeadlineExceededError):
                if kind == "write":
                    storage.save(state, str(tmp_path / "bad"), filesystem=fs, timeout=1)
                else:
                    storage.load(state, str(tmp_path / "good"), filesystem=fs, timeout=1)
            assert _workers_left(before) == []
        finally:
            fs.release.set()
    assert not (tmp_path / "bad" / ".metadata").exists()


# A process whose save stalls past its deadline, in a request that ends 2 s later
# (while the interpreter shuts down) and that the backend cannot interrupt.
_EXIT_AFTER_DEADLINE = """
import sys
import torch
import storage
from tests.support.scale_fs import ProbeFileSystem

fs = ProbeFileSystem(stall=(0, "write"), interruptible=False, stall_seconds=2.0)
try:
    storage.save({"w": torch.randn(1 << 20)}, sys.argv[1], filesystem=fs, timeout=1)
except storage.DeadlineExceededError:
    print("deadline", flush=True)
"""


def _run_script(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    root = str(Path(__file__).resolve().parents[2])
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        env={**os.environ, "PYTHONPATH": root},
    )


def test_process_exits_cleanly_after_a_deadline(tmp_path: Path) -> None:
    """Before: the worker thread, parked in the stalled write inside torch's C++
    archive writer, woke up while the interpreter shut down: SIGABRT ('terminate
    called without an active exception') or SIGSEGV."""
    done = _run_script(_EXIT_AFTER_DEADLINE, str(tmp_path / "ck"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "terminate called" not in done.stderr
    assert done.stdout.strip() == "deadline", done.stdout


def _exit_worker(rank: int, store: str, path: str) -> None:
    fs = ProbeFileSystem(stall=(3, "write"))
    state = {f"t{i:02d}": torch.full((1 << 18,), float(i)) for i in range(16)}  # 1 MiB each
    with gloo_group(rank, WORLD, store, exit_process=False):
        with pytest.raises(DeadlineExceededError, match="rank 3: saving item"):
            storage.save(state, path, filesystem=fs, timeout=3.0)
        assert _workers_left() == []
    fs.release.set()
    # Returning runs the interpreter's own exit (mp.spawn reports a rank killed by a signal).


@ranks8
def test_every_rank_exits_cleanly_after_a_stalled_upload(tmp_path: Path) -> None:
    """Before: rank 3's upload thread stayed in the stalled write, inside torch's
    archive writer, when its process exited."""
    spawn(
        _exit_worker, args=(str(tmp_path / "store"), str(tmp_path / "ck")), nprocs=WORLD, join=True
    )


_S3_EXIT_AFTER_DEADLINE = """
import sys
import threading
import torch
import storage
from storage.backends.s3 import S3FileSystem
from tests.support.servers import s3_options

url, endpoint, direct = sys.argv[1], sys.argv[2], sys.argv[3] == "direct"
# One upload slot: the stalled first part keeps the writer waiting for a slot inside
# torch's archive writer.
fs = S3FileSystem(storage_options=s3_options(endpoint), max_concurrency=1, direct=direct)
state = {"w": torch.zeros(6 << 20)}  # 24 MiB: 3 parts
for kind in ("read", "write"):
    try:
        if kind == "read":
            storage.load(state, url + "/good", filesystem=fs, timeout=2)
        else:
            storage.save(state, url + "/bad", filesystem=fs, timeout=2)
    except storage.DeadlineExceededError:
        workers = ("dcp-storage-saving", "dcp-storage-loading")
        left = [t.name for t in threading.enumerate() if t.name.startswith(workers)]
        print(kind, "deadline", left, flush=True)
"""


@pytest.mark.parametrize("path", ["direct", "s3fs"])
def test_s3_deadlines_cancel_their_requests(proxy: FaultProxy, path: str) -> None:
    """Before: the part upload and the ranged GET stalled by the proxy stayed in flight
    on pool threads that the interpreter waits for at exit (here for ten minutes), and
    the writer's thread, parked inside torch's archive writer for an upload slot,
    woke up during the shutdown (SIGABRT in about one run of three). Now the deadline
    cancels both requests (connections shut down, coroutines cancelled) and the
    process exits at once."""
    url = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    storage.save({"w": torch.randn(6 << 20)}, url + "/good", storage_options=s3_options(proxy.url))
    proxy.clear()
    proxy.add("delay", method="GET", path=r"\.distcp", delay=600.0)
    proxy.add("delay", method="PUT", path=r"partNumber=1(&|$)", delay=600.0)
    try:
        done = _run_script(_S3_EXIT_AFTER_DEADLINE, url, proxy.url, path)
    finally:
        proxy.clear()
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.split("\n")[:2]
    assert lines == ["read deadline []", "write deadline []"], done.stdout


def test_cancel_reaches_children_hooks_waits_and_coroutines() -> None:
    """storage.backends.cancel: one cancel stops a task's streams (children), calls
    their hooks, ends slot waits, backoffs and coroutines on an event loop, and every
    later request raises at once."""
    import asyncio

    from storage.backends.cancel import Cancel, StreamCancelled

    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    task = Cancel()
    stream = Cancel(task)
    hooked: list[str] = []
    outcomes: list[str] = []

    def blocked(name: str, wait: Any) -> threading.Thread:
        def body() -> None:
            try:
                wait()
            except StreamCancelled:
                outcomes.append(name)

        thread = threading.Thread(target=body)
        thread.start()
        return thread

    slots = threading.Semaphore(0)
    waiting = [
        blocked("slot", lambda: stream.acquire(slots)),
        blocked("backoff", lambda: stream.wait(600)),
        blocked("coroutine", lambda: stream.run(loop, asyncio.sleep, 600)),
    ]
    with stream.hook(lambda: hooked.append("hook")):
        time.sleep(0.2)  # let them block
        task.cancel()
        for thread in waiting:
            thread.join(60)
    assert sorted(outcomes) == ["backoff", "coroutine", "slot"] and hooked == ["hook"]
    with pytest.raises(StreamCancelled):
        Cancel(task).check()  # a stream opened after the cancel
    loop.call_soon_threadsafe(loop.stop)
    runner.join(10)


def test_a_request_from_the_loops_own_thread_is_refused() -> None:
    """Before: a data stream flushed by the garbage collector on the client's event-loop
    thread (fsspec's one loop, shared by s3fs and gcsfs) waited there for a coroutine
    that loop could never run: every later S3 and GCS request of the process hung (a
    full test run stopped in test_bytes_fetched). Now the request is refused at once."""
    import asyncio

    from storage.backends.cancel import Cancel

    loop = asyncio.new_event_loop()
    outcome: list[BaseException | None] = []

    def from_a_callback() -> None:
        try:
            Cancel().run(loop, asyncio.sleep, 0)
            outcome.append(None)
        except RuntimeError as exc:
            outcome.append(exc)
        loop.stop()

    loop.call_soon(from_a_callback)
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    runner.join(10)
    assert not runner.is_alive(), "the loop hung waiting for itself"
    assert isinstance(outcome[0], RuntimeError) and "own thread" in str(outcome[0])
    loop.close()
