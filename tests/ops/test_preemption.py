"""Preemption saves: the signal handler only records, the step boundary saves to the
local tier with the commit protocol, every rank saves the same step, a deadline
publishes nothing late, and a job killed after SIGTERM resumes bit-exact from its tier."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
import torch
import torch.distributed as dist

from storage.backends._local import LocalFileSystem
from storage.checkpoint.api import load as storage_load
from storage.checkpoint.deadline import DeadlineExceededError
from storage.ops.manager import CheckpointManager
from tests.support.capped_proxy import CappedProxy
from tests.support.distributed import gloo_group, spawn
from tests.support.servers import boto3_client, create_bucket, list_keys, moto_endpoint
from tests.support.subprocess_jobs import REPO, Job, committed_steps
from tests.support.tiers import tiered


class _Disk(LocalFileSystem):
    """Our local backend: data file writes wait for ``gate``, are counted, and the
    first one may send this process a signal (a signal that lands mid-save)."""

    def __init__(self, signal_on_write: int | None = None) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.data_files = 0
        self.signal_on_write = signal_on_write

    @contextlib.contextmanager
    def create_stream(self, path: str, mode: str, *, sync: bool = False) -> Iterator[IO[bytes]]:
        if mode == "wb" and path.endswith(".distcp"):
            assert self.gate.wait(300), "the test never opened the gate"
            self.data_files += 1
            if self.signal_on_write is not None:
                os.kill(os.getpid(), self.signal_on_write)
                self.signal_on_write = None
        with super().create_stream(path, mode, sync=sync) as stream:
            yield stream


@pytest.fixture
def handlers() -> Iterator[list[int]]:
    """SIGTERM handled by a recorder for the test (its calls: the list), then restored."""
    calls: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        yield calls
    finally:
        signal.signal(signal.SIGTERM, previous)


def _loaded(path: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    target = {k: torch.full_like(v, -1.0) for k, v in like.items()}
    storage_load(target, path)
    return target


def test_the_handler_records_and_the_step_boundary_saves_a_consistent_state(
    tmp_path: Path, handlers: list[int]
) -> None:
    mgr = tiered(tmp_path)
    assert mgr.tiers is not None
    state = {"a": torch.zeros(100), "b": torch.zeros(100)}
    recorder = signal.getsignal(signal.SIGTERM)
    with mgr.save_on_signal(lambda: state, grace=30) as guard:
        stopped = None
        for step in range(1, 10):
            state["a"] += 1
            if step == 3:  # lands between the two halves of the update
                os.kill(os.getpid(), signal.SIGTERM)
                assert guard.requested and mgr.tiers.local.steps() == []  # nothing saved yet
            state["b"] += 1
            if guard.should_stop(step):
                stopped = step
                break
        assert (stopped, guard.saved, guard.error) == (3, 3, None)
        assert guard.should_stop(4)  # once stopped, stopped
    assert signal.getsignal(signal.SIGTERM) is recorder and handlers == []  # not chained
    assert mgr.tiers.local.steps() == [3]
    saved = _loaded(tmp_path / "local" / "step-3", state)
    assert torch.equal(saved["a"], torch.full((100,), 3.0))
    assert torch.equal(saved["b"], torch.full((100,), 3.0))  # both halves of step 3
    mgr.wait()
    assert mgr.durable_steps() == [3]


def test_without_a_signal_nothing_is_saved_and_close_restores_the_handler(
    tmp_path: Path, handlers: list[int]
) -> None:
    mgr = tiered(tmp_path)
    recorder = signal.getsignal(signal.SIGTERM)
    guard = mgr.save_on_signal(lambda: {"w": torch.ones(3)})
    assert signal.getsignal(signal.SIGTERM) is not recorder
    assert not any(guard.should_stop(step) for step in range(5))
    guard.close()
    assert signal.getsignal(signal.SIGTERM) is recorder
    assert guard.saved is None and mgr.steps() == []


@pytest.mark.parametrize("chain", [False, True])
def test_chain_hands_the_signal_to_the_previous_handler_after_the_save(
    tmp_path: Path, handlers: list[int], chain: bool
) -> None:
    mgr = tiered(tmp_path)
    guard = mgr.save_on_signal(lambda: {"w": torch.ones(3)}, chain=chain)
    os.kill(os.getpid(), signal.SIGTERM)
    assert handlers == []  # our handler took it
    assert guard.should_stop(7) and guard.saved == 7
    assert handlers == ([signal.SIGTERM] if chain else [])


def _signal_in_a_forked_child(signum: int) -> int:
    """Fork; the child raises ``signum`` on itself, then exits with 0 if it is still
    alive: the child's exit code, or minus the signal that ended it."""
    child = os.fork()
    if child == 0:  # only the signal, then _exit: safe in a forked child
        try:
            signal.raise_signal(signum)
        finally:
            os._exit(0)
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_child_forked_under_the_guard_keeps_the_previous_handling_of_the_signal(
    tmp_path: Path,
) -> None:
    """A child forked by the trainer (a DataLoader worker, a multiprocessing Process)
    inherits the guard's handler; the guard is its parent's, so the child must handle the
    signal as before the guard: with SIGTERM's default action it dies. Without it the
    handler only recorded the signal in the child, which nobody reads, so
    ``Process.terminate()`` (SIGTERM) never ended the child and a ``join`` waited for ever."""
    mgr = tiered(tmp_path)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with mgr.save_on_signal(lambda: {"w": torch.ones(3)}) as guard:
            assert _signal_in_a_forked_child(signal.SIGTERM) == -signal.SIGTERM
            assert not guard.requested and not guard.should_stop(1)  # the parent got none
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_child_forked_under_the_guard_hands_the_signal_to_the_previous_handler(
    tmp_path: Path,
) -> None:
    """As above, with a handler the program installed before the guard: the child runs it."""
    mgr = tiered(tmp_path)

    def exit_3(signum: int, frame: object) -> None:
        os._exit(3)

    previous = signal.signal(signal.SIGTERM, exit_3)
    try:
        with mgr.save_on_signal(lambda: {"w": torch.ones(3)}) as guard:
            assert _signal_in_a_forked_child(signal.SIGTERM) == 3
            assert not guard.requested
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_save_in_flight_is_finished_first_and_the_same_step_is_not_saved_again(
    tmp_path: Path, handlers: list[int]
) -> None:
    disk = _Disk()
    mgr = tiered(tmp_path, local_filesystem=disk)
    state = {"w": torch.full((1000,), 4.0)}
    guard = mgr.save_on_signal(lambda: state, grace=30)
    disk.gate.clear()
    future = mgr.save(4, state, blocking=False)
    assert future is not None
    os.kill(os.getpid(), signal.SIGTERM)
    threading.Timer(0.3, disk.gate.set).start()  # the save in flight ends while we wait
    assert guard.should_stop(4)
    assert future.done() and guard.saved == 4 and disk.data_files == 1  # saved once
    assert mgr.tiers is not None and mgr.tiers.local.steps() == [4]


