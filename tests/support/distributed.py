"""Process-group plumbing shared by the multi-rank tests (gloo on CPU)."""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import multiprocessing.context
import os
import sys
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


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


# Ranks start from a fork server that has imported torch and this project once, so a rank
# begins in well under a second instead of importing torch afresh (~4 s of CPU each: an
# 8-rank test spent most of its time there). What a fork server child does not inherit
# from the test is its environment (the server keeps the one it started with), so each
# rank is handed the test's environment and sets it before the body runs.
_PRELOAD = [
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "pytest",
    "storage",
    "tests.support.distributed",
]


def _context() -> multiprocessing.context.ForkServerContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _with_environment(rank: int, fn: Callable[..., None], env: dict[str, str], *args: Any) -> None:
    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)


def spawn(
    fn: Callable[..., None], args: tuple[Any, ...] = (), nprocs: int = 2, join: bool = True
) -> Any:
    """``torch.multiprocessing.spawn`` for the tests' ranks: ``fn(rank, *args)`` in
    ``nprocs`` processes from the fork server, raising what a rank raised."""
    _context()
    return mp.start_processes(
        _with_environment,
        args=(fn, dict(os.environ), *args),
        nprocs=nprocs,
        join=join,
        start_method="forkserver",
    )


def _run_target(fn: Callable[..., None], env: dict[str, str], *args: Any) -> None:
    os.environ.clear()
    os.environ.update(env)
    fn(*args)


def process(target: Callable[..., None], args: tuple[Any, ...] = ()) -> BaseProcess:
    """One process from the fork server running ``target(*args)`` in the test's environment."""
    return _context().Process(target=_run_target, args=(target, dict(os.environ), *args))


def queue() -> Any:
    """A queue the processes of :func:`process` can share."""
    return _context().Queue()
