"""Bounded work with attribution: what a rank did, for how long, and which item failed.

A save or load on many ranks fails as a whole only once every rank has come out of its
``write_data`` / ``read_data``: DCP's collectives wait for the slowest rank. So each
rank bounds its own storage work by a deadline (``timeout=`` on the writer and the
reader), and an error that leaves a rank names the rank, the item and the URL, so the
other ranks, which only see it through DCP's gather, can say who failed and where.

:func:`run_tasks` runs the storage work of one call on worker threads and waits for it
at most until the deadline. Past it, no worker may stay behind in a stalled request: a
thread parked inside native code (torch's archive writer calls the data stream's
``write`` from C++) that wakes up while the interpreter exits kills the process by
SIGABRT or SIGSEGV. So each worker runs with a :class:`~storage.backends.cancel.Cancel`
installed; past the deadline it is cancelled (the backends interrupt their requests:
connections shut down, coroutines cancelled, waits ended), every stream a task opened
through :func:`cancellable` refuses further calls, the workers are joined for at most
:data:`CANCEL_GRACE` seconds, and then the call raises :class:`DeadlineExceededError`
naming what each unfinished task was doing (:func:`note` records it as the task goes).
:class:`Budget` spreads one ``timeout`` over every storage step of a save or load.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any, TypeVar, cast

import torch.distributed as dist

from extensions.errors import CheckpointStorageError, quote
from storage.backends import cancel as cancelling
from storage.backends.cancel import Cancel

T = TypeVar("T")

log = logging.getLogger(__name__)

#: Seconds a call past its deadline waits for its cancelled workers to come back.
CANCEL_GRACE = 5.0

_local = threading.local()


class CheckpointRankError(CheckpointStorageError):
    """One rank's part of a multi-rank save or load failed.

    The message names the rank, the item and the URL; ``rank``, ``item`` and ``url``
    hold them, and ``__cause__`` is the rank's own error (as raised on that rank)."""

    rank: int | None = None
    item: str | None = None
    url: str | None = None


class DeadlineExceededError(CheckpointRankError, TimeoutError):
    """A rank's storage work did not finish within its ``timeout``; it was abandoned."""


def distributed_rank() -> int | None:
    """This process's global rank when it is one of several, else ``None``."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank()
    return None


E = TypeVar("E", bound=CheckpointRankError)


def rank_error(cls: type[E], message: str, *, rank: int | None, item: str, url: str) -> E:
    """``cls(message)`` carrying its facts (they travel with the pickled error)."""
    error = cls(message)
    error.rank, error.item, error.url = rank, item, url
    return error


def check_timeout(timeout: object) -> float | None:
    """``timeout`` (seconds, or ``None`` for no deadline) if valid. One too far to wait
    for (``math.inf``, or past ``threading.TIMEOUT_MAX``, some 292 years) is no deadline:
    every wait on it would fail with ``OverflowError``."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise TypeError(f"timeout must be a number of seconds > 0 or None, got {timeout!r}")
    return float(timeout) if timeout < threading.TIMEOUT_MAX else None


def check_wait(timeout: object) -> float | None:
    """``timeout`` of a wait for work in flight: as :func:`check_timeout`, and 0 too (a
    look that does not wait: the work is done or the wait's deadline error says what
    is not)."""
    if timeout == 0 and isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        return 0.0
    return check_timeout(timeout)


def note(item: str, url: str) -> None:
    """Record that the calling task now works on ``item`` at ``url`` (used in the
    deadline's message and to attribute its errors); a no-op outside :func:`run_tasks`."""
    board = getattr(_local, "board", None)
    if board is not None:
        board[threading.get_ident()] = (item, url)


def current() -> tuple[str, str] | None:
    """What the calling task noted last, if anything."""
    board = getattr(_local, "board", None)
    return None if board is None else board.get(threading.get_ident())


