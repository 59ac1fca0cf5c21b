"""The persist worker process (``persist="process"``): saves staged in shared memory and
written by a worker, and what happens when that worker dies, fails or is slow."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import threading
import time
import types
import uuid
from pathlib import Path
from typing import IO, Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import extensions
import storage
from extensions import AES256GCM, StreamTransformExtension, ZStandard
from extensions import registry as registry_module
from extensions.errors import CheckpointStorageError, WorkerDiedError
from storage.checkpoint import persist
from storage.checkpoint.persist import _calls
from tests.support.distributed import gloo_group, spawn
from tests.support.gated_fs import HOLD_AT_MOST
from tests.support.servers import create_bucket, moto_endpoint, s3_options
from tests.support.trees import assert_tree_equal, zeros_like_tree

KEY = bytes(range(7, 39))
ROOT = Path(__file__).resolve().parents[2]


# --- transforms that run in the worker ---------------------------------------------------


class _Passthrough:
    def __init__(self, out: IO[bytes]) -> None:
        self._out = out

    def write(self, data: Any) -> int:
        return self._out.write(data)

    def flush(self) -> None:
        self._out.flush()

    def close(self) -> None:
        self._out.flush()


class Gate(StreamTransformExtension):
    """Identity on the bytes; before its first item it marks ``dir/started`` and waits
    until ``dir/open`` exists (at most ``HOLD_AT_MOST`` s), so a test holds the worker mid-save."""

    def __init__(self, gate_dir: str = "") -> None:
        self.gate_dir = gate_dir

    @staticmethod
    def registry_name() -> str:
        return "test.gate"

    @staticmethod
    def from_descriptor(version: str) -> Gate:
        return Gate()

    def get_descriptor(self) -> str:
        return "test.gate/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        if self.gate_dir:
            Path(self.gate_dir, "started").touch()
            deadline = time.monotonic() + HOLD_AT_MOST
            while not Path(self.gate_dir, "open").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return _Passthrough(output)  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return input


class Refuses(StreamTransformExtension):
    """Raises in the worker, as a broken user transform would."""

    @staticmethod
    def registry_name() -> str:
        return "test.refuses"

    @staticmethod
    def from_descriptor(version: str) -> Refuses:
        return Refuses()

    def get_descriptor(self) -> str:
        return "test.refuses/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        raise ValueError("test.refuses: this transform refuses every item")

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return input


class OddError(Exception):
    def __init__(self, a: int, b: int) -> None:  # does not unpickle from its args
        super().__init__(f"odd {a} {b}")


class RaisesOdd(Refuses):
    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        raise OddError(1, 2)


extensions.register(Gate)


class _Unpicklable:
    def __reduce__(self) -> Any:
        raise ValueError("this result refuses to be pickled")


def _returns_unpicklable() -> _Unpicklable:
    return _Unpicklable()


def _refuse_to_load(why: str) -> None:
    raise ValueError(why)


class _Unloadable:
    """Pickles anywhere; unpickling it calls :func:`_refuse_to_load`, which raises."""

    def __reduce__(self) -> Any:
        return (_refuse_to_load, ("this reply refuses to be unpickled",))


def _returns_unloadable() -> _Unloadable:
    return _Unloadable()


def _held(gate_dir: str) -> bool:
    """Run in the worker: mark ``gate_dir/started``, then wait until ``gate_dir/open``
    exists (at most ``HOLD_AT_MOST`` s); whether it did."""
    Path(gate_dir, "started").touch()
    deadline = time.monotonic() + HOLD_AT_MOST
    while not Path(gate_dir, "open").exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def wait_for(path: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


def big_state(seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(256, 256, generator=gen),  # 256 KiB: staged in shared memory
        "b": torch.randn(16, generator=gen),  # small: sent by value
        "meta": {"step": seed, "name": "run"},
    }


def loaded(path: Path, like: dict[str, Any], **options: Any) -> dict[str, Any]:
    out = zeros_like_tree(like)
    assert isinstance(out, dict)
    storage.load(out, path, **options)
    return out


@pytest.fixture(scope="module")
def worker() -> Any:
    handle = persist.worker()  # one for the module: a worker takes seconds to start
    yield handle
    handle.close()


def kill_worker(handle: persist.Worker) -> None:
    pid = handle.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)


# --- saves through the worker -----------------------------------------------------------


_LATE_TRANSFORM = """
from extensions import StreamTransformExtension


class _Flipped:
    def __init__(self, stream):
        self._stream = stream

    def write(self, data):
        return self._stream.write(bytes(b ^ 0xA5 for b in bytes(data)))

    def read(self, size=-1):
        return bytes(b ^ 0xA5 for b in self._stream.read(size))

    def flush(self):
        self._stream.flush()

    def close(self):
        self._stream.close()


class Late(StreamTransformExtension):
    @staticmethod
    def registry_name():
        return "{name}"

    @staticmethod
    def from_descriptor(version):
        return Late()

    def get_descriptor(self):
        return "{name}/1"

    def transform_to(self, output):
        return _Flipped(output)

    def transform_from(self, input):
        return _Flipped(input)
"""


def test_calls_see_a_sys_path_entry_added_after_the_worker_started(
    tmp_path: Path, worker: persist.Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the worker took the training process's ``sys.path`` once, when it
    started, so a transform imported from a directory the script appended later did not
    unpickle there, and its save failed (``persist="process"``) or fell back to threads
    (the default). Each call now carries ``sys.path`` where it changed."""
    assert worker.call(os.getpid).result() != os.getpid()  # started before the change
    module = f"late_transform_{uuid.uuid4().hex[:8]}"
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / f"{module}.py").write_text(_LATE_TRANSFORM.format(name=module))
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path / "mods")])  # appended
    late = importlib.import_module(module).Late
    monkeypatch.setattr(registry_module, "_global", dict(registry_module._global))  # undone
    extensions.register(late)
    state = big_state(11)
    storage.async_save(state, tmp_path / "ckpt", persist="process", transforms=[late()]).result(
        timeout=120
    )
    assert_tree_equal(state, loaded(tmp_path / "ckpt", state))
    raw = b"".join(p.read_bytes() for p in (tmp_path / "ckpt").glob("*.distcp"))
    assert state["w"].numpy().tobytes()[:4096] not in raw  # the transform did run


