"""Preemption saves: on a signal, commit the latest state to the local tier before the kill.

``guard = mgr.save_on_signal(state_fn, grace=25)`` installs handlers for ``signals``
(SIGTERM by default); the training loop marks each step boundary with
``if guard.should_stop(step): break``. Once a signal has arrived on any rank, every rank
saves ``state_fn()`` as ``step`` in the local tier with the usual commit protocol
(metadata last), then ``should_stop`` returns ``True`` and the job exits. The step drains
to the root in the background like any tiered save: within the rest of the grace period
(:meth:`PreemptionGuard.drain`), or at the next start (a tiered manager's construction
drains every step committed locally and not durable).

Why the handler itself saves nothing. A Python signal handler runs in the main thread
between two bytecodes: possibly halfway through ``optimizer.step()`` (a state that is
neither step N nor step N+1), or between two collectives of the training step, where a
save's own collectives on the job's group would interleave with the step's and hang
every rank. Ranks also get the signal at different times, and all must save the same
step. So the handler only records the time; at the next step boundary (the state is
consistent there, and no collective of the job is half done) the ranks agree with one
tiny all-reduce on a gloo group of the guard's own: who has seen a signal, how long ago,
and whether all are at the same step. There is no variant that saves from inside the
handler: a caller cannot know what the main thread was doing when the signal landed.

Deadline. ``grace`` seconds after the first rank's signal, the preemption save is
given up: ``should_stop`` returns (``saved`` is ``None``, ``error`` says why; the ranks
agree before the save starts, so where one finds the deadline passed, or the save in
flight not finished by it, none starts), and a save, left behind in its thread,
publishes nothing (every rank checks the deadline
before the commit and all of them remove what they wrote if any is late). A save of
this manager in flight is waited for first (its commit and the preemption commit never
race: one save thread runs them in turn); if it is the save of the same step and it
committed, nothing is saved again.

A second signal. Until the deadline, a signal again is only recorded (the save at the
next step boundary is what the first one asked for). A job stuck in a step or in the
save must still be stoppable without SIGKILL: the same signal again once the grace
period is over (the agreed deadline, or ``grace`` after this rank's first signal before
a step boundary agreed on one), and a second SIGINT (Ctrl-C) at any time, are handled as
before the guard: the previous handler is put back and called (Python's SIGINT handler
raises ``KeyboardInterrupt``), or the default action taken (SIGTERM: the process ends).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from storage.checkpoint.deadline import DeadlineExceededError

if TYPE_CHECKING:
    from storage.ops.tiers import LocalTier

log = logging.getLogger(__name__)

Handler = Callable[[int, FrameType | None], Any] | int | None


class PreemptionGuard:
    """Saves ``state_fn()`` to ``tier``, a manager's local tier, when one of ``signals``
    arrives, at the next step boundary the loop marks with :meth:`should_stop` (see the
    module docstring). Create it with :meth:`CheckpointManager.save_on_signal`.

    ``grace``: seconds from the first signal (on any rank) until the save is given up;
    choose a few seconds less than the platform's (torchrun and GKE 30 s by default,
    AWS spot 120 s). The same signal again after that (a second SIGINT: at any time)
    is handled as before the guard (see the module docstring). ``every``: under a
    process group, the ranks compare notes every ``every`` steps (one all-reduce of four
    numbers; a single process checks its flag on every call for free). ``chain``: after
    the save, hand the signal on to the handler that was installed before (the default
    action for SIGTERM ends the process at once) instead of returning ``True`` to the
    loop.

    Attributes: ``saved``, the step committed locally (``None`` before a signal, or if
    the save failed or ran out of time); ``error``, why it was not; ``requested``,
    whether this rank has received a signal. Use it as a context manager, or call
    :meth:`close`, to put the previous handlers back."""

    def __init__(
        self,
        tier: LocalTier,
        state_fn: Callable[[], dict[str, Any]],
        *,
        signals: Iterable[int] = (signal.SIGTERM,),
        grace: float = 25.0,
        every: int = 1,
        chain: bool = False,
    ) -> None:
        if (
            isinstance(grace, bool)
            or not isinstance(grace, (int, float))
            or not 0 < grace < threading.TIMEOUT_MAX
        ):
            raise ValueError(
                f"grace must be a number of seconds > 0 (the time the scheduler leaves "
                f"between its signal and the kill), got {grace!r}"
            )
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1, got {every!r}")
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("save_on_signal must be called from the main thread (signals)")
        signals = list(dict.fromkeys(signals))
        uncatchable = {signal.SIGKILL, signal.SIGSTOP}
        for sig in signals:
            if isinstance(sig, bool) or sig not in signal.valid_signals() or sig in uncatchable:
                raise ValueError(
                    f"signals: {sig!r} is not a signal a handler can catch; nothing was "
                    "installed. Pass signal numbers such as signal.SIGTERM or signal.SIGUSR1"
                )
        self.tier, self.state_fn = tier, state_fn
        self.grace, self.every, self.chain = float(grace), every, chain
        self.saved: int | None = None
        self.error: BaseException | None = None
        self._signal: tuple[int, float] | None = None  # (signal number, monotonic time)
        self._seen: set[int] = set()  # the signals received
        self._stopped = False
        self._deadline: float | None = None
        self._pg: Any = None
        self._pid = os.getpid()  # a child forked from it inherits the handlers, not the guard
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._pg = dist.new_group(backend="gloo")  # collective, like the manager
        self._previous: dict[int, Handler] = {}
        try:
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._record)
        except BaseException:
            # Else the handlers installed so far stay with a guard nobody holds: those
            # signals would be recorded for ever and never end the process.
            self.close()
            raise

    # --- the handler: record, nothing else ---------------------------------------------

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:
            # A child forked from the trainer (a DataLoader worker, a multiprocessing
            # Process): no step boundary of its own ever reads the flag, so it handles
            # the signal as before the guard (SIGTERM's default: it ends).
            self._as_before(signum, frame)
            return
        now = time.monotonic()
        repeated = signum in self._seen
        self._seen.add(signum)
        if self._signal is None:
            self._signal = (signum, now)
        elif repeated and (signum == signal.SIGINT or now >= self._given_up_at()):
            # A second Ctrl-C, or the same signal again once the grace period is over:
            # the job is stuck in a step or in the save (no step boundary came, or the
            # save outlived its deadline). Whoever sends it wants the process to act as
            # before the guard, not to wait for a boundary that may never come.
            log.warning(
                "signal %d again%s: handled as before save_on_signal (the guard gives it up)",
                signum,
                "" if signum == signal.SIGINT else " after the grace period",
            )
            self._as_before(signum, frame)

    def _given_up_at(self) -> float:
        """When the preemption save is given up: the deadline the ranks agreed on, or,
        before a step boundary did, ``grace`` after this rank's first signal."""
        assert self._signal is not None
        return self._deadline if self._deadline is not None else self._signal[1] + self.grace

    def _as_before(self, signum: int, frame: FrameType | None) -> None:
        """Handle ``signum`` as the process did before the guard, from now on: its
        previous handler is put back and called, or its default action taken (SIGTERM,
        SIGINT without Python's handler: the process ends); an ignored signal stays
        ignored."""
        previous = self._previous.get(signum)
        signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        if callable(previous):
            previous(signum, frame)
        elif previous in (None, signal.SIG_DFL):
            signal.raise_signal(signum)

    @property
    def requested(self) -> bool:
        """Whether this rank has received one of the signals."""
        return self._signal is not None

    def remaining(self) -> float | None:
        """Seconds left of the grace period (``None`` before the ranks agreed to stop)."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    # --- the step boundary ---------------------------------------------------------------

    def should_stop(self, step: int) -> bool:
        """Call once per step, on every rank, when ``step``'s update is done (the state
        is the state of ``step``). Returns ``False`` until a signal has arrived on some
        rank; then saves ``state_fn()`` as ``step`` on every rank (see the class) and
        returns ``True``, and ``True`` on every later call. Collective every ``every``
        steps under a process group; raises ``RuntimeError`` if the ranks are at
        different steps."""
        if self._stopped:
            return True
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if self._pg is None:
            age = None if self._signal is None else time.monotonic() - self._signal[1]
        elif step % self.every:
            return False
        else:
            age = self._agree(step)
        if age is None:
            return False
        self._stopped = True
        self._deadline = time.monotonic() + self.grace - age
        try:
            self._save(step)
        finally:
            self._hand_on()
        return True

    def _agree(self, step: int) -> float | None:
        """The age of the earliest signal on any rank (``None``: no rank has one)."""
        age = 0.0 if self._signal is None else time.monotonic() - self._signal[1]
        notes = torch.tensor([self._signal is not None, step, -step, age], dtype=torch.float64)
        dist.all_reduce(notes, op=dist.ReduceOp.MAX, group=self._pg)
        seen, highest, lowest, oldest = notes.tolist()
        if highest != -lowest:
            raise RuntimeError(
                f"should_stop was called at steps {-lowest:.0f} to {highest:.0f} on different "
                "ranks; call it at the same step boundary on every rank"
            )
        return oldest if seen else None

    def _everywhere(self, ready: bool, needed: bool) -> tuple[bool, bool]:
        """Whether every rank is ``ready``, and whether any rank finds the save
        ``needed`` (collective under a process group)."""
        if self._pg is None:
            return ready, needed
        notes = torch.tensor([ready, not needed], dtype=torch.int32)
        dist.all_reduce(notes, op=dist.ReduceOp.MIN, group=self._pg)
        return bool(notes[0]), not bool(notes[1])

    def _save(self, step: int) -> None:
        tier = self.tier
        assert self._deadline is not None
        started = time.monotonic()
        try:
            ready = bool(self._left()) and tier.finish_commit(timeout=self._left())
            ready, needed = self._everywhere(ready, tier.last_commit != step)
            if not ready:
                # Every rank decides alike (on its own clock, one could find time left
                # and enter the save's collectives, which the others never join).
                raise DeadlineExceededError(
                    f"timed out: the first step boundary after the signal, or the save in "
                    f"flight to {tier.local.url} before it, ended {self.grace:g} s or more "
                    f"after the signal on some rank (grace=); step {step} is not saved"
                )
            if needed:  # on every rank where any has not committed this step
                state: dict[str, Any] = {}
                failure: Exception | None = None
                try:
                    state = self.state_fn()
                except Exception as exc:  # every rank hears of it before any saves
                    failure = exc
                if not self._everywhere(failure is None, False)[0]:
                    raise failure or RuntimeError(
                        f"state_fn failed on another rank; step {step} is not saved"
                    )
                future = tier.save_by(step, state, self._deadline)
                if not concurrent.futures.wait([future], self._left()).done:
                    raise DeadlineExceededError(
                        f"the preemption save of step {step} to {tier.local.url} timed out: it did "
                        f"not finish within the {self.grace:g} s grace period; it publishes nothing"
                    )
                future.result()
            self.saved = step
            log.warning(
                "preempted: step %d is committed in %s (%.3f s); it drains to %s in the "
                "background or at the next start",
                step,
                tier.local.url,
                time.monotonic() - started,
                tier.root.url,
            )
        except Exception as exc:
            self.error = exc
            log.error("preempted: step %d could not be saved: %s", step, exc)

    def _left(self) -> float:
        assert self._deadline is not None
        return max(0.0, self._deadline - time.monotonic())

    # --- after the save --------------------------------------------------------------------

    def drain(self) -> bool:
        """Wait for the drain of the step saved, at most until the grace period ends;
        returns whether it is durable by then (a drain's error is logged, not raised).
        Call it before tearing down the process group: the drain's collectives use it."""
        if self.saved is None:
            return False
        tier = self.tier
        errors: list[BaseException] = []

        def wait() -> None:
            try:
                tier.wait()
            except Exception as exc:
                errors.append(exc)

        waiter = threading.Thread(target=wait, name="dcp-preemption-drain", daemon=True)
        waiter.start()
        waiter.join(self._left())
        if errors:
            log.error("preempted: the drain of step %d failed: %s", self.saved, errors[0])
        try:
            return not waiter.is_alive() and tier.durable(self.saved)
        except Exception:
            return False

    def _hand_on(self) -> None:
        previous = dict(self._previous)
        self.close()
        if not self.chain or self._signal is None:
            return
        signum = self._signal[0]
        handler = previous[signum]
        if handler == signal.SIG_DFL:
            signal.raise_signal(signum)
        elif callable(handler):
            handler(signum, None)

    def close(self) -> None:
        """Put back the handlers that were installed before (idempotent)."""
        if not self._previous or threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
        if self._signal is not None and not self._stopped:
            log.warning(
                "signal %d arrived but no step boundary acted on it (should_stop was not "
                "called after it); nothing was saved for it",
                self._signal[0],
            )

    def __enter__(self) -> PreemptionGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
