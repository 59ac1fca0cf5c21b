"""A message to the persist worker goes out whole, or not at all, whatever a signal
handler raises meanwhile in the main thread: also while the thread that sends it is
being started, where ``Thread.start`` waits (interruptibly) for it to run."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from storage.checkpoint.persist import _whole


class _Sending:
    """A send that takes a while: records when it began and ended."""

    def __init__(self) -> None:
        self.began = threading.Event()
        self.ended = threading.Event()
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        self.began.set()
        self.began.wait()
        threading.Event().wait(0.2)  # the message's writes
        self.ended.set()


def _interrupted_start(after: bool) -> Callable[[threading.Thread], None]:
    """``Thread.start`` with a handler's KeyboardInterrupt raised in it: once the
    thread runs (``after``: raised from the wait for it to start), or before."""
    real = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if after:
            real(thread)
        raise KeyboardInterrupt

    return start


def test_a_handler_raising_once_the_sender_thread_runs_waits_for_the_whole_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    send = _Sending()
    monkeypatch.setattr(threading.Thread, "start", _interrupted_start(after=True))
    with pytest.raises(KeyboardInterrupt):
        _whole.send_whole(send, lambda: None)
    assert send.ended.is_set()  # raised only once the message was out
    assert send.calls == 1


def test_a_handler_raising_before_the_sender_thread_runs_sends_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    send = _Sending()
    monkeypatch.setattr(threading.Thread, "start", _interrupted_start(after=False))
    with pytest.raises(KeyboardInterrupt):
        _whole.send_whole(send, lambda: None)
    assert send.calls == 0


def test_a_message_is_sent_once_where_no_thread_can_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    send = _Sending()

    def refuse(thread: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    _whole.send_whole(send, lambda: None)
    assert send.calls == 1 and send.ended.is_set()