def test_calls_see_the_environment_as_it_is_now(
    worker: persist.Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the worker kept the environment it started with, so credentials set
    afterwards (AWS_ACCESS_KEY_ID, say) were missing there and an upload failed with
    'Unable to locate credentials' where a thread would have found them."""
    assert worker.call(os.getpid).result() != os.getpid()  # started before the change
    monkeypatch.setenv("DCP_STORAGE_TEST_VALUE", "set after the worker started")
    monkeypatch.delenv("HOME", raising=False)
    assert worker.call(os.getenv, "DCP_STORAGE_TEST_VALUE").result() == (
        "set after the worker started"
    )
    assert worker.call(os.getenv, "HOME").result() is None


def test_async_save_writes_in_the_worker_from_shared_staging(
    tmp_path: Path, state_dict: dict, worker: persist.Worker
) -> None:
    state = dict(state_dict, big=torch.randn(256, 256))  # conftest's mix: small, views, ...
    fut = storage.async_save(state, tmp_path / "a", transforms=[ZStandard()], persist="process")
    fut.result()
    assert worker.pid is not None and worker.pid != os.getpid()
    assert_tree_equal(state, loaded(tmp_path / "a", state))
    assert worker.pool is not None and len(worker.pool.live()) == 1  # "big" went by segment


def test_staging_buffers_are_reused_and_refreshed(tmp_path: Path, worker: persist.Worker) -> None:
    state = big_state()
    storage.async_save(state, tmp_path / "1", persist="process").result()
    assert worker.pool is not None
    segments = worker.pool.live()
    state["w"].add_(1.0)  # trained in place, as parameters are
    storage.async_save(state, tmp_path / "2", persist="process").result()
    assert worker.pool.live() == segments  # the same buffers, no new allocation
    assert_tree_equal(state, loaded(tmp_path / "2", state))


def test_manager_async_save_in_the_worker(tmp_path: Path, worker: persist.Worker) -> None:
    mgr = storage.CheckpointManager(tmp_path, keep_last=1, persist="process")
    state = big_state()
    for step in (1, 2):
        state["w"].mul_(2)
        fut = mgr.save(step, state, blocking=False)
        assert fut is not None
        fut.result()
    assert mgr.steps() == [2]
    out = zeros_like_tree(state)
    assert isinstance(out, dict)
    mgr.load(out)
    assert_tree_equal(state, out)


def test_a_save_while_the_previous_is_in_flight_waits_for_its_buffers(
    tmp_path: Path, worker: persist.Worker
) -> None:
    state = big_state()
    first = dict(state, w=state["w"].clone())
    gate = tmp_path / "gate"
    gate.mkdir()
    fut1 = storage.async_save(
        state, tmp_path / "1", transforms=[Gate(str(gate))], persist="process"
    )
    wait_for(gate / "started")  # the worker reads the staged buffers now
    state["w"].add_(1.0)
    second: list[Any] = []
    saver = threading.Thread(
        target=lambda: second.append(storage.async_save(state, tmp_path / "2", persist="process"))
    )
    saver.start()
    saver.join(0.5)
    assert saver.is_alive()  # staging would overwrite what the first save is writing
    (gate / "open").touch()
    saver.join(60)
    fut1.result()
    second[0].result()
    assert_tree_equal(first, loaded(tmp_path / "1", first))
    assert_tree_equal(state, loaded(tmp_path / "2", state))


def test_a_lease_releases_once(worker: persist.Worker) -> None:
    """A released lease collected later must not free the buffers a later save holds."""
    _, first = worker.stage(big_state())
    first.release()
    _, second = worker.stage(big_state())
    del first  # collected: before the fix its __del__ freed the second save's buffers
    assert not worker._free.is_set()
    second.release()
    assert worker._free.is_set()


class _MeetingEvent(threading.Event):
    """The staging buffers' free event, set; each ``wait`` first meets the other
    thread's, and returns only once both waits saw it set, so two stages that nothing
    else keeps apart both take the buffers. Counts each ``clear`` of a clear event: a
    stage taking buffers another stage holds."""

    def __init__(self) -> None:
        super().__init__()
        self.set()
        # A stage kept apart never meets the other: the first times out, once.
        self._both = threading.Barrier(2, timeout=5)
        self._guard = threading.Lock()
        self.taken_twice = 0

    def _meet(self) -> None:
        try:
            self._both.wait()
        except threading.BrokenBarrierError:
            pass

    def wait(self, timeout: float | None = None) -> bool:
        self._meet()
        got = super().wait(timeout)
        self._meet()
        return got

    def clear(self) -> None:
        with self._guard:
            self.taken_twice += not self.is_set()
            super().clear()


def test_two_threads_staging_at_once_take_the_buffers_in_turn(
    worker: persist.Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two managers saving from two threads at once (a model and its EMA copy, say).
    Before, both stages could see the buffers free before either took them: both
    staged, and the second overwrote buffers the first save's writes were reading."""
    free = _MeetingEvent()
    monkeypatch.setattr(worker, "_free", free)
    state = big_state()
    leases: list[persist.Lease] = []
    errors: list[BaseException] = []

    def stage() -> None:
        try:
            _, lease = worker.stage(state)
            leases.append(lease)
            lease.release()  # the save's writes are done with them
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=stage) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors and len(leases) == 2, errors
    assert free.taken_twice == 0


# --- failures -----------------------------------------------------------------------------


def test_a_worker_killed_mid_save_fails_that_save_and_the_next_starts_a_new_one(
    tmp_path: Path, worker: persist.Worker
) -> None:
    """kill -9 of the worker while it writes: the future raises WorkerDiedError (no
    hang), the committed checkpoint at that path is untouched, the failed save's files
    are gone, and the next save runs in a new worker."""
    path = tmp_path / "ckpt"
    old = big_state(seed=1)
    storage.async_save(old, path, persist="process").result()
    committed = sorted(os.listdir(path))
    gate = tmp_path / "gate"
    gate.mkdir()
    fut = storage.async_save(
        big_state(seed=2), path, transforms=[Gate(str(gate))], persist="process"
    )
    wait_for(gate / "started")
    first_pid = worker.pid
    kill_worker(worker)
    with pytest.raises(WorkerDiedError, match="killed by signal 9"):
        fut.result(timeout=60)
    assert sorted(os.listdir(path)) == committed
    assert_tree_equal(old, loaded(path, old))
    new = big_state(seed=3)
    storage.async_save(new, path, persist="process").result()
    assert worker.pid not in (None, first_pid)
    assert_tree_equal(new, loaded(path, new))