def test_a_save_in_flight_of_an_older_step_does_not_race_the_preemption_save(
    tmp_path: Path, handlers: list[int]
) -> None:
    disk = _Disk()
    mgr = tiered(tmp_path, local_filesystem=disk)
    state = {"w": torch.full((1000,), 4.0)}
    guard = mgr.save_on_signal(lambda: state, grace=30)
    disk.gate.clear()
    future = mgr.save(4, state, blocking=False)  # staged: step 4's values
    assert future is not None
    state["w"].fill_(5.0)
    os.kill(os.getpid(), signal.SIGTERM)
    threading.Timer(0.3, disk.gate.set).start()
    assert guard.should_stop(5) and guard.saved == 5 and future.exception() is None
    assert mgr.tiers is not None and mgr.tiers.local.steps() == [4, 5]
    for step in (4, 5):
        got = _loaded(tmp_path / "local" / f"step-{step}", state)["w"]
        assert torch.equal(got, torch.full((1000,), float(step)))


def test_a_signal_during_a_blocking_save_lets_it_commit_and_is_acted_on_after(
    tmp_path: Path, handlers: list[int]
) -> None:
    disk = _Disk(signal_on_write=signal.SIGTERM)
    mgr = tiered(tmp_path, local_filesystem=disk)
    state = {"w": torch.full((1000,), 2.0)}
    guard = mgr.save_on_signal(lambda: state, grace=30)
    mgr.save(2, state)  # the signal lands while its data file is written
    assert guard.requested and disk.data_files == 1
    assert guard.should_stop(2) and guard.saved == 2
    assert disk.data_files == 1  # step 2 was committed already: not saved again
    assert mgr.tiers is not None and mgr.tiers.local.steps() == [2]


