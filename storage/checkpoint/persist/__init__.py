"""Persistence out of the training process: a worker process per training process.

``persist="process"`` (a :class:`~storage.checkpoint.writer.CheckpointWriter` option, so
also one of ``storage.async_save`` and ``CheckpointManager``) moves an asynchronous
save's encoding, checksums and uploads, and a tiered manager's drain, into a worker
process. The training thread only copies the state into staging buffers in shared memory
(:mod:`._shm`), reused from one save to the next; DCP's background thread still plans
the save and runs its collectives, hands the items (segment names and offsets, no bytes)
to the worker and waits on the socket, holding no GIL. The worker (:mod:`._child`) runs
niced, imports nothing of the training script, and puts every write to storage through
one token bucket when ``max_bandwidth`` (bytes/s) is set.

Failure semantics: a worker that dies fails every call in flight with
:class:`~extensions.errors.WorkerDiedError` (or, when none was in flight, the next
:meth:`Worker.stage` or :meth:`Worker.call` raises it once); the call after that starts
a new worker. Nothing waits on a dead worker: its socket closes when it dies, and its
pid is checked every second besides. An exception raised in the worker reaches the
caller with its own type and message (its traceback as ``__cause__``); one that cannot
be pickled arrives as a :class:`~extensions.errors.CheckpointStorageError` naming it.
Keys travel only inside the pickled transforms over the private socket, never in a
segment, a log line or an error message.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from extensions._compat import StateDictStager
from extensions.errors import CheckpointStorageError, WorkerDiedError
from storage.backends.base import FileSystemBase
from storage.checkpoint.encode import plain_cpu_tensor
from storage.checkpoint.persist._child import Pause
from storage.checkpoint.persist._shm import StagingPool

log = logging.getLogger(__name__)

T = TypeVar("T")

MODES = ("thread", "process")
#: Chosen by measurement (docs/benchmarks.md, "In the training loop").
DEFAULT_MODE = "process"
#: The worker's nice increment: persistence yields the cores to training.
NICE = 10
#: Stands for "pause while a save's writes run in the worker" as a ``pace`` argument.
PAUSE = Pause()


@dataclasses.dataclass(frozen=True)
class Mode:
    """Where background work runs: ``name`` ``"thread"`` or ``"process"``, the worker's
    write cap, and whether the mode was asked for by name. The default gives way to
    threads for work the worker cannot take (storage of this process, an object that
    does not pickle), logging why once; a mode asked for by name fails instead."""

    name: str
    max_bandwidth: int | None = None
    explicit: bool = False


def check_mode(persist: object, max_bandwidth: object) -> Mode:
    """The mode ``persist`` and ``max_bandwidth`` ask for, validated. ``persist=None``
    is the default, which is threads where a worker cannot run (no
    ``os.posix_fallocate``, torch before 2.8)."""
    explicit = persist is not None
    available = hasattr(os, "posix_fallocate") and StateDictStager is not None
    if persist is None:
        persist = DEFAULT_MODE if available else "thread"
    if persist not in MODES:
        raise ValueError(f"persist must be one of {MODES} or None, got {persist!r}")
    if persist == "process" and not available:
        raise ValueError(
            "persist='process' needs os.posix_fallocate (Linux) and torch >= 2.8; "
            "use persist='thread'"
        )
    if max_bandwidth is not None:
        if (
            isinstance(max_bandwidth, bool)
            or not isinstance(max_bandwidth, int)
            or max_bandwidth <= 0
        ):
            raise ValueError(f"max_bandwidth must be bytes/s > 0 or None, got {max_bandwidth!r}")
        if persist != "process":
            raise ValueError("max_bandwidth caps the persist worker: it needs persist='process'")
    return Mode(str(persist), max_bandwidth, explicit)


def for_filesystems(mode: Mode, *filesystems: FileSystemBase) -> Mode:
    """``mode`` for work on ``filesystems``: threads when one of them lives in this
    process (refused if ``"process"`` was asked for by name)."""
    if mode.name != "process" or all(reachable(fs) for fs in filesystems):
        return mode
    if mode.explicit:
        where = ", ".join(fs.url("") for fs in filesystems if not reachable(fs))
        raise ValueError(
            f"persist='process' cannot write to {where}: that storage lives in this "
            "process; use persist='thread'"
        )
    return Mode("thread")


def reachable(fs: FileSystemBase) -> bool:
    """Whether another process reaches what ``fs`` stores (in-memory stores are this
    process's own)."""
    return not fs.url("").startswith(("dcpmem://", "memory://"))


class NotSendable(TypeError):
    """A call's function or arguments do not pickle, so the worker cannot run it."""


class Lease:
    """The staging buffers, held by one save until the worker has read them (or the
    save is given up: an unreleased lease is released when it is collected)."""

    def __init__(self, free: threading.Event) -> None:
        self._free: threading.Event | None = free

    def release(self) -> None:
        free, self._free = self._free, None  # once: the next save may hold the event
        if free is not None:
            free.set()

    __del__ = release


class Worker:
    """The training process's handle on its persist worker (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._pending: dict[int, concurrent.futures.Future[Any]] = {}
        self._ids = itertools.count()
        self._unreported: WorkerDiedError | None = None
        self._foreground = 0  # saves in the foreground: the worker's pace pauses
        self._free = threading.Event()
        self._free.set()
        self.pool: StagingPool | None = None

    # --- the process ------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return None if proc is None else proc.pid

    def _start(self) -> Connection:
        """The socket to a live worker, started if there is none (call with the lock)."""
        if self._unreported is not None:
            error, self._unreported = self._unreported, None
            raise error
        if self._conn is not None:
            return self._conn
        ours, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _LAUNCH.format(nice=NICE, fd=theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()  # the worker's end lives only in the worker: its death is EOF here
        conn = Connection(ours.detach())
        conn.send_bytes(pickle.dumps(("init", list(sys.path), self._foreground > 0)))
        self._proc, self._conn = proc, conn
        threading.Thread(
            target=self._read, args=(proc, conn), name="dcp-persist-reader", daemon=True
        ).start()
        return conn

    def _read(self, proc: subprocess.Popen[bytes], conn: Connection) -> None:
        """Hand each reply to its future until the worker is gone, then fail the rest."""
        try:
            while True:
                if not wait([conn], timeout=1.0):
                    if proc.poll() is None:
                        continue
                    if not conn.poll():
                        break
                message = pickle.loads(conn.recv_bytes())
                kind, call_id, value = message
                with self._lock:
                    future = self._pending.pop(call_id, None)
                if future is None:
                    continue
                if kind == "ok":
                    future.set_result(value)
                else:
                    future.set_exception(_remote_error(value))
        except (EOFError, OSError):
            pass
        except BaseException as exc:  # a reply we cannot read: the worker is unusable
            log.error("persist worker %d: unreadable reply (%s); stopping it", proc.pid, exc)
        with self._lock:
            closed = self._proc is not proc  # close() let it go: no death to report
        if closed:
            conn.close()
            return
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
        error = WorkerDiedError(
            f"the checkpoint persist worker (pid {proc.pid}) died "
            f"({_exit_text(code)}); the saves it was writing are not committed and "
            "committed checkpoints are untouched. The next save starts a new worker"
        )
        with self._lock:
            self._proc, self._conn = None, None
            pending, self._pending = self._pending, {}
            if not pending:
                self._unreported = error
        conn.close()
        if code != 0:
            log.error("%s", error)
        for future in pending.values():
            future.set_exception(error)

    def close(self) -> None:
        """Stop the worker (after the calls in flight) and remove the staging buffers."""
        with self._lock:
            proc, conn = self._proc, self._conn
            self._proc, self._conn, self._unreported = None, None, None
        if conn is not None:
            try:
                with self._send_lock:
                    conn.send_bytes(pickle.dumps(("close",)))
            except OSError:
                pass
        if proc is not None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    # --- calls ------------------------------------------------------------------------

    def call(
        self,
        fn: Callable[..., T],
        *args: Any,
        max_bandwidth: int | None = None,
        **kwargs: Any,
    ) -> concurrent.futures.Future[T]:
        """Run ``fn(*args, **kwargs)`` in the worker (``fn`` and the arguments must
        pickle; ``pace=PAUSE`` stands for the worker's pause); its future holds the
        result or the worker's exception."""
        options = {
            "max_bandwidth": max_bandwidth,
            "live": self.pool.live() if self.pool is not None else [],
            "rank": dist.get_rank() if dist.is_available() and dist.is_initialized() else None,
            # As a thread would, the call sees the environment as it is now (credentials
            # the clients read from it may have been set after the worker started).
            "environ": dict(os.environ),
        }
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            conn = self._start()
            call_id = next(self._ids)
            message = ("call", call_id, fn, args, kwargs, options)
            try:
                data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                raise NotSendable(
                    f"cannot send {getattr(fn, '__qualname__', fn)} to the persist worker: "
                    f"{type(exc).__name__}: {exc}. Transforms and filesystems must pickle "
                    "(defined at module level, importable); or save with persist='thread'"
                ) from None
            self._pending[call_id] = future
        try:
            with self._send_lock:
                conn.send_bytes(data)
        except OSError:
            pass  # the reader sees the worker gone and fails the future
        return future

    def foreground(self, busy: bool) -> None:
        """Count a save in (``True``) or out of the foreground: while one is, calls
        that pace themselves with :data:`PAUSE` wait (a tiered manager's drain while
        its save writes the local tier). Starts no worker."""
        with self._lock:
            self._foreground += 1 if busy else -1
            conn = self._conn
            message = pickle.dumps(("foreground", self._foreground > 0))
        if conn is not None:
            try:
                with self._send_lock:
                    conn.send_bytes(message)
            except OSError:
                pass  # a dead worker: the reader reports it

    def stage(self, state_dict: Any) -> tuple[Any, Lease]:
        """Copy ``state_dict`` into the staging buffers, once the previous save that
        holds them is done reading; returns the staged copy and its lease."""
        with self._lock:
            self._start()  # a dead worker is reported here, before anything is staged
        while not self._free.wait(60):
            log.warning("a checkpoint save waits for the previous one to release its buffers")
        self._free.clear()
        try:
            if self.pool is None:
                self.pool = StagingPool()
            staged = self.pool.stage(state_dict)
        except BaseException:
            self._free.set()
            raise
        return staged, Lease(self._free)


# Niced before anything is imported: its start-up (torch) yields the cores too.
_LAUNCH = (
    "import os; os.nice({nice}); from storage.checkpoint.persist._child import main; main({fd})"
)


def _exit_text(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def _remote_error(payload: tuple[bytes | None, str, str, str]) -> BaseException:
    raw, type_name, message, text = payload
    error: BaseException | None = None
    if raw is not None:
        try:
            error = pickle.loads(raw)
        except Exception:
            error = None
    if not isinstance(error, BaseException):
        error = CheckpointStorageError(
            f"{type_name}: {message} (raised in the checkpoint persist worker; the error "
            "itself could not be sent back)"
        )
    error.__cause__ = _RemoteTraceback(text)
    return error


class _RemoteTraceback(Exception):
    def __init__(self, text: str) -> None:
        super().__init__(text)

    def __str__(self) -> str:
        return "\n(in the persist worker)\n" + str(self.args[0])


_worker: Worker | None = None
_worker_lock = threading.Lock()


def worker() -> Worker:
    """This process's persist worker handle (the worker itself starts on first use)."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = Worker()
        return _worker


def mode_for(options: dict[str, Any], *filesystems: FileSystemBase) -> Mode:
    """The mode writer ``options`` (a manager's) ask for, for work on ``filesystems``."""
    mode = check_mode(options.get("persist"), options.get("max_bandwidth"))
    return for_filesystems(mode, *filesystems)


def run(mode: Mode, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``: in the worker when ``mode`` says so (writes capped, a
    ``pace`` argument replaced by the worker's pause), else here; raises what it raised."""
    if mode.name == "process":
        there = dict(kwargs, pace=PAUSE) if "pace" in kwargs else kwargs
        try:
            future = worker().call(fn, *args, max_bandwidth=mode.max_bandwidth, **there)
        except NotSendable as exc:
            if mode.explicit:
                raise
            _fall_back(exc)
        else:
            return future.result()
    return fn(*args, **kwargs)


def _fall_back(exc: NotSendable) -> None:
    if str(exc) not in _fell_back:  # once per cause: a save every few steps would flood
        _fell_back.add(str(exc))
        log.warning("%s; this work runs in the training process instead", exc)


_fell_back: set[str] = set()


# --- a save's data writes ---------------------------------------------------------------


def item_ref(pool: StagingPool | None, item: WriteItem, data: object) -> tuple[Any, ...]:
    """How the worker finds ``item``'s data: a staged tensor's segment and offset, or
    the bytes themselves (non-tensor values, small tensors)."""
    if item.type == WriteItemType.BYTE_IO:
        return ("bytes", data.getvalue())  # type: ignore[attr-defined]
    if isinstance(data, torch.Tensor) and pool is not None:
        where = pool.locate(data.detach())
        if where is not None:
            return ("shm", where[0], where[1], data.dtype, tuple(data.shape))
    tensor = plain_cpu_tensor(data)
    raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    return ("value", raw, tensor.dtype, tuple(tensor.shape))


def write_staged(
    writer: Any, files: list[Any], threads: int, planner: Any, lease: Lease
) -> list[Any]:
    """Run ``writer``'s data writes in the worker (the staged state is in its buffers;
    with the default mode, here when the writer does not pickle); releases ``lease``
    once the worker is done with them."""
    from storage.checkpoint.persist._child import write_files

    w = worker()
    mode: Mode = writer.persist_mode
    try:
        refs = {
            item.index: item_ref(w.pool, item, planner.resolve_data(item))
            for _, items in files
            for item in items
        }
        try:
            future = w.call(
                write_files, writer, files, threads, refs, max_bandwidth=mode.max_bandwidth
            )
        except NotSendable as exc:
            if mode.explicit:
                raise
            _fall_back(exc)
            return list(writer.write_files(files, threads, planner))
        try:
            per_file, written, writer.budget.spent = future.result()
        except WorkerDiedError:
            # Its files may be half written: the writer's abort removes what exists.
            writer._written = [writer.fs.concat_path(writer.path, name) for name, _ in files]
            raise
    finally:
        lease.release()
    writer._written = written
    return per_file