def test_signals_meant_for_the_training_process_leave_the_worker_writing(
    tmp_path: Path, worker: persist.Worker
) -> None:
    """Ctrl-C in a terminal, or a scheduler preempting the job, signals the whole
    process group, the worker too. Before: the worker died of it, and with it the save
    in flight, the very one a training script's handler waits for before it exits."""
    gate = tmp_path / "gate"
    gate.mkdir()
    state = big_state(seed=4)
    fut = storage.async_save(state, tmp_path / "a", transforms=[Gate(str(gate))], persist="process")
    wait_for(gate / "started")
    pid = worker.pid
    assert pid is not None
    os.kill(pid, signal.SIGINT)
    os.kill(pid, signal.SIGTERM)
    (gate / "open").touch()
    fut.result(timeout=60)
    assert worker.pid == pid
    assert_tree_equal(state, loaded(tmp_path / "a", state))


def test_a_signal_handler_saving_inside_a_save_is_refused_not_hung(
    tmp_path: Path, worker: persist.Worker
) -> None:
    """A training script's handler that saves runs in the thread it interrupts. Before:
    interrupting a save that waited for the previous one's buffers (it holds a lock
    while it waits, often for seconds), the handler's save took that lock again and
    waited forever. Now the handler's save fails at once, naming the fix, and the
    interrupted save goes on."""
    gate = tmp_path / "gate"
    gate.mkdir()
    first = storage.async_save(
        big_state(5), tmp_path / "a", transforms=[Gate(str(gate))], persist="process"
    )
    wait_for(gate / "started")
    refused: list[BaseException] = []

    def handler(signum: int, frame: Any) -> None:
        (gate / "open").touch()
        try:
            storage.async_save(big_state(6), tmp_path / "c", persist="process")
        except CheckpointStorageError as exc:
            refused.append(exc)

    main = threading.get_ident()

    def interrupt_once_waiting() -> None:
        deadline = time.monotonic() + 60
        while worker._taking._owner != main and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        sender = threading.Thread(target=interrupt_once_waiting)
        sender.start()
        second = storage.async_save(big_state(7), tmp_path / "b", persist="process")
        sender.join(60)
        first.result(timeout=60)
        second.result(timeout=60)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert len(refused) == 1 and "signal handler" in str(refused[0])
    assert_tree_equal(big_state(7), loaded(tmp_path / "b", big_state(7)))
    assert not (tmp_path / "c" / ".metadata").exists()


_INTERRUPTED_MID_MESSAGE = """
import os, pickle, signal, sys
import torch
import storage
from storage.checkpoint import persist
from storage.checkpoint.persist import _calls

root = sys.argv[1]
where = sys.argv[2]
state = {"w": torch.randn(256, 256), "b": torch.randn(4)}
real_segments, real_send = _calls.send_segments, None

def interrupt() -> None:
    os.kill(os.getpid(), signal.SIGINT)  # its handler runs in the main thread, next step

def segments(sock, fds):
    interrupt()  # between the message naming the segments and the descriptors
    real_segments(sock, fds)

if where == "segments":
    _calls.send_segments = segments
else:  # between a call's header and its body
    handle = persist.worker()
    handle.call(os.getpid).result()
    conn = handle._conn
    cut = []
    def send_bytes(data):
        type(conn).send_bytes(conn, data)
        if not cut and len(data) < 64 and pickle.loads(data)[:1] == ("call",):
            cut.append(data)
            interrupt()
    conn.send_bytes = send_bytes
try:
    storage.async_save(state, root + "/a", persist="process").result(timeout=60)
except KeyboardInterrupt:
    print("interrupted")
else:
    print("not interrupted")
_calls.send_segments = real_segments
if where != "segments":
    del conn.send_bytes
state["w"].add_(1.0)
storage.async_save(state, root + "/b", persist="process").result(timeout=60)
out = {"w": torch.zeros(256, 256), "b": torch.zeros(4)}
storage.load(out, root + "/b")
print("next save", "ok" if torch.equal(out["w"], state["w"]) else "wrong")
"""


@pytest.mark.parametrize("where", ["segments", "call"])
def test_a_handler_raising_mid_message_leaves_the_worker_in_step(
    tmp_path: Path, where: str
) -> None:
    """A signal handler that raises (Ctrl-C's KeyboardInterrupt, a SIGTERM handler's
    SystemExit) in the middle of a message to the worker: the message still goes
    whole, the exception reaches the caller after it, and the next save works. Before:
    cut between the message naming new segments and the byte carrying them, the worker
    read the next message's first byte as that byte, was out of step for good, and
    every later save waited forever."""
    run = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED_MID_MESSAGE, str(tmp_path), where],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split("\n")[:2] == ["interrupted", "next save ok"], run.stderr[-3000:]


def test_a_worker_that_died_idle_fails_the_next_save_once(
    tmp_path: Path, worker: persist.Worker
) -> None:
    state = big_state()
    storage.async_save(state, tmp_path / "1", persist="process").result()
    pid, pool = worker.pid, worker.pool
    assert pid is not None
    kill_worker(worker)
    deadline = time.monotonic() + 120  # bounds a failure only
    while worker.pid == pid:  # the handle notices within a second
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(WorkerDiedError, match=f"pid {pid}"):
        storage.async_save(state, tmp_path / "2", persist="process")
    assert not (tmp_path / "2" / ".metadata").exists()
    storage.async_save(state, tmp_path / "3", persist="process").result()
    assert_tree_equal(state, loaded(tmp_path / "3", state))
    # The same tensors: the new worker never received the old buffers (their
    # descriptors went to the dead one), so they were made anew for it.
    assert worker.pool is not pool