def test_past_the_deadline_the_save_publishes_nothing_and_control_returns(
    tmp_path: Path, handlers: list[int]
) -> None:
    disk = _Disk()
    mgr = tiered(tmp_path, local_filesystem=disk)
    assert mgr.tiers is not None
    # The grace period runs from the signal: one shorter than a loaded machine may hold
    # this thread before the step boundary below would start no save at all.
    guard = mgr.save_on_signal(lambda: {"w": torch.ones(1000)}, grace=5.0)
    disk.gate.clear()  # the local tier stalls
    os.kill(os.getpid(), signal.SIGTERM)
    assert guard.should_stop(1)
    assert not mgr.tiers.finish_commit(timeout=0)  # returned while the save was stuck
    assert guard.saved is None and isinstance(guard.error, DeadlineExceededError)
    assert "timed out" in str(guard.error)  # a TimeoutError says so
    disk.gate.set()  # the save left behind finishes its writes, then sees the deadline
    assert mgr.tiers.finish_commit(timeout=120)
    assert mgr.steps() == []
    leftovers = list((tmp_path / "local").rglob("*.distcp"))
    assert leftovers == []  # what it wrote is removed
    assert not guard.drain()


def test_a_step_boundary_after_the_grace_period_writes_nothing(
    tmp_path: Path, handlers: list[int]
) -> None:
    disk = _Disk()
    mgr = tiered(tmp_path, local_filesystem=disk)
    guard = mgr.save_on_signal(lambda: {"w": torch.ones(1000)}, grace=0.05)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.1)  # a long training step
    assert guard.should_stop(1) and guard.saved is None
    assert isinstance(guard.error, DeadlineExceededError)
    assert "timed out" in str(guard.error)  # a TimeoutError says so
    assert mgr.tiers is not None and mgr.tiers.finish_commit(timeout=0)  # nothing started
    assert disk.data_files == 0 and mgr.steps() == []


# The second signal: a job whose first signal asked for a save and which is stuck (in a
# step, in the save) must still be stoppable the way it was before the guard.
_SIGNALLED_TWICE = """
import os, signal, sys, time
from pathlib import Path
import torch
from tests.support.tiers import tiered
signum, grace = getattr(signal, sys.argv[2]), float(sys.argv[3])
# As in a terminal (a shell's background job starts with SIGINT ignored).
signal.signal(signum, signal.SIG_DFL if signum == signal.SIGTERM else signal.default_int_handler)
mgr = tiered(Path(sys.argv[1]))
guard = mgr.save_on_signal(lambda: {"w": torch.ones(3)}, signals=(signum,), grace=grace)
os.kill(os.getpid(), signum)
assert guard.requested
time.sleep(0.05)  # a step that hangs: with grace=0.001 the grace period is over after it
try:
    os.kill(os.getpid(), signum)  # the second signal, still in that step
except KeyboardInterrupt:
    print("@interrupted", flush=True)
    sys.exit(0)
print("@alive", guard.should_stop(1), guard.saved, flush=True)
"""


