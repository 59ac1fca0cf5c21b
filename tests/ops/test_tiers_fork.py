"""A tiered manager in a child made with ``fork``: refused at once, saying why, instead
of a save that waits for ever on the parent's threads."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import torch

from tests.checkpoint.test_thread_staging import wait_exit
from tests.support.tiers import step_state, tiered


def test_a_forked_child_is_told_to_make_its_own_tiered_manager(tmp_path: Path) -> None:
    """The parent's save and drain threads are not in the child: an asynchronous save
    there was queued to a pool with no thread and never resolved."""
    mgr = tiered(tmp_path, keep_local=1)
    mgr.save(1, step_state(1), blocking=False).result()  # type: ignore[union-attr]
    mgr.wait()
    pid = os.fork()
    if pid == 0:  # the child: each entry point refuses, naming the fix
        code = 1
        try:
            torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork
            refused = 0
            for call in (
                lambda: mgr.save(2, step_state(2), blocking=False),
                mgr.wait,
                lambda: mgr.load(step_state(0)),
            ):
                try:
                    call()
                except RuntimeError as exc:
                    refused += "make a CheckpointManager in the child" in str(exc)
            code = 0 if refused == 3 else 2
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    assert wait_exit(pid, timeout=60) == 0
    mgr.save(2, step_state(2))  # the parent's manager still saves
    mgr.wait()
    assert mgr.durable_steps() == [1, 2]