def test_a_stage_of_more_segments_than_one_message_carries_reaches_the_worker(
    tmp_path: Path, worker: persist.Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The segments' descriptors go to the worker in messages of a bounded number
    (the kernel takes at most 253 in one), also while a stage makes them, so that a
    stage of thousands holds few at once: every one must arrive, in step with the
    messages after it."""
    from storage.checkpoint.persist import _pool

    monkeypatch.setattr(_pool, "FDS_PER_MESSAGE", 2)
    gen = torch.Generator().manual_seed(7)
    state = {f"t{i}": torch.randn(128, 128 + i, generator=gen) for i in range(5)}
    storage.async_save(state, tmp_path / "a", persist="process").result()
    assert_tree_equal(state, loaded(tmp_path / "a", state))
    assert worker.pool is not None and len(worker.pool.live()) >= 5
    state["t0"].add_(1.0)
    del state["t4"]  # its buffer is dropped, in the worker too, at the next stage
    storage.async_save(state, tmp_path / "b", persist="process").result()
    assert_tree_equal(state, loaded(tmp_path / "b", state))


def test_a_save_whose_segment_never_reached_the_worker_fails_and_the_next_stages_afresh(
    tmp_path: Path, worker: persist.Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A segment whose descriptor did not reach the worker (its open-file limit) fails
    the save that reads it. Before: the training process kept staging into that
    segment, so every later save failed the same way, though the error said the next
    one stages afresh."""
    from storage.checkpoint.persist import _shm

    monkeypatch.setattr(  # the byte goes, without the descriptors
        _calls,
        "send_segments",
        lambda sock, fds: _shm.send_segments(sock, []),
    )
    state = big_state(3)
    with pytest.raises(CheckpointStorageError, match="never reached this persist worker"):
        storage.async_save(state, tmp_path / "a", persist="process").result()
    monkeypatch.undo()
    state["w"].add_(1.0)
    storage.async_save(state, tmp_path / "b", persist="process").result()
    assert_tree_equal(state, loaded(tmp_path / "b", state))


def test_an_error_in_the_worker_keeps_its_type_and_message_and_no_key(
    tmp_path: Path, worker: persist.Worker
) -> None:
    state = big_state()
    chain = [AES256GCM(key=KEY, key_id="k1"), Refuses()]
    fut = storage.async_save(state, tmp_path / "a", transforms=chain, persist="process")
    with pytest.raises(ValueError, match="refuses every item") as info:
        fut.result()
    told = str(info.value) + str(info.value.__cause__)
    assert "in the persist worker" in str(info.value.__cause__)  # the worker's traceback
    for secret in (KEY.hex(), repr(KEY), KEY.decode("latin-1")):
        assert secret not in told
    assert not (tmp_path / "a").exists() or not os.listdir(tmp_path / "a")
    # An error that cannot cross back arrives named, as our own error.
    fut = storage.async_save(state, tmp_path / "b", transforms=[RaisesOdd()], persist="process")
    with pytest.raises(CheckpointStorageError, match="OddError: odd 1 2"):
        fut.result()
    storage.async_save(state, tmp_path / "c", persist="process").result()  # same worker


def test_a_result_that_does_not_pickle_fails_its_call_not_the_worker(
    worker: persist.Worker,
) -> None:
    """Before: the ValueError of pickling the reply was taken for the training process
    gone (as the socket's own ValueError is): the worker exited, failing every call in
    flight with WorkerDiedError."""
    pid = worker.call(os.getpid).result(timeout=60)
    with pytest.raises(ValueError, match="refuses to be pickled"):
        worker.call(_returns_unpicklable).result(timeout=60)
    assert worker.call(os.getpid).result(timeout=60) == pid


def test_a_reply_that_does_not_unpickle_here_fails_its_call_not_the_worker(
    tmp_path: Path, worker: persist.Worker
) -> None:
    """A result that pickles in the worker but not back here. Before: the reader took
    the worker for unusable and killed it, failing that call and every other in flight
    with WorkerDiedError; now that call alone fails, by name, and the worker serves on."""
    pid = worker.call(os.getpid).result(timeout=60)
    held = worker.call(_held, str(tmp_path))
    wait_for(tmp_path / "started")  # the first call is running in the worker
    with pytest.raises(CheckpointStorageError) as info:
        worker.call(_returns_unloadable).result(timeout=60)
    assert not isinstance(info.value, WorkerDiedError)
    message = str(info.value)
    assert "_returns_unloadable" in message and "could not be read" in message
    assert "this reply refuses to be unpickled" in message
    assert not held.done()
    (tmp_path / "open").touch()
    assert held.result(timeout=60) is True
    assert worker.call(os.getpid).result(timeout=60) == pid


class _Local(Gate):
    pass


def test_what_does_not_pickle_is_refused_by_name_and_written_here_by_default(
    tmp_path: Path, worker: persist.Worker, caplog: pytest.LogCaptureFixture
) -> None:
    """A transform (or filesystem) the worker cannot receive: persist="process" fails
    with the fix; the default writes that save in this process, as before the worker."""
    local = type("Local", (_Local,), {})  # made at run time: no import path for the worker
    fut = storage.async_save(big_state(), tmp_path / "a", transforms=[local()], persist="process")
    with pytest.raises(TypeError, match="persist='thread'"):
        fut.result()
    state = big_state()
    storage.async_save(state, tmp_path / "b", transforms=[local()]).result()
    assert_tree_equal(state, loaded(tmp_path / "b", state))
    assert "runs in the training process instead" in caplog.text


def _default_is_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default mode picks the worker, whatever this host's cores."""
    monkeypatch.setattr(persist, "default_mode", lambda: "process")


def test_a_call_the_worker_cannot_unpickle_fails_by_name_and_is_written_here_by_default(
    tmp_path: Path,
    worker: persist.Worker,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A transform that pickles here but not there (its module exists only in this
    process, as one whose __reduce__ names what the worker cannot import). Before, the
    worker replied for no call and the save waited forever; now that call fails by name
    with the fix, the worker serves the next, and the default writes here instead."""
    _default_is_the_worker(monkeypatch)
    module = types.ModuleType("dcp_storage_test_only_in_the_trainer")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    here = type("Here", (_Local,), {"__module__": module.__name__})
    module.Here = here  # type: ignore[attr-defined]
    fut = storage.async_save(big_state(), tmp_path / "a", transforms=[here()], persist="process")
    with pytest.raises(persist.NotSendable, match="saving .*No module named.*persist='thread'"):
        fut.result(timeout=60)
    pid, state = worker.pid, big_state()
    storage.async_save(state, tmp_path / "b", transforms=[here()]).result(timeout=60)
    assert_tree_equal(state, loaded(tmp_path / "b", state))
    assert "does not unpickle there" in caplog.text
    storage.async_save(state, tmp_path / "c", persist="process").result(timeout=60)
    assert worker.pid == pid  # the same worker, still serving


def test_what_the_training_script_defines_is_refused_before_it_is_sent(
    tmp_path: Path,
    worker: persist.Worker,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A class or function of ``__main__`` pickles here (by reference) and the worker,
    which does not run the training script, cannot find it: refused at once, so the
    default writes here without a round trip to the worker."""
    _default_is_the_worker(monkeypatch)
    script = sys.modules["__main__"]
    local = type("ScriptTransform", (_Local,), {"__module__": "__main__"})
    monkeypatch.setattr(script, "ScriptTransform", local, raising=False)

    def script_function() -> None:
        pass

    script_function.__module__ = "__main__"
    script_function.__qualname__ = "script_function"
    monkeypatch.setattr(script, "script_function", script_function, raising=False)
    for fn, args in ((print, (local(),)), (script_function, ())):
        with pytest.raises(persist.NotSendable, match="__main__.* training script"):
            worker.call(fn, *args)
    state = big_state()
    storage.async_save(state, tmp_path / "a", transforms=[local()]).result(timeout=60)
    assert_tree_equal(state, loaded(tmp_path / "a", state))
    assert "__main__.ScriptTransform is defined in the training script" in caplog.text


def test_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="persist must be one of"):
        storage.CheckpointWriter(tmp_path, persist="fork")
    with pytest.raises(ValueError, match="needs persist='process'"):
        storage.CheckpointWriter(tmp_path, persist="thread", max_bandwidth=1 << 20)
    with pytest.raises(ValueError, match="max_bandwidth must be"):
        storage.CheckpointWriter(tmp_path, persist="process", max_bandwidth=0)
    with pytest.raises(ValueError, match="lives in this process"):
        storage.CheckpointWriter("dcpmem://worker-test/a", persist="process")
    # The default writes in this process where the worker could not reach the storage.
    assert storage.CheckpointWriter("dcpmem://worker-test/a").persist_mode.name == "thread"
    assert storage.CheckpointWriter(tmp_path).persist_mode.name == persist.default_mode()


def test_the_default_mode_leaves_the_cores_to_training_processes_that_fill_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in persist._cores.LOCAL_RANKS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    cpus = persist.usable_cpus()
    # As many training processes on the host as cores (torchrun's LOCAL_WORLD_SIZE):
    # no worker beside each of them, and none started by a manager.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cpus))
    assert persist.default_mode() == "thread"
    assert storage.CheckpointWriter(tmp_path).persist_mode.name == "thread"
    # A cap is the worker's: asked for, it still gets one; so does persist= by name.
    capped = storage.CheckpointWriter(tmp_path, max_bandwidth=1 << 20)
    assert capped.persist_mode.name == "process"
    assert storage.CheckpointWriter(tmp_path, persist="process").persist_mode.name == "process"
    # Other launchers' variables count too; the first one set wins.
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", str(cpus + 1))
    assert persist.local_ranks() == cpus + 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert persist.local_ranks() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert persist.local_ranks() == cpus + 1
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_SIZE")
    assert persist.local_ranks() == 1
    if cpus > 1:  # one process with a core to spare: the worker
        assert persist.default_mode() == "process"


def test_a_cgroup_cpu_quota_lowers_the_usable_cpus(tmp_path: Path) -> None:
    cpus = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    missing = str(tmp_path / "no-membership")  # the top of the mount counts

    def usable() -> int:
        return persist.usable_cpus(str(tmp_path), missing)

    assert persist.usable_cpus(str(tmp_path / "missing"), missing) == cpus
    cpu_max.write_text("max 100000\n")
    assert usable() == cpus
    cpu_max.write_text("150000 100000\n")  # 1.5 CPUs: one whole core
    assert usable() == 1
    cpu_max.write_text("50000 100000\n")  # under one core still runs somewhere
    assert usable() == 1
    cpu_max.write_text(f"{(cpus + 4) * 100000} 100000\n")  # a quota above the affinity
    assert usable() == cpus
    cpu_max.write_text("garbage\n")
    assert usable() == cpus


def _quota_tree(top: Path, directory: str, files: dict[str, str]) -> None:
    where = top / directory
    where.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (where / name).write_text(text)


def test_the_quota_of_a_cgroup_above_this_processs_counts(tmp_path: Path) -> None:
    """Before, only the top of the cgroup mount was read: a job in a nested cgroup
    (a systemd slice, a Kubernetes pod without a cgroup namespace) whose quota is set
    on its cgroup or a parent counted every core of the host."""
    cpus = len(os.sched_getaffinity(0))
    membership = tmp_path / "cgroup"
    membership.write_text("0::/kubepods/pod1/job\n")
    _quota_tree(tmp_path, "kubepods/pod1/job", {"cpu.max": "max 100000\n"})
    _quota_tree(tmp_path, "kubepods/pod1", {"cpu.max": "100000 100000\n"})  # 1 core
    assert persist.usable_cpus(str(tmp_path), str(membership)) == 1
    (tmp_path / "kubepods/pod1/cpu.max").write_text("max 100000\n")
    assert persist.usable_cpus(str(tmp_path), str(membership)) == cpus
    # A cgroup this mount does not show (a container seeing only its own): the top counts.
    membership.write_text("0::/elsewhere/job\n")
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    assert persist.usable_cpus(str(tmp_path), str(membership)) == 1
    # A path that would leave the mount is not followed.
    membership.write_text("0::/../../etc\n")
    assert persist.usable_cpus(str(tmp_path), str(membership)) == 1


def test_a_cgroup_v1_cpu_quota_lowers_the_usable_cpus(tmp_path: Path) -> None:
    """Before, cgroup v1 (older Docker and Kubernetes nodes) was not read at all."""
    cpus = len(os.sched_getaffinity(0))
    membership = tmp_path / "cgroup"
    membership.write_text("7:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
    files = {"cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n"}
    _quota_tree(tmp_path, "cpu,cpuacct/docker/abc", files)
    assert persist.usable_cpus(str(tmp_path), str(membership)) == cpus
    (tmp_path / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us").write_text("50000\n")
    assert persist.usable_cpus(str(tmp_path), str(membership)) == 1
    # Mounted as "cpu" alone.
    (tmp_path / "cpu,cpuacct").rename(tmp_path / "cpu")
    assert persist.usable_cpus(str(tmp_path), str(membership)) == 1


@pytest.mark.parametrize("value", ["\u00b2", "\u0663", "9" * 5000, "-2", "0", "+3", ""])
def test_a_launcher_count_that_is_no_number_is_ignored(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: '\u00b2' (and other digits str.isdigit accepts) passed the check and int()
    raised ValueError, as it did on 5000 digits (int's digit limit): every save, and
    making a manager, failed on a launcher variable the job did not need."""
    for name in persist._cores.LOCAL_RANKS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "3")
    assert persist.local_ranks() == 3  # the next variable counts
    persist.default_mode()


@pytest.mark.parametrize(
    "text", ["\u00b2 100000", "100000 \u00b2", "9" * 5000 + " 100000", "100000 " + "9" * 5000]
)
def test_a_cgroup_cpu_quota_that_is_no_number_is_ignored(tmp_path: Path, text: str) -> None:
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text(text + "\n", encoding="utf-8")
    membership = str(tmp_path / "no-membership")
    assert persist.usable_cpus(str(tmp_path), membership) == len(os.sched_getaffinity(0))
    v1 = tmp_path / "cpu" / "job"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text(text.split()[0] + "\n", encoding="utf-8")
    (v1 / "cpu.cfs_period_us").write_text(text.split()[-1] + "\n", encoding="utf-8")
    (tmp_path / "cgroup").write_text("3:cpu:/job\n")
    assert persist.usable_cpus(str(tmp_path), str(tmp_path / "cgroup")) == len(
        os.sched_getaffinity(0)
    )


def test_max_bandwidth_caps_the_workers_writes(tmp_path: Path, worker: persist.Worker) -> None:
    state = {"w": torch.zeros(1 << 20, dtype=torch.uint8)}  # 1 MiB
    storage.async_save(state, tmp_path / "warm", persist="process").result()  # worker up
    start = time.monotonic()
    fut = storage.async_save(state, tmp_path / "a", persist="process", max_bandwidth=2 << 20)
    fut.result()
    assert time.monotonic() - start >= 0.4  # 1 MiB at 2 MiB/s, less the bucket's 50 ms


# --- two ranks ----------------------------------------------------------------------------


def _two_rank_saver(rank: int, store: str, path: str) -> None:
    with gloo_group(rank, 2, store):
        mesh = init_device_mesh("cpu", (2,))
        full = torch.arange(512 * 256, dtype=torch.float32).reshape(512, 256)
        state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": 3}
        storage.async_save(state, path, persist="process").result()
        assert persist.worker().pid not in (None, os.getpid())
        out = {"w": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]), "step": 0}
        storage.load(out, path)
        assert torch.equal(out["w"].full_tensor(), full) and out["step"] == 3
        # Rank 1's transform fails in its worker: every rank hears it, naming rank 1.
        chain = [Refuses()] if rank == 1 else []
        fut = storage.async_save(state, path + "-bad", transforms=chain, persist="process")
        with pytest.raises(Exception, match="rank 1.*refuses every item"):
            fut.result()
        persist.worker().close()  # gloo_group ends the process with os._exit: no atexit


def test_two_ranks_save_through_their_own_workers(tmp_path: Path) -> None:
    """DTensor shards staged in each rank's shared memory and written by each rank's
    worker, DCP's collectives in the training processes; a worker's error names its rank."""
    spawn(_two_rank_saver, args=(str(tmp_path / "store"), str(tmp_path / "ckpt")), nprocs=2)


# --- tiers: the drain runs in the worker --------------------------------------------------


def test_tiered_drain_runs_in_the_worker_and_survives_its_death(
    tmp_path: Path, worker: persist.Worker
) -> None:
    """The drain copies in the worker (held there mid-file, so it is killed mid-copy
    whatever the machine's load: a drain slowed by a cap could end before the kill);
    the manager's wait() raises WorkerDiedError, the step stays committed locally, and
    the next save's drain (in a new worker) makes both steps durable."""
    from tests.support.gated_fs import GatedFileSystem

    gate = tmp_path / "gate"
    gate.mkdir()
    mgr = storage.CheckpointManager(
        tmp_path / "root",
        local=tmp_path / "local",
        persist="process",
        filesystem=GatedFileSystem(str(gate)),
    )
    state = {"w": torch.arange(1 << 19, dtype=torch.float32)}
    mgr.save(1, state)
    wait_for(gate / "started")  # the worker's drain, mid-copy
    kill_worker(worker)
    with pytest.raises(WorkerDiedError):
        mgr.wait()
    assert mgr.tiers is not None
    assert mgr.tiers.local.steps() == [1] and mgr.durable_steps() == []
    (gate / "open").touch()
    state["w"].add_(1)
    mgr.save(2, state)
    mgr.wait()
    assert mgr.durable_steps() == [1, 2]


def paced_marks(path: str, pace: Any) -> int:
    """Run in the worker: mark ``path`` once past the first ``pace()``."""
    pace()
    Path(path).touch()
    return 1


def test_a_save_in_the_foreground_pauses_paced_work_in_the_worker(
    tmp_path: Path, worker: persist.Worker
) -> None:
    mark = tmp_path / "passed"
    worker.foreground(True)
    try:
        fut = worker.call(paced_marks, str(mark), pace=persist.PAUSE)
        time.sleep(0.5)
        assert not fut.done() and not mark.exists()  # held at its pace
    finally:
        worker.foreground(False)
    assert fut.result(timeout=60) == 1 and mark.exists()


def test_a_tiered_save_holds_the_foreground_until_its_local_commit(
    tmp_path: Path, worker: persist.Worker
) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    mgr = storage.CheckpointManager(
        tmp_path / "root", local=tmp_path / "local", transforms=[Gate(str(gate))]
    )
    mgr.wait()
    fut = mgr.save(1, big_state(), blocking=False)
    assert fut is not None
    wait_for(gate / "started")
    assert worker._foreground == 1  # the drain's copies in the worker wait meanwhile
    (gate / "open").touch()
    fut.result(timeout=60)
    assert worker._foreground == 0
    mgr.wait()
    assert mgr.durable_steps() == [1]


def test_a_drain_whose_worker_is_killed_mid_file_leaves_nothing_in_the_root(
    tmp_path: Path, worker: persist.Worker
) -> None:
    """kill -9 of the worker while it is held in the middle of a data file of the drain:
    the drain removes the partial file its save id names and its heartbeat (before, the
    partial file stayed in the root for good, beside the data file the retried drain
    committed, named by no metadata), and the retry commits a step that loads
    bit-exact."""
    from tests.support.gated_fs import GatedFileSystem

    gate = tmp_path / "gate"
    gate.mkdir()
    root = tmp_path / "root"
    mgr = storage.CheckpointManager(
        root,
        local=tmp_path / "local",
        persist="process",
        filesystem=GatedFileSystem(str(gate)),
    )
    state = big_state(1)
    mgr.save(1, state)
    wait_for(gate / "started")
    assert list(root.glob("step-1/*.distcp"))  # the partial file, mid-copy
    kill_worker(worker)
    with pytest.raises(WorkerDiedError):
        mgr.wait()
    assert sorted(p.name for p in (root / "step-1").iterdir()) == []
    (gate / "open").touch()
    mgr.save(2, big_state(2))
    mgr.wait()
    assert mgr.durable_steps() == [1, 2]
    assert len(list(root.glob("step-1/*"))) == 2  # .metadata and its one data file
    assert_tree_equal(loaded(root / "step-1", state), state)


# --- the worker and its buffers made ahead of the first save ----------------------------


def test_a_manager_starts_the_worker_before_its_first_save(
    tmp_path: Path, worker: persist.Worker
) -> None:
    """Before, the worker started at the first asynchronous save: that save's copy
    shared the cores with a Python process importing torch, and the second save waited
    behind a first persist that included the worker's start-up."""
    worker.close()
    assert worker.pid is None
    storage.CheckpointManager(tmp_path, persist="process")
    assert worker.pid is not None and worker.pid != os.getpid()
    assert worker.pool is not None and worker.pool.live() == {}
    assert worker.call(os.getpid).result() == worker.pid


def _imported(module: str) -> bool:
    return module in sys.modules


def test_a_manager_has_its_worker_import_the_storage_backend_before_its_first_save(
    worker: persist.Worker,
) -> None:
    """Before, the worker imported the S3 stack (s3fs, aiobotocore: ~0.35 s of CPU) when
    the first save's call arrived, on the cores that save's uploads and training share;
    now it does so while the job trains towards its first checkpoint."""
    endpoint = moto_endpoint()
    create_bucket(endpoint, "warm")
    worker.close()
    storage.CheckpointManager(
        "s3://warm/run", storage_options=s3_options(endpoint), persist="process"
    )
    backend = "storage.backends.s3._filesystem"
    deadline = time.monotonic() + 120  # the worker's start-up, on a loaded machine
    while not worker.call(_imported, backend).result():
        assert time.monotonic() < deadline, f"the worker never imported {backend}"
        time.sleep(0.05)


def test_a_thread_mode_manager_starts_no_worker(tmp_path: Path, worker: persist.Worker) -> None:
    worker.close()
    mgr = storage.CheckpointManager(tmp_path, persist="thread")
    mgr.prepare(big_state())
    assert worker.pid is None and worker.pool is None


def test_prepare_stages_nothing_and_the_first_save_copies_into_its_buffers(
    tmp_path: Path, worker: persist.Worker
) -> None:
    """Before, a manager had no way to make the staging buffers ahead: the first save
    made them, and the first touch of fresh memory (~1 ms per MB on some hosts) was
    that save's stall."""
    worker.close()
    mgr = storage.CheckpointManager(tmp_path / "root", persist="process")
    state = big_state()
    mgr.prepare(state)
    assert worker.pool is not None
    segments = worker.pool.live()
    assert len(segments) == 1  # "w"; "b" is small and goes by value
    assert not (tmp_path / "root").exists() or list((tmp_path / "root").iterdir()) == []
    (segment,) = worker.pool._segments.values()
    assert segment.map[:] == bytes(len(segment.map))  # made and touched, nothing copied
    state["w"].add_(1.0)
    fut = mgr.save(1, state, blocking=False)
    assert fut is not None
    fut.result()
    assert worker.pool.live() == segments  # the save copied into the prepared buffer
    out = zeros_like_tree(state)
    assert isinstance(out, dict)
    mgr.load(out)
    assert_tree_equal(state, out)


def test_prepare_with_a_state_that_changes_later_still_saves_it_exactly(
    tmp_path: Path, worker: persist.Worker
) -> None:
    mgr = storage.CheckpointManager(tmp_path, persist="process")
    state = big_state()
    mgr.prepare(state)
    state["w"] = torch.randn(300, 300)  # replaced, another size
    state["extra"] = torch.randn(128, 128)  # added after prepare
    for step in (1, 2):
        state["extra"].add_(step)
        fut = mgr.save(step, state, blocking=False)
        assert fut is not None
        fut.result()
        out = zeros_like_tree(state)
        assert isinstance(out, dict)
        assert mgr.load(out, step) == step
        assert_tree_equal(state, out)


def test_prepare_while_a_save_holds_the_buffers_leaves_that_save_intact(
    tmp_path: Path, worker: persist.Worker
) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    mgr = storage.CheckpointManager(
        tmp_path / "root", persist="process", transforms=[Gate(str(gate))]
    )
    state = big_state()
    fut = mgr.save(1, state, blocking=False)
    assert fut is not None
    wait_for(gate / "started")
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    mgr.prepare(dict(state, w=torch.randn(512, 512), new=torch.randn(256, 256)))
    (gate / "open").touch()
    fut.result()
    assert_tree_equal(expected, loaded(tmp_path / "root" / "step-1", expected))


def _saves_in_time(save: Any) -> None:
    """``save()`` and its future's result, on a thread and bounded: before the fix the
    stage waited for the failed save's lease forever."""
    done: list[Any] = []
    saver = threading.Thread(target=lambda: done.append(save().result()), daemon=True)
    saver.start()
    saver.join(120)
    assert not saver.is_alive(), "the next save waited for the failed save's buffers"
    assert done


def test_a_writer_whose_save_failed_in_planning_can_save_again(
    tmp_path: Path, worker: persist.Worker
) -> None:
    """``dcp.async_save`` with a writer whose save fails before its writes (a file where
    the checkpoint goes, ``overwrite=False`` on a committed one): DCP tells the writer
    nothing, so before, its lease on the staging buffers stayed held and the next
    ``dcp.async_save`` with that writer waited for them forever."""
    (tmp_path / "bad").write_bytes(b"")
    writer = storage.CheckpointWriter(tmp_path / "bad", persist="process")
    state = big_state()
    with pytest.raises(BaseException, match="bad"):
        dcp.async_save(state, storage_writer=writer).result(timeout=120)
    _saves_in_time(
        lambda: dcp.async_save(state, storage_writer=writer, checkpoint_id=tmp_path / "good")
    )
    assert worker._free.is_set()
    assert_tree_equal(state, loaded(tmp_path / "good", state))


def test_a_writer_whose_save_failed_in_planning_does_not_hold_the_buffers(
    tmp_path: Path, worker: persist.Worker
) -> None:
    """The same through another writer, the failed one still referenced (a variable, a
    traceback): before, its lease held the buffers and the next save waited forever."""
    (tmp_path / "bad").write_bytes(b"")
    failed = storage.CheckpointWriter(tmp_path / "bad", persist="process")
    state = big_state()
    with pytest.raises(BaseException, match="bad"):
        dcp.async_save(state, storage_writer=failed).result(timeout=120)
    _saves_in_time(lambda: storage.async_save(state, tmp_path / "good", persist="process"))
    assert_tree_equal(state, loaded(tmp_path / "good", state))
    assert failed._lease is None


# --- no room for the staging buffers -------------------------------------------------


def _no_room_in_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's answer to every reservation of staging memory where the job has no
    more (its memory cgroup's limit, strict overcommit)."""
    import errno

    from storage.checkpoint.persist import _shm

    def full(mapping: object, address: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(_shm, "_populate", full)


def _default_picks_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(persist, "usable_cpus", lambda: 4)
    monkeypatch.setattr(persist, "local_ranks", lambda: 1)
    monkeypatch.setattr(persist, "_shm_full", False)  # restored after the test


def test_a_default_save_with_no_room_in_shm_is_written_here_and_later_ones_in_threads(
    tmp_path: Path,
    worker: persist.Worker,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before, no room for the staging buffers (then a /dev/shm too small: docker's
    default --shm-size) failed every asynchronous save of the default mode, which never
    asked for the worker, and so stopped training. The error names the checkpoint."""
    _default_picks_the_worker(monkeypatch)
    storage.async_save(big_state(0), tmp_path / "warm", persist="process").result()
    assert worker.pool is not None and worker.pool.live()  # buffers in shared memory now
    _no_room_in_shm(monkeypatch)
    state = big_state(1)
    writer = storage.CheckpointWriter(tmp_path / "a")
    assert writer.persist_mode.name == "process"
    dcp.async_save(state, storage_writer=writer).result()
    assert_tree_equal(state, loaded(tmp_path / "a", state))
    assert "stage in this process's memory and write in threads" in caplog.text
    assert f"saving {tmp_path / 'a'}: cannot reserve" in caplog.text  # the checkpoint,
    assert "give the job more memory" in caplog.text  # and the fix, named once
    # The buffers it could not fill are dropped, and their room given back.
    assert worker.pool is None
    # Later saves of the default persist in threads from the start, the writer's too.
    assert persist.default_mode() == "thread"
    caplog.clear()
    state = big_state(2)
    dcp.async_save(state, checkpoint_id=tmp_path / "b", storage_writer=writer).result()
    assert_tree_equal(state, loaded(tmp_path / "b", state))
    storage.async_save(state, tmp_path / "c").result()
    assert_tree_equal(state, loaded(tmp_path / "c", state))
    assert "cannot reserve" not in caplog.text  # warned once
    # persist="process" by name still fails, naming the checkpoint and the fix.
    with pytest.raises(
        CheckpointStorageError, match=r"saving .*d: cannot reserve.*persist='thread'"
    ):
        storage.async_save(state, tmp_path / "d", persist="process").result()


def test_a_managers_prepare_with_no_room_in_shm_leaves_the_default_to_threads(
    tmp_path: Path, worker: persist.Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    _default_picks_the_worker(monkeypatch)
    _no_room_in_shm(monkeypatch)
    state = big_state(3)
    named = storage.CheckpointManager(str(tmp_path / "named"), persist="process")
    with pytest.raises(CheckpointStorageError, match=r"preparing saves to .*named: .*more memory"):
        named.prepare(state)
    mgr = storage.CheckpointManager(str(tmp_path / "default"))
    mgr.prepare(state)  # the default: no error
    assert persist.default_mode() == "thread"
    mgr.save(1, state, blocking=False).result()
    mgr.wait()
    assert_tree_equal(state, loaded(tmp_path / "default" / "step-1", state))


def test_a_script_that_finds_the_package_on_its_own_path_saves_through_the_worker(
    tmp_path: Path,
) -> None:
    """The worker imports this package before it is sent the trainer's sys.path: a
    script that found it through ``sys.path.insert`` (a checkout, not installed) started
    a worker that died at import, and every save of the default mode failed."""
    import sysconfig
    import venv

    env_dir = tmp_path / "env"  # an interpreter with torch but without this package
    venv.create(env_dir, with_pip=False)
    site = next((env_dir / "lib").glob("python*/site-packages"))
    # Added as a path, its own .pth files (this checkout's editable install) are not run.
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    script = tmp_path / "elsewhere" / "train.py"
    script.parent.mkdir()
    script.write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n"
        "import torch, storage\n"
        "state = {'w': torch.arange(65536.0)}\n"
        f"storage.async_save(state, {str(tmp_path / 'ckpt')!r}, persist='process').result()\n"
        "out = {'w': torch.zeros(65536)}\n"
        f"storage.load(out, {str(tmp_path / 'ckpt')!r})\n"
        "assert torch.equal(out['w'], state['w'])\n"
        "print('saved')\n"
    )
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = subprocess.run(
        [str(env_dir / "bin" / "python"), "-c", "import storage"],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        timeout=120,
    )
    assert probe.returncode != 0  # the package is not importable there by itself
    done = subprocess.run(
        [str(env_dir / "bin" / "python"), str(script)],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "saved" in done.stdout, done.stderr[-2000:]
