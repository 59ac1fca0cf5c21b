"""Persistence out of the training process: a worker process per training process.

``persist="process"`` (a :class:`~storage.checkpoint.writer.CheckpointWriter` option, so
also one of ``storage.async_save`` and ``CheckpointManager``) moves an asynchronous
save's encoding, checksums and uploads, and a tiered manager's drain, into a worker
process. The training thread only copies the state into staging buffers in shared memory
(:mod:`._pool`), reused from one save to the next; DCP's background thread still plans
the save and runs its collectives, hands the items (segment names and offsets, no bytes)
to the worker and waits on the socket, holding no GIL. The worker (:mod:`._child`) runs
niced, imports nothing of the training script, and puts every write to storage through
one token bucket when ``max_bandwidth`` (bytes/s) is set. :class:`Worker` (:mod:`._worker`)
is the training process's handle on it; this module picks where work runs and sends it.

Failure semantics: a worker that dies fails every call in flight with
:class:`~extensions.errors.WorkerDiedError` (or, when none was in flight, the next
:meth:`Worker.stage` or :meth:`Worker.call` raises it once); the call after that starts
a new worker. Nothing waits on a dead worker: its socket closes when it dies, and its
pid is checked every second besides; one stopped or stuck past a save's ``timeout``
is killed (:mod:`._stuck`). An exception raised in the worker reaches the
caller with its own type and message (its traceback as ``__cause__``); one that cannot
be pickled arrives as a :class:`~extensions.errors.CheckpointStorageError` naming it.
Keys travel only inside the pickled transforms over the private socket, never in a
segment, a log line or an error message.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from extensions._compat import StateDictStager
from extensions.errors import WorkerDiedError
from storage.backends.base import FileSystemBase
from storage.checkpoint import data_files, heartbeat, savable
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.encode import plain_cpu_tensor
from storage.checkpoint.persist import _stuck
from storage.checkpoint.persist._child import Pause, warm
from storage.checkpoint.persist._cores import copy_threads, local_ranks, usable_cpus
from storage.checkpoint.persist._lease import Lease
from storage.checkpoint.persist._mapped import SegmentLost
from storage.checkpoint.persist._messages import NotSendable
from storage.checkpoint.persist._pool import StagingPool
from storage.checkpoint.persist._shm import SharedMemoryFull
from storage.checkpoint.persist._shm import available as _segments_available
from storage.checkpoint.persist._worker import Worker
from storage.checkpoint.tensors import copy_of_memory, has_plain_memory, tensor_bytes

if TYPE_CHECKING:
    from storage.checkpoint.options import WriterSettings  # which imports this module

log = logging.getLogger(__name__)

T = TypeVar("T")

MODES = ("thread", "process")
#: Stands for "pause while a save's writes run in the worker" as a ``pace`` argument.
PAUSE = Pause()


@dataclasses.dataclass(frozen=True)
class Mode:
    """Where background work runs: ``name`` ``"thread"`` or ``"process"``, the worker's
    write cap, and whether the mode was asked for by name. The default gives way to
    threads for work the worker cannot take (storage of this process, an object that
    does not pickle here or unpickle there), logging why once; a mode asked for by name
    fails instead."""

    name: str
    max_bandwidth: int | None = None
    explicit: bool = False


def check_mode(persist: object, max_bandwidth: object) -> Mode:
    """The mode ``persist`` and ``max_bandwidth`` ask for, validated. ``persist=None``
    is the default: see :func:`default_mode` (the worker whenever ``max_bandwidth`` is
    set, as only the worker caps its writes)."""
    explicit = persist is not None
    if persist is None:
        persist = "process" if max_bandwidth is not None and available() else default_mode()
    if persist not in MODES:
        raise ValueError(f"persist must be one of {MODES} or None, got {persist!r}")
    if persist == "process" and not available():
        raise ValueError(
            "persist='process' needs memfd_create and file seals (Linux) and torch >= 2.8; "
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


def available() -> bool:
    """Whether a persist worker can run here: staging segments can be made and handed
    to it (``memfd_create`` and file seals: Linux; :mod:`._shm`), and torch >= 2.8."""
    return _segments_available() and StateDictStager is not None


def default_mode() -> str:
    """Where background work runs when ``persist`` is not given: the persist worker where
    it can run and the host has a core beyond one per training process on it, else
    threads.

    Measured (benchmarks/NOTES.md, "The persist worker in the loop"): with a core to
    spare, the worker takes the encoding and uploads off the training process's GIL and
    cores. Where the training processes fill every core, a worker per process costs
    each its start-up (a Python process importing torch: seconds of CPU) and, niced,
    gets too little CPU to finish an upload before the next save, so threads do better
    there. Training processes on this host are counted from the launcher's environment
    and cores from this process's CPU affinity and its cgroups' CPU quotas
    (:mod:`._cores`)."""
    if not available() or _shm_full:
        return "thread"
    return "process" if usable_cpus() > local_ranks() else "thread"


#: Set once there was no room for the default's staging buffers: the default persists
#: in threads from then on (a job short of memory, or of descriptors, must not fail
#: saves that never asked for the worker).
_shm_full = False


def shm_room() -> bool:
    """Whether the default's staging buffers may go to shared memory (see :func:`shm_full`)."""
    return not _shm_full


