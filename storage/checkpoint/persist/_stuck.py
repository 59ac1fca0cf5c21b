"""A save (or a tiered manager's drain of a step) whose persist worker does not answer
by the save's deadline: the worker is stopped (``SIGSTOP``, a debugger) or stuck, and
the training process, which would wait on it for ever, kills it (``WorkerCalls.call``'s
``kill_after``) and fails the save with :class:`WorkerStuckError`."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

from extensions.errors import WorkerDiedError
from storage.checkpoint import deadline

#: Seconds past a save's ``timeout`` that the training process waits for the worker's
#: answer before it kills the worker: the worker's own deadline ends its writes by then
#: (cancelled, and joined for at most ``deadline.CANCEL_GRACE``), so one that has not
#: answered is stopped or stuck.
STUCK_GRACE = deadline.CANCEL_GRACE + 10.0


def kill_after(left: float | None) -> float | None:
    """When a call with ``left`` seconds to its deadline (``None``: none) counts as
    unanswered and its worker is killed: :data:`STUCK_GRACE` past it."""
    return None if left is None else left + STUCK_GRACE


class Unanswered(WorkerDiedError):
    """A call the worker had not answered by its ``kill_after``: the worker was killed."""


class WorkerStuckError(deadline.DeadlineExceededError, WorkerDiedError):
    """A save's (or a drain's) persist worker had not answered by the save's deadline
    and was killed."""


def stuck(
    url: str,
    timeout: float | None,
    files: list[Any],
    *,
    item: str | None = None,
    doing: str | None = None,
    fate: str = "This save is not committed and committed checkpoints are untouched",
) -> WorkerStuckError:
    """The error of a save of ``url`` (``timeout``; writing ``files``, or ``item``;
    ``doing`` names other work, ``fate`` says what became of it) whose worker was killed
    for not answering."""
    rank = deadline.distributed_rank()
    who = f"rank {rank}" if rank is not None else "this process"
    return deadline.rank_error(
        WorkerStuckError,
        f"{who}: {doing or f'saving {url}'} timed out: the checkpoint persist worker did not "
        f"answer within the {timeout:g} s deadline (timeout=) and {STUCK_GRACE:g} s more, "
        f"so it was stopped (SIGSTOP, a debugger) or stuck, and it was killed. {fate}; the "
        "next save starts a new worker",
        rank=rank,
        item=item or (files[0][0] if files else "?"),
        url=url,
    )


class Progress:
    """Whether the process ``pid`` went on since it was last asked (the first time:
    since this was made): its CPU time (``/proc/PID/stat``) or the bytes it read and
    wrote (``/proc/PID/io``) grew. A stopped process (``SIGSTOP``, a frozen cgroup) or
    one blocked for good does neither; where ``/proc`` does not say, nothing counts as
    going on."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self._last = self._now()

    def __call__(self) -> bool:
        now = self._now()
        went_on, self._last = now is not None and now != self._last, now
        return went_on

    def _now(self) -> tuple[int, ...] | None:
        try:
            with open(f"/proc/{self._pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()  # after the command name
            with open(f"/proc/{self._pid}/io", "rb") as io:
                counts = dict(
                    line.split(b":", 1) for line in io.read().splitlines() if b":" in line
                )
            return int(fields[11]), int(fields[12]), int(counts[b"rchar"]), int(counts[b"wchar"])
        except (OSError, ValueError, IndexError, KeyError):
            return None


def unless_answered(
    future: concurrent.futures.Future[Any],
    seconds: float,
    kill: Callable[[], None],
    held: Callable[[], bool] | None = None,
) -> None:
    """Run ``kill`` in ``seconds`` unless ``future`` is done by then (one timer thread,
    gone with the answer). A wait too long for a timer (past ``threading.TIMEOUT_MAX``)
    is none: the timer's thread would fail with ``OverflowError``. When ``held()`` says
    the call is held on purpose then (a drain's copy paused while a save writes), its
    clock starts again instead."""
    if seconds >= threading.TIMEOUT_MAX:
        return

    def fire() -> None:
        if held is not None and held():
            unless_answered(future, seconds, kill, held)
        else:
            kill()

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    future.add_done_callback(lambda _: timer.cancel())
