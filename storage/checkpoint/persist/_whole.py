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
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

#: Seconds a send may still take once a signal handler raised during it.
GRACE = 10.0
#: The largest message that ``Connection.send_bytes`` sends in one ``write(2)``, its
#: length prefix and all (CPython's multiprocessing joins the two up to this size): a
#: handler raises before that write or after it, never inside, so such a message needs
#: no thread of its own (a control message on the stall's path: ``hurry``).
ONE_WRITE = 16384


def send_whole(send: Callable[[], None], give_up: Callable[[], None]) -> None:
    """Run ``send`` (the writes of one message) to its end, even where a signal
    handler raises meanwhile (see the module docstring); its own error is raised."""
    if threading.current_thread() is not threading.main_thread():
        send()  # signal handlers never run here
        return
    failed: list[BaseException] = []

    def run() -> None:
        try:
            send()
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            failed.append(exc)

    sender = threading.Thread(target=run, name="dcp-persist-send", daemon=True)
    try:
        sender.start()
    except RuntimeError:  # no new thread (the interpreter is shutting down): send here
        send()
        return
    interrupted: BaseException | None = None
    deadline = 0.0
    while sender.is_alive():
        try:
            sender.join(None if interrupted is None else max(0.0, deadline - time.monotonic()))
        except BaseException as exc:  # noqa: BLE001 - a handler's: raised once sent
            if interrupted is None:
                interrupted, deadline = exc, time.monotonic() + GRACE
            continue
        if interrupted is not None and sender.is_alive():
            give_up()
            break
    if interrupted is not None:
        raise interrupted
    if failed:
        raise failed[0]
