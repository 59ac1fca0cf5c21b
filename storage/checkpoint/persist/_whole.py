"""Sending a message to the persist worker whole, whatever a signal handler raises
meanwhile.

One message to the worker takes several writes: a call's header and its body, the
message that names new staging segments and the byte that carries their descriptors,
a large body's several ``write(2)`` calls. Python runs signal handlers in the main
thread, between two steps of whatever it runs there, so Ctrl-C (``KeyboardInterrupt``)
or a training script's SIGTERM handler raising ``SystemExit`` could cut a message in
two: the worker would read the rest as the next message and stay out of step for good
(a length read from the middle of a body, then a wait for bytes that never come, for
this save and every one after).

:func:`send_whole` makes the writes in a thread of their own when called from the main
thread, and raises what a handler raised there once they are done. A send still blocked
:data:`GRACE` seconds after that (a worker that does not read: stopped, or stuck) is
given up: ``give_up`` stops the worker, since a stream cut mid-message cannot go on,
and the handler's exception is raised.

A handler that saves runs in the thread it interrupted: where that thread holds one of
the worker handle's locks (a save waiting for the previous one's buffers holds one for
seconds), taking it again would wait forever. :class:`OwnedLock` refuses that re-entry
with an error naming the fix instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType

from extensions.errors import CheckpointStorageError

#: Seconds a send may still take once a signal handler raised during it.
GRACE = 10.0
#: The largest message that ``Connection.send_bytes`` sends in one ``write(2)``, its
#: length prefix and all (CPython's multiprocessing joins the two up to this size): a
#: handler raises before that write or after it, never inside, so such a message needs
#: no thread of its own (a control message on the stall's path: ``hurry``).
ONE_WRITE = 16384


def send_whole(send: Callable[[], None], give_up: Callable[[], None]) -> None:
    """Run ``send`` (the writes of one message) to its end, even where a signal
    handler raises meanwhile (see the module docstring); its own error is raised.

    A handler may also raise while the sender thread starts (``Thread.start`` waits for
    it to run): whichever of that thread and the caller takes ``claim`` first decides
    whether the message goes (then it goes whole) or not at all."""
    if threading.current_thread() is not threading.main_thread():
        send()  # signal handlers never run here
        return
    failed: list[BaseException] = []
    claim = threading.Lock()
    done = threading.Event()

    def run() -> None:
        if not claim.acquire(blocking=False):
            return  # given up before it began: the caller sends it, or nothing goes
        try:
            send()
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            failed.append(exc)
        finally:
            done.set()

    sender = threading.Thread(target=run, name="dcp-persist-send", daemon=True)
    interrupted: BaseException | None = None
    deadline = 0.0
    try:
        sender.start()
    except BaseException as exc:  # noqa: BLE001 - a handler's: raised once sent
        if claim.acquire(blocking=False):  # the thread had not begun, and never will
            if not isinstance(exc, RuntimeError):
                raise  # nothing of the message went out
            send()  # no new thread (the interpreter is shutting down): sent from here
            return
        interrupted, deadline = exc, time.monotonic() + GRACE
    while not done.is_set():
        try:
            done.wait(None if interrupted is None else max(0.0, deadline - time.monotonic()))
        except BaseException as exc:  # noqa: BLE001 - a handler's: raised once sent
            if interrupted is None:
                interrupted, deadline = exc, time.monotonic() + GRACE
            continue
        if interrupted is not None and not done.is_set():
            give_up()
            break
    if interrupted is not None:
        raise interrupted
    if failed:
        raise failed[0]


class OwnedLock:
    """A lock that knows the thread holding it and refuses to be taken again by that
    thread (a signal handler's save while the interrupted code holds it: see the module
    docstring) with :class:`~extensions.errors.CheckpointStorageError`, where a plain
    lock would wait forever."""

    def __init__(self, what: str) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._what = what

    def acquire(self) -> None:
        me = threading.get_ident()
        if self._owner == me:  # only this thread sets its own ident: no race to fear
            raise CheckpointStorageError(
                f"a checkpoint save began while this thread was inside another one "
                f"({self._what}): a signal handler that saves? Let the handler set a flag "
                "and save once it returns (CheckpointManager.save_on_signal does)"
            )
        self._lock.acquire()
        self._owner = me

    def release(self) -> None:
        self._owner = None
        self._lock.release()

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()
