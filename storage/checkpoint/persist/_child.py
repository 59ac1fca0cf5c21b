"""The persist worker process (``main``; started by :mod:`storage.checkpoint.persist`).

It runs the calls the training process sends over the socket ``FD`` (a save's data
writes, a drain's copy), each on a thread of its own, reading staged tensors straight
from the shared-memory segments the training process sent it (:mod:`._mapped`). It
runs niced, with one thread for torch, and every write it makes to storage waits for
the bandwidth cap, when one is set, and for a paced save's schedule (until the training
process says ``hurry``; :mod:`._throttle`). It exits when the training process closes
the socket or dies (seen through a ``pidfd`` too: the socket may live on in a child
that process forked).

Messages are pickled tuples (see :mod:`storage.checkpoint.persist`):
``("init", sys_path, foreground)``, ``("call", id, sys_path)`` followed by the call's
body ``(fn, args, kwargs, options)`` pickled apart (``sys_path``: the training process's,
where it changed since the worker last got it, else ``None``; set before the body
unpickles, so the body's modules resolve as they do there), ``("foreground", busy)``,
``("hurry",)``, ``("segments", names, dropped)`` followed, when ``names`` is not empty,
by one byte carrying the new segments' descriptors (``SCM_RIGHTS``; :mod:`._shm`), and
``("close",)``. The worker's first message, once started, is ``("ready", -1)`` and an
empty body (``None``). Each reply is a header ``("ok", id)``, ``("error", id)`` or
``("unreceived", id)`` followed by its body pickled apart: the call's result, the
error's payload, or why the call's body does not unpickle here (a class the training
script defines, a module this process cannot import). A body the training process
cannot unpickle fails that call there, not the worker.
"""

from __future__ import annotations

import concurrent.futures
import gc
import os
import pickle
import select
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, NoReturn

import torch

from extensions.errors import CheckpointStorageError
from storage.backends.base import FileSystemBase
from storage.checkpoint import deadline
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.persist._mapped import forget, keep, rebuild
from storage.checkpoint.persist._shm import more_descriptors, receive_segments
from storage.checkpoint.persist._throttle import bucket, current_call, limit_writes

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
                bucket.hurry()
                continue
            if message[0] == "segments":
                _, names, dropped = message
                try:
                    keep(receive_segments(self._conn.fileno(), names) if names else {})
                except OSError:
                    _trainer_gone()
                forget(dropped)
                continue
            call_id, sys_path = message[1], message[2]
            if sys_path is not None:  # before the body unpickles: its modules resolve here
                sys.path[:] = sys_path
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
                bucket.set_pace(rate, until, owner=call_id)
            self._calls.submit(self._run, call_id, fn, args, kwargs, options)

    def _run(
        self, call_id: int, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], options: Any
    ) -> None:
        pace = options.get("pace")
        current_call.owner = call_id
        try:
            _set_environ(options.get("environ"))
            if options.get("umask") is not None:  # the training process's, as it is now
                os.umask(options["umask"])
            rank = options.get("rank")
            deadline.distributed_rank = lambda: rank  # errors name the trainer's rank
            for value in (*args, *kwargs.values()):
                limit_writes(value)
            kwargs = {k: _pause if isinstance(v, Pause) else v for k, v in kwargs.items()}
            with bucket.capped(options.get("max_bandwidth")):
                kind, result = "ok", fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the training process
            kind, result = "error", _error_payload(exc)
        finally:
            current_call.owner = None
        if pace is not None:
            bucket.hurry(call_id)  # the paced save is done (a later one keeps its pace)
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


def _exit_with(trainer: int) -> None:
    """Exit once process ``trainer`` (this one's parent) is gone, whoever else still
    holds the socket: a child the training process made with ``fork`` while it was
    starting this worker (another thread's, before the handle knew the socket to close
    in children) kept the socket open, and this worker running, for as long as it lived."""
    try:
        pidfd: int | None = os.pidfd_open(trainer)  # readable once the process exits
    except (AttributeError, OSError):  # before Linux 5.3: the parent's pid is polled
        pidfd = None
    if os.getppid() != trainer:  # gone already (its pid may have been reused)
        _trainer_gone()

    def watch() -> None:
        if pidfd is not None:
            select.select([pidfd], [], [])
        else:
            while os.getppid() == trainer:
                time.sleep(1.0)
        _trainer_gone()

    threading.Thread(target=watch, name="dcp-persist-trainer", daemon=True).start()


def main(fd: int, trainer: int | None = None) -> None:
    if trainer is not None:
        _exit_with(trainer)
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
    server = _Server(conn)
    server.send("ready", -1, None)  # started: the training process's kill clocks run now
    server.serve()
