"""The persist worker process (``main``; started by :mod:`storage.checkpoint.persist`).

It runs the calls the training process sends over the socket ``FD`` (a save's data
writes, a drain's copy), each on a thread of its own, reading staged tensors straight
from the shared-memory segments the training process sent it (:mod:`._mapped`). It
runs niced, with one thread for torch, and every write it makes to storage waits for
the bandwidth cap, when one is set, and for a paced save's schedule (until the training
process says ``hurry``). It exits when the training process closes the socket or dies.

Messages are pickled tuples (see :mod:`storage.checkpoint.persist`):
``("init", sys_path, foreground)``, ``("call", id)`` followed by the call's body
``(fn, args, kwargs, options)`` pickled apart, ``("foreground", busy)``, ``("hurry",)``,
``("segments", names, dropped)`` followed, when ``names`` is not empty, by one byte
carrying the new segments' descriptors (``SCM_RIGHTS``; :mod:`._shm`), and
``("close",)``. Each reply is a header ``("ok", id)``, ``("error", id)`` or
``("unreceived", id)`` followed by its body pickled apart: the call's result, the
error's payload, or why the call's body does not unpickle here (a class the training
script defines, a module this process cannot import). A body the training process
cannot unpickle fails that call there, not the worker.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import os
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import IO, Any, NoReturn

import torch

from extensions.errors import CheckpointStorageError
from storage.backends.base import FileSystemBase
from storage.checkpoint import deadline
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.persist._mapped import forget, keep, rebuild
from storage.checkpoint.persist._shm import more_descriptors, receive_segments

# --- what the training process sends in place of staged data ---------------------------


class Pause:
    """Stands for the worker's pause as a ``pace`` argument: it blocks while the
    training process says a save is in the foreground (a tiered manager's save writing
    its local tier), so that save gets the disk and the cores first."""


class _Resolved:
    """What the writer asks its planner for (``resolve_data``), answered from the
    references the training process sent for a save of checkpoint ``url``."""

    def __init__(self, refs: dict[Any, tuple[Any, ...]], url: str) -> None:
        self._refs = refs
        self._url = url

    def resolve_data(self, item: Any) -> object:
        try:
            return rebuild(self._refs[item.index])
        except CheckpointStorageError as exc:  # a segment no longer as staged
            raise type(exc)(f"saving {self._url}, item {item.index.fqn}: {exc}") from exc


def write_files(
    writer: Any, files: list[Any], threads: int, refs: dict[Any, tuple[Any, ...]]
) -> tuple[list[Any], list[str], float]:
    """A save's data writes, run here: the writer's own code with the staged data;
    returns the results (each its key, size and record), the data files written (names
    in the checkpoint) and the deadline budget spent, for the training process's
    ``SaveAttempt.adopt``."""
    limit_writes(writer.fs)
    per_file = writer.write_files(files, threads, _Resolved(refs, writer.url))
    # Each result as its record (known here without parsing): the training process
    # rebuilds the results from them instead of checking every record it gets back.
    records = [
        [(r.index, r.size_in_bytes, fmt.stored_item(r.storage_data)) for r in results]
        for results in per_file
    ]
    return records, writer.attempt.names, writer.attempt.budget.spent


def warm(fs: FileSystemBase) -> None:
    """Unpickling ``fs`` for this call imported its backend (the S3 stack takes ~0.35 s
    of CPU), before the first save's call needs it; its modules join the ones frozen at
    start (see :func:`main`). Only where no other call is received or running: a
    save's objects frozen mid-flight would never be collected once they are cycles
    (a manager for another storage warms while a save runs)."""
    with _calls_lock:
        if _calls_open == 1:
            gc.freeze()


#: Calls received and not yet answered (serve counts them, _run uncounts them).
_calls_open = 0
_calls_lock = threading.Lock()


def _count_calls(delta: int) -> None:
    global _calls_open
    with _calls_lock:
        _calls_open += delta


# --- worker state ---------------------------------------------------------------------

_foreground = False
_foreground_changed = threading.Condition()


def _set_foreground(busy: bool) -> None:
    global _foreground
    with _foreground_changed:
        _foreground = busy
        _foreground_changed.notify_all()


def _pause() -> None:
    with _foreground_changed:
        _foreground_changed.wait_for(lambda: not _foreground)


class _Bucket:
    """What holds the worker's writes back: ``take(n)`` returns once ``n`` more bytes
    fit under both limits, or at once when neither is set.

    - ``rate``, the ``max_bandwidth`` cap: a token bucket carrying at most ``burst``
      seconds of unused allowance, so a pause never buys a burst above the cap.
    - ``pace``, a manager's paced save (:meth:`set_pace`, lifted by :meth:`hurry`): a
      schedule, the save's bytes spread evenly from the moment the pace was set to its
      deadline. Writes that fell behind it (the link or the cores were busy) go at full
      speed until they are back on it, so the save does not overrun the deadline by
      every slow stretch; and no write waits past the deadline (bytes beyond those the
      rate was made for, a heartbeat, go at once then).

    The pace holds only the writes of the call it was set for (``owner``, the call's
    id; ``take(n, owner)``): a save the worker runs beside a paced one, another
    manager's or a ``storage.async_save`` elsewhere, goes at full speed (under the cap)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate: float | None = None
        self.pace: float | None = None
        self._clock = clock
        self._caps: list[float] = []  # the cap of each call in flight that has one
        self._changed = threading.Condition()
        self._next = 0.0  # when the cap allows the next byte
        self._paced_to = 0.0  # where the pace's schedule stands: when it allows the next byte
        self._pace_end = 0.0  # the paced save's deadline: no write waits past it
        self._pace_owner: object = None  # the call whose writes the pace holds
        self._burst = 0.05

    def set_pace(self, pace: float, until: float, owner: object = None) -> None:
        """Spread the writes of call ``owner`` at ``pace`` bytes/s, on a schedule
        starting now and ending at ``until`` (this host's ``time.monotonic``)."""
        with self._changed:
            self.pace, self._paced_to, self._pace_end = pace, self._clock(), until
            self._pace_owner = owner
            self._changed.notify_all()  # writes held by an earlier pace: not any more

    def _paced(self, owner: object) -> bool:
        return self.pace is not None and self._pace_owner == owner

    def take(self, n: int, owner: object = None) -> None:
        """Wait until ``n`` more bytes written by call ``owner`` fit under the limits."""
        if self.rate is None and self.pace is None:
            # Nothing limits writes (read without the lock: a limit set meanwhile holds
            # from the next write on): a save of many small items makes ~3 writes each.
            return
        with self._changed:
            if n <= 0 or (self.rate is None and not self._paced(owner)):
                return
            now = self._clock()
            capped = None
            if self.rate is not None:
                self._next = max(self._next, now - self._burst) + n / self.rate
                capped = self._next
            paced = None
            if self.pace is not None and self._pace_owner == owner:
                self._paced_to += n / self.pace
                paced = min(self._paced_to, self._pace_end)
            while True:
                # Re-read each time: a hurry lifts the pace, a call's end lifts its cap.
                if not self._paced(owner):
                    paced = None
                if self.rate is None:
                    capped = None
                until = max((t for t in (capped, paced) if t is not None), default=None)
                if until is None or (left := until - self._clock()) <= 0:
                    return
                self._changed.wait(min(left, 60.0))  # in steps: a wait has a longest timeout

    @contextlib.contextmanager
    def capped(self, cap: float | None) -> Iterator[None]:
        """Hold ``cap`` (bytes/s; ``None``: none) while one call runs: the rate is the
        lowest cap of the calls in flight, so a call with no cap, or a higher one, never
        lifts the cap of another that is still writing."""
        if cap is None:
            yield
            return
        with self._changed:
            self._caps.append(cap)
            self.rate = min(self._caps)
        try:
            yield
        finally:
            with self._changed:
                self._caps.remove(cap)
                self.rate = min(self._caps) if self._caps else None
                self._changed.notify_all()

    def hurry(self, owner: object = None) -> None:
        """Lift the pace: the training process waits for this save now. With ``owner``
        (a paced call that ended), only if the pace is that call's."""
        with self._changed:
            if owner is None or self._pace_owner == owner:
                self.pace = None
            self._changed.notify_all()


