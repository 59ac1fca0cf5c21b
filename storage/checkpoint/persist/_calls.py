"""The persist worker process as the training process drives it (:class:`WorkerCalls`):
started niced on the first call, sent calls whose replies it hands to their futures,
every call in flight failed when it dies (the failure semantics are in the package
docstring), and the pace of the writes those calls make. The staging buffers are the
handle's other half (:class:`._worker.Worker`)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import math
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

import torch.distributed as dist

from extensions.errors import WorkerDiedError
from storage.checkpoint.persist._child import Pause
from storage.checkpoint.persist._launch import launch, umask
from storage.checkpoint.persist._messages import (
    dumps_call,
    not_sendable,
    remote_error,
    unreadable,
)
from storage.checkpoint.persist._shm import send_segments
from storage.checkpoint.persist._stuck import Progress, Unanswered, unless_answered
from storage.checkpoint.persist._whole import ONE_WRITE, OwnedLock, send_whole

log = logging.getLogger(__name__)

PACE_MIN_SECONDS = 0.5  # a pace deadline closer than this: the writes go at full speed
PACE_MIN_BYTES = 1 << 20  # an upload smaller than this goes at full speed

T = TypeVar("T")


class WorkerCalls:
    """The training process's side of its persist worker process and the calls sent to
    it (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = OwnedLock("the persist worker's state")
        self._send_lock = OwnedLock("a message to the persist worker")
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        # Each call in flight: its future, and its function's name for an error.
        self._pending: dict[int, tuple[concurrent.futures.Future[Any], str]] = {}
        self._ids = itertools.count()
        self._unreported: WorkerDiedError | None = None
        self._killed: set[int] = set()  # calls unanswered by their kill_after
        self._ready = False  # the worker said it serves (its start-up is done)
        # Calls with a kill_after sent before that: their clocks start when it does.
        self._unarmed: list[tuple[int, concurrent.futures.Future[Any], float, bool]] = []
        self._foreground = 0  # saves in the foreground: the worker's pace pauses
        self._pace_until: float | None = None  # the next save's deadline (pace_next)
        self._pace_for: str | None = None  # the checkpoint that save writes, if given
        self._paced = False  # a paced call went out and no hurry since
        self._path: tuple[str, ...] = ()  # the sys.path the worker last got

    # --- the process ------------------------------------------------------------------

    def drop_in_child(self) -> None:
        """In a child made with ``fork``: close its copy of the socket to the parent's
        worker (nothing is sent), which then ends with the parent, not with the last
        such child to exit."""
        conn = self._conn
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.close()

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
            proc = launch(theirs.fileno())
        finally:
            theirs.close()  # the worker's end lives only in the worker: its death is EOF here
        conn = Connection(ours.detach())
        self._path = tuple(sys.path)  # the worker's, as of this message
        conn.send_bytes(pickle.dumps(("init", list(self._path), self._foreground > 0)))
        self._proc, self._conn, self._ready = proc, conn, False
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
                kind, call_id = pickle.loads(conn.recv_bytes())
                body = conn.recv_bytes()
                if kind == "ready":
                    self._serving(proc)
                    continue
                with self._lock:
                    call = self._pending.pop(call_id, None)
                if call is None:
                    continue
                future, name = call
                try:
                    value = pickle.loads(body)
                except BaseException as exc:  # noqa: BLE001 - fails this call, not the worker
                    future.set_exception(unreadable(name, exc))
                    continue
                if kind == "ok":
                    future.set_result(value)
                elif kind == "unreceived":  # the call did not unpickle there
                    why = f"it does not unpickle there ({value})"
                    future.set_exception(not_sendable(name, why))
                else:
                    future.set_exception(remote_error(value))
        except (EOFError, OSError):
            pass
        except BaseException as exc:  # a header we cannot read: the worker is unusable
            log.error("persist worker %d: unreadable reply (%s); stopping it", proc.pid, exc)
        with self._lock:
            closed = self._proc is not proc  # close() let it go: no death to report
        if closed:
            self._close_conn(conn)
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
            killed, self._killed = self._killed, set()
            self._unarmed = []
            if not pending:
                self._unreported = error
        self._close_conn(conn)
        if code != 0:
            log.error("%s", error)
        for call_id, (future, _) in pending.items():
            future.set_exception(Unanswered(str(error)) if call_id in killed else error)

    def _close_conn(self, conn: Connection) -> None:
        """Close the socket to a worker that is gone. A send in another thread may still
        be writing to it (a large call's body): it is woken by a shutdown (a send into a
        socket whose peer is gone may block for ever where a forked child still holds
        that peer), and the descriptor is closed only once it let go of the send lock,
        never under it (the sender's next write went to a closed descriptor, failing the
        call with ``TypeError``, or to another file that took its number)."""
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=conn.fileno())
            try:
                sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.detach()
        with self._send_lock:
            conn.close()

    def close(self) -> None:
        """Stop the worker (after the calls in flight)."""
        with self._lock:
            proc, conn = self._proc, self._conn
            self._proc, self._conn, self._unreported = None, None, None
            self._unarmed = []
        if conn is not None:
            try:
                with self._send_lock:
                    self._send(conn, pickle.dumps(("close",)))
            except OSError:
                pass
        if proc is not None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # --- calls ------------------------------------------------------------------------

    def call(
        self,
        fn: Callable[..., T],
        *args: Any,
        max_bandwidth: int | None = None,
        pace_bytes: int | None = None,
        pace_for: str | None = None,
        kill_after: float | None = None,
        **kwargs: Any,
    ) -> concurrent.futures.Future[T]:
        """Run ``fn(*args, **kwargs)`` in the worker (``fn`` and the arguments must
        pickle; ``pace=PAUSE`` stands for the worker's pause); its future holds the
        result or the worker's exception. ``pace_bytes``: the bytes it writes, paced to
        end by the deadline :meth:`pace_next` set, if one is pending for ``pace_for``
        (the checkpoint it writes). ``kill_after``: seconds after which the worker is
        killed if it has not answered (it is stopped, ``SIGSTOP`` or a debugger, or
        stuck; the call's sending too may wait on it), counted from the send or, for a
        worker still starting, from when it serves, and for a paced call from its pace's
        deadline; a call that pauses (``PAUSE``) is not killed while a save is in the
        :meth:`foreground` (its clock starts again). The call then fails with
        :class:`._stuck.Unanswered`, every other call in flight as for any death."""
        options: dict[str, Any] = {
            "max_bandwidth": max_bandwidth,
            "pace": None,
            "rank": dist.get_rank() if dist.is_available() and dist.is_initialized() else None,
            # As a thread would, the call sees the environment as it is now (credentials
            # the clients read from it may have been set after the worker started).
            "environ": dict(os.environ),
            # And the files it creates take this process's umask as it is now (a script
            # that makes its files private once the worker runs: os.umask(0o077)).
            "umask": umask(),
        }
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        name = str(getattr(fn, "__qualname__", fn))
        pauses = any(isinstance(v, Pause) for v in kwargs.values())
        with self._lock:
            if pace_bytes is not None:  # taken first: a call that fails leaves no pace
                options["pace"] = self._take_pace(pace_bytes, pace_for)
            conn = self._start()
            call_id = next(self._ids)
            try:
                body = dumps_call((fn, args, kwargs, options))
            except Exception as exc:
                raise not_sendable(name, f"{type(exc).__name__}: {exc}") from None
            # The call's id goes apart from its body: a body the worker cannot unpickle
            # fails this call there, not the worker or every call after it. With it goes
            # this process's sys.path where it changed since the worker last got it (a
            # transform's module found through a path added since), set there first.
            path = tuple(sys.path)
            header = pickle.dumps(("call", call_id, None if path == self._path else path))
            self._path = path
            self._pending[call_id] = (future, name)
            if kill_after is not None:  # before the send, which a stopped worker may block
                if options["pace"] is not None:  # its writes are spread to that deadline
                    kill_after += max(0.0, options["pace"][1] - time.monotonic())
                if self._ready:
                    self._kill_unanswered(call_id, future, kill_after, pauses)
                else:  # its start-up (importing torch on a busy host) is not the call's
                    self._unarmed.append((call_id, future, kill_after, pauses))
            self._paced = self._paced or options["pace"] is not None
            # Sent in the order the lock was taken: a hurry never overtakes the call.
            self._send_lock.acquire()
        try:
            self._send(conn, header, body)
        except OSError:
            pass  # the reader sees the worker gone and fails the future
        finally:
            self._send_lock.release()
        return future

    def _serving(self, proc: subprocess.Popen[bytes]) -> None:
        """Worker ``proc`` finished starting: the clocks of the calls sent to it with a
        ``kill_after`` start now."""
        with self._lock:
            if self._proc is not proc:
                return
            self._ready = True
            unarmed, self._unarmed = self._unarmed, []
            for call_id, future, seconds, pauses in unarmed:
                if call_id in self._pending:
                    self._kill_unanswered(call_id, future, seconds, pauses)

    def _kill_unanswered(
        self, call_id: int, future: concurrent.futures.Future[Any], seconds: float, pauses: bool
    ) -> None:
        """Kill the worker unless call ``call_id`` was answered within ``seconds`` not
        spent paused (``pauses``: a drain's copy, paused while a save is in the
        foreground, and never killed while the worker goes on: a large step may take a
        slow root longer than a save's deadline; call with the lock)."""
        went_on = Progress(self._proc.pid) if pauses and self._proc else None

        def kill() -> None:
            with self._lock:
                proc = self._proc  # the one the call went to: a death fails the call
                if call_id not in self._pending or proc is None or proc.poll() is not None:
                    return  # answered (or failed) meanwhile
                self._killed.add(call_id)
                log.error("persist worker %d: no answer in %g s; stopping it", proc.pid, seconds)
                proc.kill()

        def held() -> bool:
            return pauses and (self._foreground > 0 or (went_on is not None and went_on()))

        unless_answered(future, seconds, kill, held)

    def pace_next(self, deadline: float | None, for_url: str | None = None) -> None:
        """Let the next save's data writes take until ``deadline`` (``time.monotonic``;
        this host's clock, the worker's too) instead of the link's full speed, so that
        its upload shares the cores with training over the time it has; ``None``: at
        full speed. With ``for_url`` only a save of that checkpoint takes the pace (a
        save another thread makes meanwhile, elsewhere, goes at full speed). A
        :meth:`hurry` before that save's call goes out cancels it. Raises
        ``ValueError`` for a deadline that is not a finite number."""
        if deadline is not None and (
            isinstance(deadline, bool)
            or not isinstance(deadline, (int, float))
            or not math.isfinite(deadline)
        ):
            raise ValueError(
                f"a pace deadline must be a finite time.monotonic() value or None, got {deadline!r}"
            )
        with self._lock:
            self._pace_until, self._pace_for = deadline, for_url

    def _take_pace(self, nbytes: int, url: str | None = None) -> tuple[float, float] | None:
        """The rate (bytes/s) that writes ``nbytes`` of checkpoint ``url`` by the
        pending deadline, and that deadline, taken once; ``None`` when none is pending
        for it, it is too close to matter, or the upload too small (call with the
        lock). The clock is read once: a second read could fall past the deadline."""
        deadline = self._pace_until
        if deadline is None or self._pace_for not in (None, url):
            return None  # none, or another checkpoint's: left for that one's save
        self._pace_until = self._pace_for = None
        left = deadline - time.monotonic()
        if not left >= PACE_MIN_SECONDS or nbytes < PACE_MIN_BYTES:
            return None
        rate = nbytes / left
        return (rate, deadline) if math.isfinite(rate) and rate > 0 else None

    def hurry(self) -> None:
        """Lift the pace of a paced save, and of one about to go out (its caller waits
        for it now). Starts no worker."""
        with self._lock:
            self._pace_until = self._pace_for = None
            conn, self._paced = (self._conn if self._paced else None), False
            if conn is None:
                return
            self._send_lock.acquire()
        try:
            self._send(conn, pickle.dumps(("hurry",)))
        except OSError:
            pass  # a dead worker: the reader reports it
        finally:
            self._send_lock.release()

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
                    self._send(conn, message)
            except OSError:
                pass  # a dead worker: the reader reports it

    def _send(self, conn: Connection, *messages: bytes, fds: list[int] | None = None) -> None:
        """Send ``messages`` to the worker behind ``conn``, then ``fds`` (descriptors,
        in one byte), whole (:func:`._whole.send_whole`; call with the send lock): a
        send given up stops that worker."""
        if fds is None and len(messages) == 1 and len(messages[0]) <= ONE_WRITE:
            conn.send_bytes(messages[0])
            return

        def send() -> None:
            for message in messages:
                conn.send_bytes(message)
            if fds is not None:
                send_segments(conn.fileno(), fds)

        def give_up() -> None:
            proc = self._proc
            if self._conn is conn and proc is not None:
                log.error("persist worker %d: a message to it is stuck; stopping it", proc.pid)
                proc.kill()

        send_whole(send, give_up)


def _exit_text(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"