@pytest.mark.parametrize(
    ("name", "grace", "ends"),
    [
        ("SIGTERM", 0.001, "killed"),  # past the grace period: SIGTERM's default action
        ("SIGTERM", 3600, "@alive True 1"),  # within it: the save at the step boundary
        ("SIGINT", 3600, "@interrupted"),  # a second Ctrl-C: KeyboardInterrupt at once
    ],
)
def test_a_second_signal_is_handled_as_before_the_guard_once_the_save_is_given_up(
    tmp_path: Path, name: str, grace: float, ends: str
) -> None:
    """A job that got its first signal and then hangs in a step (or in the save) gets a
    second one. Before, every signal after the first was only recorded until the next
    step boundary, even past the grace period: a job stuck in a step could be stopped by
    SIGKILL only, and a second Ctrl-C did nothing. Now the same signal again once the
    grace period is over (SIGINT: at any time) gets the handling the process had before
    the guard (here SIGTERM's default action, Python's KeyboardInterrupt); within the
    grace period a repeated SIGTERM still waits for the step boundary's save."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", _SIGNALLED_TWICE, str(tmp_path), name, str(grace)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if ends == "killed":
        assert done.returncode == -signal.SIGTERM, done.stdout + done.stderr
        assert "@alive" not in done.stdout
        assert "signal 15 again after the grace period" in done.stderr
    else:
        assert done.returncode == 0, done.stderr
        assert done.stdout.split("\n")[0] == ends


def test_a_second_signal_past_the_grace_period_goes_to_the_previous_handler(
    tmp_path: Path, handlers: list[int]
) -> None:
    """As above, in process, with a handler the program installed before the guard: the
    second SIGTERM past the grace period is handed to it (and it stays installed); the
    first one still made the step boundary act."""
    mgr = tiered(tmp_path)
    recorder = signal.getsignal(signal.SIGTERM)
    guard = mgr.save_on_signal(lambda: {"w": torch.ones(3)}, grace=0.001)
    os.kill(os.getpid(), signal.SIGTERM)
    assert handlers == []
    time.sleep(0.05)  # the grace period is over after it
    os.kill(os.getpid(), signal.SIGTERM)
    assert handlers == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is recorder
    assert guard.should_stop(1) and guard.saved is None  # given up: past the deadline
    assert isinstance(guard.error, DeadlineExceededError)


def test_save_on_signal_needs_a_tiered_manager_and_sane_options(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a tiered manager"):
        CheckpointManager(tmp_path / "plain").save_on_signal(dict)
    mgr = tiered(tmp_path)
    with pytest.raises(ValueError, match="grace"):
        mgr.save_on_signal(dict, grace=0)
    with pytest.raises(ValueError, match="every"):
        mgr.save_on_signal(dict, every=0)


@pytest.mark.parametrize("bad", [signal.SIGKILL, signal.SIGSTOP, 0, 100000, True])
def test_a_signal_no_handler_can_catch_is_refused_and_installs_nothing(
    tmp_path: Path, bad: int
) -> None:
    """``signals=(SIGTERM, SIGKILL)`` is refused by name, before any handler is
    installed. Without the check ``signal.signal`` raised a bare ``OSError`` for SIGKILL
    after SIGTERM's handler was in place, held by a guard the caller never got: every
    later SIGTERM was recorded there and never ended the process."""
    mgr = tiered(tmp_path)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ValueError, match="not a signal a handler can catch; nothing was"):
        mgr.save_on_signal(dict, signals=(signal.SIGTERM, bad))
    assert signal.getsignal(signal.SIGTERM) is before


# --- several ranks, in process --------------------------------------------------------------


def _agree_worker(rank: int, store: str, base: str) -> None:
    with gloo_group(rank, 2, store):
        mgr = CheckpointManager(f"{base}/durable", local=f"{base}/local")
        state = {f"r{rank}": torch.zeros(100)}
        guard = mgr.save_on_signal(lambda: state, grace=30)
        stopped = None
        for step in range(1, 20):
            state[f"r{rank}"] += 1
            if rank == 1 and step == 3:  # only rank 1 is told
                os.kill(os.getpid(), signal.SIGTERM)
            if guard.should_stop(step):
                stopped = step
                break
        assert (stopped, guard.saved) == (3, 3)  # rank 0 stops at the same step
        mgr.wait()
        target = {f"r{rank}": torch.zeros(100)}
        assert mgr.load(target) == 3 and torch.equal(target[f"r{rank}"], torch.full((100,), 3.0))
        second = mgr.save_on_signal(lambda: state)
        with pytest.raises(RuntimeError, match="at steps 5 to 6 on different ranks"):
            second.should_stop(5 + rank)
        second.close()


def test_two_ranks_stop_at_the_same_step_when_one_is_signalled(tmp_path: Path) -> None:
    spawn(_agree_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)


def _late_worker(rank: int, store: str, base: str) -> None:
    with gloo_group(rank, 2, store):
        disk = _Disk()
        mgr = CheckpointManager(
            f"{base}/durable", local=f"{base}/node{rank}", local_filesystem=disk
        )
        assert mgr.tiers is not None
        guard = mgr.save_on_signal(lambda: {f"r{rank}": torch.ones(100)}, grace=1)
        if rank == 1:
            disk.gate.clear()  # rank 1's tier stalls: it cannot save in time
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.should_stop(1)  # both ranks get control back at the deadline
        assert guard.saved is None and isinstance(guard.error, DeadlineExceededError)
        disk.gate.set()  # rank 1's writes land late; every rank then sees the deadline
        assert mgr.tiers.finish_commit(timeout=60)
        dist.barrier()
        for node in (0, 1):  # rank 0 wrote its part in time, and removed it all the same
            assert committed_steps(Path(base) / f"node{node}") == []
            assert list((Path(base) / f"node{node}").rglob("*.distcp")) == []


def test_a_rank_that_cannot_save_in_time_leaves_no_step_committed_anywhere(
    tmp_path: Path,
) -> None:
    spawn(_late_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)


def _skewed_worker(rank: int, store: str, base: str) -> None:
    import types

    from storage.ops import preemption

    with gloo_group(rank, 2, store):
        mgr = CheckpointManager(f"{base}/durable", local=f"{base}/node{rank}")
        guard = mgr.save_on_signal(lambda: {f"r{rank}": torch.ones(100)}, grace=30)
        if rank == 1:
            # Rank 1 stalls past the grace period right after the ranks agreed on the
            # deadline (its clock jumps 60 s once the deadline is set), rank 0 does not.
            preemption.time = types.SimpleNamespace(  # type: ignore[assignment]
                monotonic=lambda: time.monotonic() + (60 if guard._deadline else 0)
            )
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.should_stop(1)
        # Before: each rank judged "too late" on its own clock, so rank 0 found time left
        # and entered the save's collectives, which rank 1, giving up, never joined: its
        # save thread hung there, and its error was the save's own timeout.
        assert guard.saved is None and isinstance(guard.error, DeadlineExceededError)
        assert "on some rank" in str(guard.error)
        dist.barrier()
        assert committed_steps(Path(base) / f"node{rank}") == []
        assert list((Path(base) / f"node{rank}").rglob("*.distcp")) == []


def test_ranks_whose_clocks_disagree_on_the_deadline_all_give_up_the_save(
    tmp_path: Path,
) -> None:
    spawn(_skewed_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)


def _failing_state_worker(rank: int, store: str, base: str) -> None:
    with gloo_group(rank, 2, store):
        mgr = CheckpointManager(f"{base}/durable", local=f"{base}/node{rank}")

        def state() -> dict[str, torch.Tensor]:
            if rank == 1:
                raise ValueError("this rank's state cannot be built")
            return {f"r{rank}": torch.ones(100)}

        guard = mgr.save_on_signal(state, grace=30)
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.should_stop(1)
        # Before: rank 1's state_fn raised and it gave up, while rank 0 entered the
        # save's collectives alone: its save thread waited there until the deadline.
        assert guard.saved is None
        expected = "cannot be built" if rank == 1 else "state_fn failed on another rank"
        assert expected in str(guard.error)
        dist.barrier()
        assert committed_steps(Path(base) / f"node{rank}") == []


def test_a_state_fn_that_fails_on_one_rank_starts_the_save_on_none(tmp_path: Path) -> None:
    spawn(_failing_state_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)


# --- a job killed after SIGTERM, restarted ---------------------------------------------------

BUCKET = "dcp-preempt"


def test_sigterm_then_sigkill_resumes_bit_exact_and_drains_at_the_next_start(
    tmp_path: Path,
) -> None:
    endpoint = moto_endpoint()
    create_bucket(endpoint, BUCKET)
    root = f"s3://{BUCKET}/{tmp_path.name}"
    local = str(tmp_path / "local")
    job = ["--root", root, "--local", local, "--save-every", "4", "--async", "--guard"]
    job += ["--grace", "120"]  # a deadline for the preemption save that load cannot reach
    # The bucket is slow during the first run (100 kB/s), so nothing it saves is durable
    # by the kill: the preempted step can only reach the bucket at the next start.
    with CappedProxy(endpoint, rate=100e3, latency=0.0, burst=16 << 10) as slow:
        run = Job(tmp_path, 1, [*job, "--endpoint", slow.url, "--steps", "1000"])
        run.wait_for(0, "@step 6")  # its handler is installed before its first step
        # Killed as soon as it reports the preemption save, its drain still in flight.
        run.terminate_then_kill([0], once="@preempted")
        _, step_word, saved = run.one(0, "@preempted", 3)
        hashes = run.hashes(0)
    assert saved == step_word, f"the preemption save failed:\n{run.report()}"
    step = int(step_word)
    assert step >= 6
    assert step in committed_steps(Path(local) / "node0")
    assert f"{tmp_path.name}/step-{step}/.metadata" not in list_keys(
        boto3_client(endpoint), BUCKET, tmp_path.name
    )
    resumed = Job(tmp_path, 1, [*job, "--endpoint", endpoint, "--steps", str(step + 2)])
    resumed.finish()
    loaded = resumed.one(0, "@loaded", 5)
    assert loaded[1:4] == [str(step), "local", hashes[step]]  # bit-exact
    durable = resumed.one(0, "@durable", 2)
    assert str(step) in durable[1].split(",")  # drained at the next start
    fresh = ["--root", str(tmp_path / "ref"), "--local", str(tmp_path / "ref-local")]
    reference = Job(tmp_path, 1, [*fresh, "--steps", str(step + 2)])
    reference.finish()
    assert resumed.hashes(0)[step + 2] == reference.hashes(0)[step + 2]  # as if never stopped


def test_two_ranks_signalled_apart_save_one_step_and_resume_from_it(tmp_path: Path) -> None:
    local = tmp_path / "local"
    job = ["--root", str(tmp_path / "durable"), "--local", str(local), "--ranks-per-node", "2"]
    job += ["--save-every", "3", "--async", "--guard", "--grace", "120"]
    run = Job(tmp_path, 2, [*job, "--steps", "1000"])
    run.wait_for(0, "@step 5")  # both ranks' handlers are installed before their first step
    run.terminate_then_kill([1, 0], once="@preempted", apart=0.3)  # rank 1 first, then 0
    preempted = [run.one(r, "@preempted", 3) for r in (0, 1)]
    steps = {int(words[1]) for words in preempted}
    saved = {words[2] for words in preempted}
    assert len(steps) == 1 and saved == {str(s) for s in steps}, run.report()  # on both
    (step,) = steps
    hashes = run.hashes(0)
    assert step in committed_steps(local / "node0")
    resumed = Job(tmp_path, 2, [*job, "--steps", str(step + 1)])
    resumed.finish()
    loaded = resumed.one(0, "@loaded", 5)
    assert loaded[1:4] == [str(step), "local", hashes[step]]
    durable = resumed.one(0, "@durable", 2)
    assert str(step) in durable[1].split(",")