def shm_full(exc: SharedMemoryFull) -> None:
    """Record that there was no room for a default-mode save's staging buffers
    (``exc``): this save and every later one that did not name a mode persist in
    threads, in this process's memory; warns once."""
    global _shm_full
    if not _shm_full:
        _shm_full = True
        log.warning(
            "%s; saves that do not name persist= stage in this process's memory and "
            "write in threads from now on (without the max_bandwidth cap, which only "
            "the worker applies)",
            exc,
        )


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
    """Whether another process reaches what ``fs`` stores."""
    return not fs.in_process


_worker: Worker | None = None
_worker_lock = threading.Lock()


def worker() -> Worker:
    """This process's persist worker handle (the worker itself starts on first use)."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = Worker(copy_threads=copy_threads())
        return _worker


def _forget_worker_in_child() -> None:
    """A child made with ``fork`` starts with no worker: the parent's socket, reader
    thread and staging buffers are the parent's (its own first save starts its own).
    Its copy of the parent's socket is closed, or the parent's worker outlived the
    parent for as long as the child lived."""
    global _worker, _worker_lock
    if _worker is not None:
        _worker.drop_in_child()
    _worker, _worker_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_worker_in_child)


def start(settings: WriterSettings, filesystem: FileSystemBase) -> Worker | None:
    """Start the persist worker and its staging pool now, when saves with writer
    ``settings`` (a manager's) to ``filesystem`` would stage in it; returns it (else
    ``None``). A manager calls this when it is made and in ``prepare``, so its first
    asynchronous save neither starts a Python process beside the copy nor waits behind
    a save that did; a storage a save would refuse is left for that save to report.
    The worker imports what saves to ``filesystem`` run on meanwhile (:func:`._child.warm`),
    so the first save's uploads do not share the cores with those imports."""
    try:
        mode = settings.persist_mode(filesystem)
    except ValueError:
        return None
    if mode.name != "process":
        return None
    w = worker()
    w.start()
    w.warm(warm, filesystem)
    return w


def run(
    mode: Mode,
    fn: Callable[..., T],
    *args: Any,
    pace_bytes: int | None = None,
    pace_for: str | None = None,
    kill_after: float | None = None,
    **kwargs: Any,
) -> T:
    """``fn(*args, **kwargs)``: in the worker when ``mode`` says so (writes capped, a
    ``pace`` argument replaced by the worker's pause), else here; raises what it raised.
    In the worker, ``pace_bytes`` (the bytes it writes) are spread to the deadline
    :func:`pace_next` set for ``pace_for``, if one is pending, and a worker that has not
    answered in ``kill_after`` seconds is killed (:meth:`Worker.call`). With the default
    mode, work the worker cannot receive runs here."""
    if mode.name == "process":
        there = dict(kwargs, pace=PAUSE) if "pace" in kwargs else kwargs
        try:
            future = worker().call(
                fn,
                *args,
                max_bandwidth=mode.max_bandwidth,
                pace_bytes=pace_bytes,
                pace_for=pace_for,
                kill_after=kill_after,
                **there,
            )
            return future.result()
        except NotSendable as exc:  # not pickled here, or not unpickled there: it never ran
            if mode.explicit:
                raise
            _fall_back(exc)
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
    if isinstance(data, torch.Tensor):
        plain = data.detach()
        where = None if pool is None else pool.locate(plain)
        if where is not None:
            return ("shm", where[0], where[1], data.dtype, tuple(data.shape))
        if has_plain_memory(plain):  # one copy, in one call
            return ("value", copy_of_memory(plain), plain.dtype, tuple(plain.shape))
    tensor = plain_cpu_tensor(data)
    raw = bytes(tensor_bytes(tensor))
    return ("value", raw, tensor.dtype, tuple(tensor.shape))