def cancellable(stream: IO[bytes]) -> IO[bytes]:
    """``stream``, just opened by the calling task, as the task must use it: once its
    run is cancelled, every ``write``, ``read`` and ``readinto`` raises
    ``StreamCancelled`` before reaching the stream. So a task stops at its next call
    even where the backend cannot interrupt a request (torch's archive writer gets the
    error and unwinds). Outside :func:`run_tasks`: ``stream`` itself."""
    cancel = cancelling.current()
    return stream if cancel is None else cast(IO[bytes], _Guarded(stream, cancel))


class _Guarded:
    def __init__(self, stream: IO[bytes], cancel: Cancel) -> None:
        self._stream = stream
        self._cancel = cancel

    def write(self, data: Any) -> int:
        self._cancel.check()
        return self._stream.write(data)

    def read(self, size: int = -1) -> bytes:
        self._cancel.check()
        return self._stream.read(size)

    def readinto(self, buffer: Any) -> int:
        self._cancel.check()
        return self._stream.readinto(buffer)  # type: ignore[attr-defined, no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def run_tasks(
    tasks: Sequence[Callable[[], T]],
    *,
    workers: int,
    timeout: float | None,
    action: str,
    location: str,
    stated_timeout: float | None = None,
) -> list[T]:
    """Run ``tasks`` on up to ``workers`` threads and return their results in order.

    The first error stops handing out tasks; once the running ones are done, the error
    of the earliest failed task in ``tasks`` order is raised (attributed to this rank,
    the item the task noted and its URL when this process is one of several ranks).
    Past ``timeout`` seconds the tasks are cancelled and their threads joined (for at
    most :data:`CANCEL_GRACE` seconds), then the call raises
    :class:`DeadlineExceededError` naming each unfinished task's item (or the error of
    a task that had failed before). ``action`` (``"saving"``, ``"loading"``) and
    ``location`` (the checkpoint URL) word the messages; ``stated_timeout`` is the
    ``timeout=`` they name (default ``timeout``: a :class:`Budget` runs steps with what
    is left of it)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    rank = distributed_rank()
    board: dict[int, tuple[str, str]] = {}
    results: list[T | None] = [None] * len(tasks)
    errors: list[tuple[int, BaseException, tuple[str, str] | None]] = []
    abandoned = [False]
    pending = list(range(len(tasks)))[::-1]
    running = [0]
    cond = threading.Condition()
    cancel = Cancel()

    def worker() -> None:
        _local.board = board
        with cancelling.installed(cancel):
            while True:
                with cond:
                    if errors or abandoned[0] or not pending:
                        return
                    index = pending.pop()
                    running[0] += 1
                try:
                    results[index] = tasks[index]()
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    with cond:
                        errors.append((index, exc, board.get(threading.get_ident())))
                finally:
                    with cond:
                        running[0] -= 1
                        cond.notify_all()

    threads = [
        threading.Thread(target=worker, name=f"dcp-storage-{action}", daemon=True)
        for _ in range(max(1, min(workers, len(tasks))))
    ]
    for thread in threads:
        thread.start()
    late: list[tuple[str, str]] | None = None  # past the deadline: what was unfinished
    with cond:
        while running[0] or (pending and not errors):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                abandoned[0] = True
                late = sorted(board[t.ident] for t in threads if t.is_alive() and t.ident in board)
                break
            cond.wait(left)
        failed = list(errors)  # before the cancel below makes the late tasks fail too
    if late is not None:
        _stop(cancel, threads, action, location)
        if not failed:
            stated = timeout if stated_timeout is None else stated_timeout
            raise _deadline_error(rank, action, location, stated, late)
    if failed:
        # The first task in order that failed, not the first to fail in time: the same
        # damage reports the same item every run.
        _, exc, doing = min(failed, key=lambda e: e[0])
        raise attribute(exc, rank, action, location, doing)
    return results  # type: ignore[return-value]


def _stop(cancel: Cancel, threads: list[threading.Thread], action: str, location: str) -> None:
    """Cancel the tasks' requests and wait for their threads (at most ``CANCEL_GRACE``)."""
    cancel.cancel()
    end = time.monotonic() + CANCEL_GRACE
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))
    left = sum(thread.is_alive() for thread in threads)
    if left:
        log.warning(
            "%s %s: %d worker thread(s) still in a storage request %g s after it was "
            "cancelled (the backend cannot interrupt it); they are left behind",
            action,
            location,
            left,
            CANCEL_GRACE,
        )