_bucket = _Bucket()


class _Throttled:
    """A write stream of call ``owner`` whose writes wait for the bucket."""

    def __init__(self, stream: IO[bytes], owner: object) -> None:
        self._stream = stream
        self._owner = owner

    def write(self, data: Any) -> int:
        view = memoryview(data)
        _bucket.take(view.nbytes, self._owner)
        return self._stream.write(view)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


#: The call the current thread runs (:meth:`_Server._run`): whose pace its writes take.
_call = threading.local()


def limit_writes(fs: object) -> None:
    """Make every write stream of this process's copy of ``fs`` (``create_stream`` and
    ``create_stream_in``, each kept as the backend writes it) take from the bucket,
    as writes of the call this thread runs (the streams may be written by its threads)."""
    if not isinstance(fs, FileSystemBase) or "create_stream" in vars(fs):
        return
    create = fs.create_stream
    owner = getattr(_call, "owner", None)

    @contextlib.contextmanager
    def create_stream(path: str, mode: str, *, sync: bool = False) -> Iterator[IO[bytes]]:
        with create(path, mode, sync=sync) as stream:
            yield stream if "w" not in mode else _Throttled(stream, owner)  # type: ignore[misc]

    create_in = fs.create_stream_in

    @contextlib.contextmanager
    def create_stream_in(
        directory: str, name: str, mode: str = "wb", *, sync: bool = False
    ) -> Iterator[IO[bytes]]:
        with create_in(directory, name, mode, sync=sync) as stream:
            paced = "w" not in mode or isinstance(stream, _Throttled)  # by create_stream
            yield stream if paced else _Throttled(stream, owner)  # type: ignore[misc]

    fs.create_stream = create_stream  # type: ignore[method-assign]
    fs.create_stream_in = create_stream_in  # type: ignore[method-assign]


