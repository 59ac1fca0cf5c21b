"""Process-group plumbing shared by the multi-rank tests (gloo on CPU)."""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from collections.abc import Iterator

import torch.distributed as dist


@contextlib.contextmanager
def gloo_group(
    rank: int,
    world_size: int,
    store: str,
    *,
    exit_process: bool = True,
    timeout: datetime.timedelta | None = None,
) -> Iterator[None]:
    """Run the body of a spawned worker in a gloo process group, then end the process.

    On success every rank meets at a barrier, destroys the group and exits at once
    (status 0): in the interpreter's own teardown, objects that still hold the group
    (a DeviceMesh, DTensors) destroy gloo's threads in no particular order, which now
    and then aborts the process with 'terminate called without an active exception'.
    So nothing may follow the ``with`` block in the worker. A failing body raises as
    usual, and ``mp.spawn`` reports it. ``exit_process=False`` returns instead, so the
    interpreter's own exit runs (for tests of what happens then; the body must hold
    no DeviceMesh or DTensor). ``timeout`` bounds every collective (torch's default is
    30 minutes): a test whose failure is a hang then fails instead."""
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size, timeout=timeout
    )
    try:
        yield
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()
    if not exit_process:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