def _as_sent(files: list[tuple[str, list[WriteItem]]]) -> list[tuple[str, list[WriteItem]]]:
    """``files`` as the worker needs them: each item's key and type. Its tensor's
    layout (chunk, properties, size) stays here: the worker writes the staged data as
    it finds it, and pickling those took most of a call's body (0.3 s of the training
    process's CPU for 20,000 items, every save)."""
    return [(name, [_key_and_type(i) for i in items]) for name, items in files]


def _key_and_type(item: WriteItem) -> WriteItem:
    return WriteItem(index=item.index, type=item.type, bytes_io_data=item.bytes_io_data)


def _ref_bytes(ref: tuple[Any, ...]) -> int:
    """The bytes an :func:`item_ref` stands for."""
    if ref[0] == "shm":
        return math.prod(ref[4]) * ref[3].itemsize  # type: ignore[no-any-return]
    return len(ref[1])


def pace_next(deadline: float | None, for_url: str | None = None) -> None:
    """Pace the next save's writes (of checkpoint ``for_url``, when given) to end by
    ``deadline`` (see :meth:`Worker.pace_next`)."""
    worker().pace_next(deadline, for_url)


def hurry() -> None:
    """Lift the pace of this process's paced save, if any (starts no worker)."""
    w = _worker
    if w is not None:
        w.hurry()


# At interpreter exit, before the executors' threads are joined (a save in flight is
# finished then, not dropped): a paced upload goes at full speed, not to its deadline.
_at_thread_exit = getattr(threading, "_register_atexit", None)
if _at_thread_exit is not None:
    _at_thread_exit(hurry)


def write_staged(
    writer: Any, files: list[Any], threads: int, planner: Any, lease: Lease
) -> list[Any]:
    """Run ``writer``'s data writes in the worker (the staged state is in its buffers;
    with the default mode, here when the writer does not pickle); releases ``lease``
    once the writes are done with them.

    Every file the worker may write (and its heartbeat) is recorded in the writer's
    ``SaveAttempt`` before the call goes out, and what the worker reports back is
    adopted, so a worker that dies mid-save leaves nothing the writer's abort does not
    remove (it also sweeps what carries the save id: ``SaveAttempt.lost``)."""
    w = worker()
    pool = w.pool
    mode: Mode = writer.persist_mode
    try:
        refs = {
            item.index: item_ref(pool, item, savable.resolve(planner, item, writer.url))
            for _, items in files
            for item in items
        }
        attempt = writer.attempt
        beat = heartbeat.name_of(data_files.heartbeat_token(attempt.save_id, writer.rank))
        for name in [name for name, _ in files] + [beat]:
            attempt.record(name)
        try:
            records, written, spent = _write_in(w, writer, files, threads, refs)
        except NotSendable as exc:  # not pickled here, or not unpickled there: none written
            if mode.explicit:
                raise NotSendable(f"saving {writer.url}: {exc}") from None
            _fall_back(exc)
            return list(writer.write_files(files, threads, planner))
        except WorkerDiedError:
            attempt.lost()  # the writer's abort removes what it left
            raise
        except SegmentLost:
            if pool is not None:
                w.restage(pool)  # the worker lacks some of its segments: the next save
            raise  # stages in new ones, sent afresh
    finally:
        lease.release()
    attempt.adopt(written, spent)
    return [
        [
            WriteResult(index=index, size_in_bytes=size, storage_data=fmt.new_storage_info(record))
            for index, size, record in rs
        ]
        for rs in records
    ]


def _write_in(
    w: Worker, writer: Any, files: list[Any], threads: int, refs: dict[Any, tuple[Any, ...]]
) -> tuple[list[Any], list[str], float]:
    """:func:`._child.write_files` in the worker ``w``, which is killed when it has not
    answered :data:`._stuck.STUCK_GRACE` seconds past the save's deadline (the error
    is then a :class:`._stuck.WorkerStuckError`)."""
    from storage.checkpoint.persist._child import write_files

    left = writer.budget.left()
    try:
        return w.call(  # type: ignore[no-any-return]
            write_files,
            writer,
            _as_sent(files),
            threads,
            refs,
            max_bandwidth=writer.persist_mode.max_bandwidth,
            pace_bytes=sum(_ref_bytes(ref) for ref in refs.values()),
            pace_for=writer.url,
            kill_after=_stuck.kill_after(left),
        ).result()
    except _stuck.Unanswered as exc:
        raise _stuck.stuck(writer.url, writer.budget.timeout, files) from exc