# --- serving ----------------------------------------------------------------------------


class _Server:
    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._send_lock = threading.Lock()
        self._calls = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="dcp-persist")

    def send(self, kind: str, call_id: int, value: object) -> None:
        """Send a reply, its header and its body (one whose body does not pickle goes as
        that error); exits when the training process is gone."""
        try:
            body = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # pickling, not the socket: this call fails, not the worker
            kind, body = "error", pickle.dumps(_error_payload(exc))
        header = pickle.dumps((kind, call_id))
        try:
            with self._send_lock:
                self._conn.send_bytes(header)
                self._conn.send_bytes(body)
        except (OSError, ValueError):
            _trainer_gone()

    def serve(self) -> None:
        while True:
            try:
                message = pickle.loads(self._conn.recv_bytes())
                body = self._conn.recv_bytes() if message[0] == "call" else b""
            except (EOFError, OSError):
                _trainer_gone()
            if message[0] == "close":
                return
            if message[0] == "foreground":
                _set_foreground(message[1])
                continue
            if message[0] == "hurry":
                _bucket.hurry()
                continue
            if message[0] == "segments":
                _, names, dropped = message
                try:
                    keep(receive_segments(self._conn.fileno(), names) if names else {})
                except OSError:
                    _trainer_gone()
                forget(dropped)
                continue
            call_id = message[1]
            _count_calls(1)  # before its objects exist: a freeze meanwhile would take them
            try:
                fn, args, kwargs, options = pickle.loads(body)
            except BaseException as exc:  # noqa: BLE001 - fails this call, not the worker
                _count_calls(-1)
                self.send("unreceived", call_id, f"{type(exc).__name__}: {exc}")
                continue
            if options.get("pace") is not None:
                # Set here, in the order of the messages: a hurry read next lifts it even
                # when it comes before the call's thread starts.
                rate, until = options["pace"]
                _bucket.set_pace(rate, until, owner=call_id)
            self._calls.submit(self._run, call_id, fn, args, kwargs, options)

    def _run(
        self, call_id: int, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], options: Any
    ) -> None:
        pace = options.get("pace")
        _call.owner = call_id
        try:
            _set_environ(options.get("environ"))
            rank = options.get("rank")
            deadline.distributed_rank = lambda: rank  # errors name the trainer's rank
            for value in (*args, *kwargs.values()):
                limit_writes(value)
            kwargs = {k: _pause if isinstance(v, Pause) else v for k, v in kwargs.items()}
            with _bucket.capped(options.get("max_bandwidth")):
                kind, result = "ok", fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the training process
            kind, result = "error", _error_payload(exc)
        finally:
            _call.owner = None
        if pace is not None:
            _bucket.hurry(call_id)  # the paced save is done (a later one keeps its pace)
        self.send(kind, call_id, result)
        _count_calls(-1)


def _trainer_gone() -> NoReturn:
    """The training process is gone (the socket closes when the last process holding it
    does), and so is every save it asked for: exit. The staging segments go with the
    last mapping of each (the kernel frees them)."""
    os._exit(0)


_environ_lock = threading.Lock()


def _set_environ(environ: dict[str, str] | None) -> None:
    """Make this process's environment the training process's at the time of the call."""
    if environ is None:
        return
    with _environ_lock:
        for name in [n for n in os.environ if n not in environ]:
            del os.environ[name]
        for name, value in environ.items():
            if os.environ.get(name) != value:
                os.environ[name] = value


def _error_payload(exc: BaseException) -> tuple[bytes | None, str, str, str]:
    """The exception pickled when it survives the trip, with its type, message and
    traceback as text for when it does not."""
    text = "".join(traceback.format_exception(exc))
    raw: bytes | None
    try:
        raw = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(raw)
    except Exception:
        raw = None
    return raw, f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), text


def main(fd: int) -> None:
    conn = Connection(fd)
    tag, sys_path, foreground = pickle.loads(conn.recv_bytes())
    assert tag == "init"
    _set_foreground(foreground)
    sys.path[:] = sys_path  # the training process's imports (user transforms) resolve here
    torch.set_num_threads(1)
    if sys.version_info < (3, 13):  # a descriptor per mapped segment: as many as it is sent
        more_descriptors()
    # What was imported lives as long as the worker: frozen, the cyclic collector's full
    # passes (several per save of thousands of items) no longer walk its ~10^5 objects.
    gc.freeze()
    _Server(conn).serve()