def attribute(
    exc: BaseException,
    rank: int | None,
    action: str,
    location: str,
    doing: tuple[str, str] | None,
) -> BaseException:
    """``exc`` as every rank should hear it: unchanged on a single process (or if it
    already names its rank), else an error whose message names the rank, the item and
    the URL, caused by ``exc``. One of our own errors keeps its type (an
    :class:`IntegrityError` stays one, so ``except IntegrityError`` works on every rank);
    anything else becomes a :class:`CheckpointRankError`."""
    if (
        rank is None
        or not isinstance(exc, Exception)
        or isinstance(exc, CheckpointRankError)
        or getattr(exc, "rank", None) is not None
    ):
        return exc
    item, url = doing or ("?", location)
    message = (
        f"rank {rank}: {action} item {quote(item)} at {url} failed: {type(exc).__name__}: {exc}"
    )
    error: Exception
    if isinstance(exc, CheckpointStorageError):
        try:
            error = type(exc)(message)  # our errors take one message
        except Exception:
            error = CheckpointRankError(message)
    else:
        error = CheckpointRankError(message)
    error.rank, error.item, error.url = rank, item, url  # type: ignore[attr-defined]
    error.__cause__ = exc
    return error


def _deadline_error(
    rank: int | None,
    action: str,
    location: str,
    timeout: float | None,
    stuck: list[tuple[str, str]],
) -> DeadlineExceededError:
    who = f"rank {rank}" if rank is not None else "this process"
    item, url = stuck[0] if stuck else ("?", location)
    more = f" (and {len(stuck) - 1} more)" if len(stuck) > 1 else ""
    return rank_error(
        DeadlineExceededError,
        f"{who}: {action} item {quote(item)} at {url}{more} timed out: it did not finish "
        f"within the {timeout:g} s deadline (timeout=); the storage request is stalled, so the "
        f"{'save' if action == 'saving' else 'load'} of {location} is abandoned on every rank",
        rank=rank,
        item=item,
        url=url,
    )


class Budget:
    """One save's or load's ``timeout`` on this rank, spent by its storage steps.

    Every step that touches storage (reading the metadata; checking what is at the
    location and reading a base; writing or reading the data; publishing the metadata)
    runs through :meth:`run` or :meth:`call` within what the earlier steps left, so the
    storage work of one save or load on this rank takes at most ``timeout`` seconds in
    all, whatever request stalls. Time between the steps (planning, DCP's collectives,
    waiting for other ranks) is not counted: a rank fails for its own stalled request,
    never for another rank's. ``None``: no deadline (steps run inline)."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self.spent = 0.0

    def restart(self) -> None:
        """A new save or load begins: the whole ``timeout`` is left."""
        self.spent = 0.0

    def left(self) -> float | None:
        return None if self.timeout is None else max(0.0, self.timeout - self.spent)

    def run(
        self, tasks: Sequence[Callable[[], T]], *, workers: int, action: str, location: str
    ) -> list[T]:
        """:func:`run_tasks` within what is left."""
        return self._run(tasks, workers, action, location, [])

    def _run(
        self,
        tasks: Sequence[Callable[[], T]],
        workers: int,
        action: str,
        location: str,
        doing: list[tuple[str, str]],
    ) -> list[T]:
        left = self.left()
        if left == 0.0:  # spent by earlier steps: this one does not start
            raise _deadline_error(distributed_rank(), action, location, self.timeout, doing)
        began = time.monotonic()
        try:
            return run_tasks(
                tasks,
                workers=workers,
                timeout=left,
                action=action,
                location=location,
                stated_timeout=self.timeout,
            )
        finally:
            self.spent += time.monotonic() - began

    def call(self, task: Callable[[], T], *, action: str, location: str, item: str, url: str) -> T:
        """``task()`` as one step that works on ``item`` at ``url`` (for the messages)."""
        if self.timeout is None:
            return task()

        def noted() -> T:
            note(item, url)
            return task()

        return self._run([noted], 1, action, location, [(item, url)])[0]
