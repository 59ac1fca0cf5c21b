"""A child made with ``fork`` while a thread of its parent stages: what it inherits of the
staging pool's copy threads must not hang its exit, when the inherited atexit hook
closes the pool (the parent's threads are not in the child)."""

from __future__ import annotations

from tests.hostile.test_staging_memory import FORK_AND_EXIT, _run

_FORK_WHILE_SUBMITTING = (
    """
import os, sys, threading, time, torch
from storage.checkpoint.persist import _pool
torch.set_num_threads(1)  # the copies run on the pool's copy threads
pool = _pool.StagingPool(copy_threads=2)
pool.stage({"w": torch.ones(1024, 1024)})
executor = pool._copies._executor
assert executor is not None
held, done = threading.Event(), threading.Event()
def submitting():  # a stage on another thread, handing a piece to a copy thread
    with executor._shutdown_lock:  # what ThreadPoolExecutor.submit holds
        held.set()
        done.wait()
thread = threading.Thread(target=submitting)
thread.start()
held.wait()
"""
    + FORK_AND_EXIT
    + """pool.stage({"w": torch.ones(1024, 1024)})  # the parent's copy threads still work
pool.close()
print("ok")
"""
)


def test_a_child_forked_while_a_stage_hands_out_a_copy_exits() -> None:
    """A thread of the parent stages (torch's asynchronous stager, or a save thread)
    while the training thread forks (DataLoader workers). Before, a child forked while
    that thread was inside the copy threads' ``submit`` inherited the executor's lock
    held, and its exit hung for ever in the atexit hook closing the pool: shutting
    down the executor, whose threads are its parent's, waits for that lock first."""
    assert _run(_FORK_WHILE_SUBMITTING).split() == ["ok"]
