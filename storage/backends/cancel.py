"""Interrupting requests from another thread: what lets a save or load past its
deadline bring its worker threads back instead of leaving them in a stalled request.

A thread left waiting in a request may sit inside native code (torch's archive writer
calls a stream's ``write`` from C++); if it wakes up while the interpreter shuts down,
the process dies by SIGABRT or SIGSEGV. So the checkpoint layer runs each task of a
save or load with a :class:`Cancel` installed for its thread (:func:`installed`) and,
past the deadline, cancels it and joins the thread. Backends make the requests of that
thread interruptible through :func:`current`:

* a stream keeps a child (``Cancel(current())``), so cancelling the task cancels the
  stream's requests, and the stream can stop its own (an aborted upload's parts)
  without touching anything else of the task;
* coroutines run on a client's event loop through :meth:`Cancel.run` are cancelled;
* ``http.client`` connections in use, registered with :meth:`Cancel.track`, are shut
  down (a blocked ``recv``/``send`` returns at once; closing would not wake it);
* waits for a slot or a retry's backoff go through :meth:`Cancel.acquire` and
  :meth:`Cancel.wait`; anything else registers a callback with :meth:`Cancel.hook`.

Once cancelled, every such request raises :class:`StreamCancelled` (an
``InterruptedError``) at once. Threads without an installed ``Cancel`` (the main
thread, the one-off calls of the ops layer) are not affected.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.client
import logging
import socket
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

_local = threading.local()

# How often a wait on another thread's future looks for a cancel that could not reach
# the event loop (a loop that stopped, at interpreter exit).
_POLL = 1.0


class StreamCancelled(InterruptedError):
    """The request was interrupted: its save or load was cancelled (past its deadline)."""


class Cancel:
    """Cancellation of a group of requests (a task's, a stream's, a multipart upload's
    parts); ``parent``'s cancel cancels this one too."""

    def __init__(self, parent: Cancel | None = None) -> None:
        self.cancelled = threading.Event()
        self._lock = threading.Lock()
        self._tasks: list[tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]]] = []
        self._connections: set[http.client.HTTPConnection] = set()
        self._hooks: list[Callable[[], None]] = []
        self._children: weakref.WeakSet[Cancel] = weakref.WeakSet()
        if parent is not None:
            with parent._lock:
                parent._children.add(self)
            if parent.cancelled.is_set():
                self.cancel()

    def check(self) -> None:
        """Raise :class:`StreamCancelled` if cancelled."""
        if self.cancelled.is_set():
            raise StreamCancelled("interrupted: the save or load was cancelled past its deadline")

    def wait(self, seconds: float) -> None:
        """Sleep ``seconds`` (a retry's backoff); raise as soon as cancelled."""
        self.cancelled.wait(seconds)
        self.check()

    def acquire(self, semaphore: threading.Semaphore) -> None:
        """Acquire ``semaphore``; raise (without it) once cancelled."""
        while not semaphore.acquire(timeout=0.1):
            self.check()

    def run(
        self,
        loop: asyncio.AbstractEventLoop,
        func: Callable[..., Coroutine[Any, Any, T]],
        *args: Any,
        **kwargs: Any,
    ) -> T:
        """``func(*args, **kwargs)`` run on ``loop`` and waited for (as
        ``fsspec.asyn.sync`` does); cancelled with this group."""
        future = self.start(loop, func, *args, **kwargs)
        while True:
            try:
                return future.result(timeout=_POLL)
            except concurrent.futures.CancelledError:
                raise StreamCancelled("interrupted: the request was cancelled") from None
            except concurrent.futures.TimeoutError:
                if future.done():  # the request's own timeout (one class since 3.11)
                    raise
                self.check()

    def start(
        self,
        loop: asyncio.AbstractEventLoop,
        func: Callable[..., Coroutine[Any, Any, T]],
        *args: Any,
        **kwargs: Any,
    ) -> concurrent.futures.Future[T]:
        """Start ``func(*args, **kwargs)`` on ``loop`` without waiting; cancelled with
        this group. Refused on ``loop``'s own thread, where waiting would block the loop
        forever (a stream flushed by the garbage collector while a callback of that loop
        runs, say): every client sharing the loop would hang."""
        self.check()
        if asyncio._get_running_loop() is loop:
            raise RuntimeError(
                "a request was made from the event loop's own thread, where waiting for it "
                "would hang that loop (a data stream finalised by the garbage collector "
                "there?); it was not sent"
            )

        async def tracked() -> T:
            entry = (asyncio.get_running_loop(), asyncio.current_task())
            assert entry[1] is not None
            with self._lock:
                if self.cancelled.is_set():
                    raise StreamCancelled("interrupted: the request was cancelled")
                self._tasks.append(entry)  # type: ignore[arg-type]
            try:
                return await func(*args, **kwargs)
            finally:
                with self._lock:
                    self._tasks.remove(entry)  # type: ignore[arg-type]

        return asyncio.run_coroutine_threadsafe(tracked(), loop)

    def tasks(self) -> list[asyncio.Task[Any]]:
        """The coroutines started through this group that are still running."""
        with self._lock:
            return [task for _, task in self._tasks]

    def track(self, conn: http.client.HTTPConnection, busy: bool) -> None:
        """While ``busy``, cancelling shuts ``conn`` down (at once if already cancelled)."""
        with self._lock:
            if busy:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)
        if busy and self.cancelled.is_set():
            _shut(conn)

    @contextlib.contextmanager
    def hook(self, callback: Callable[[], None]) -> Iterator[None]:
        """Within the block, cancelling calls ``callback`` (at once if already cancelled)."""
        with self._lock:
            self._hooks.append(callback)
        try:
            if self.cancelled.is_set():
                callback()
            yield
        finally:
            with self._lock:
                self._hooks.remove(callback)

    def cancel(self) -> None:
        """Interrupt every request of this group and of its children, now and later.
        Returns at once; safe from any thread."""
        self.cancelled.set()
        with self._lock:
            tasks, connections = list(self._tasks), list(self._connections)
            hooks, children = list(self._hooks), list(self._children)
        for loop, task in tasks:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing runs
                loop.call_soon_threadsafe(task.cancel)
        for conn in connections:
            _shut(conn)
        for callback in hooks:
            try:
                callback()
            except Exception as exc:  # one failing hook must not keep the others
                log.warning("cancelling a request failed: %r", exc)
        for child in children:
            child.cancel()


def _shut(conn: http.client.HTTPConnection) -> None:
    sock = conn.sock
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def current() -> Cancel | None:
    """The :class:`Cancel` installed for the calling thread, if any."""
    cancel: Cancel | None = getattr(_local, "cancel", None)
    return cancel


@contextlib.contextmanager
def installed(cancel: Cancel) -> Iterator[None]:
    """Make ``cancel`` the calling thread's :func:`current` within the block."""
    previous = current()
    _local.cancel = cancel
    try:
        yield
    finally:
        _local.cancel = previous
