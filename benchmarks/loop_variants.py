"""The checkpointing variants that ``benchmarks/training_loop.py`` runs side by side.

A variant is made by a factory from a :class:`Context` and does two things:
``save(step, state)`` on the training thread at each checkpoint (all the time it takes
there counts as the stall; ``state()`` builds the state dict, as a job would) and
``finish()`` after the last step, which returns once every checkpoint it started is
committed in the bucket and raises if one failed. Each variant writes step ``N`` under
``ctx.step_url(N)`` with a ``.metadata`` object committed last: the driver watches for
that object to time when a checkpoint became durable, the same way for every variant.

To add one, write a factory and put it in :data:`VARIANTS` (or in ``EXTRA`` from a
module of your own, imported here): ``VARIANTS["name"] = lambda ctx: MyVariant(ctx)``.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

REGION = "us-east-1"
KEY = SECRET = "testing"
State = Callable[[], dict[str, Any]]


@dataclass
class Context:
    """What a variant gets: where to write and the job it checkpoints."""

    endpoint: str  # the S3 endpoint the job uses (the capped proxy with --capped)
    root: str  # s3://bucket/prefix of this variant's run
    local_dir: str  # a node-local directory for a local tier (empty, removed afterwards)
    rank: int
    world: int
    state: State  # the job's state dict (model and optimizer), as save() gets it
    # A gloo group for checkpoint collectives that run beside training: a background
    # save's collectives on the default group would interleave with DDP's all-reduces
    # (gloo aborts on the mismatch), so torch's docs give async_save a group of its own.
    group: Any = None
    thread_count: int = 8  # for the peers' writers (ours keeps its own default)

    def step_url(self, step: int) -> str:
        return f"{self.root}/step-{step}"

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint, "key": KEY, "secret": SECRET}


class Variant(Protocol):
    def save(self, step: int, state: State) -> None: ...

    def finish(self) -> None: ...


class NoCheckpoint:
    """The baseline: no checkpoint."""

    def __init__(self, ctx: Context) -> None:
        pass

    def save(self, step: int, state: State) -> None:
        pass

    def finish(self) -> None:
        pass


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nested state dict."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in tensors_of(v)]
    return []


class StagingFloor:
    """The floor: at each checkpoint, copy the state's tensors into
    staging buffers allocated (and touched) once, and nothing else. The least any
    checkpoint can block; nothing is written, so nothing becomes durable."""

    def __init__(self, ctx: Context) -> None:
        # Parameters and optimizer state are updated in place: the same tensors all run.
        self.sources = tensors_of(ctx.state())
        t0 = time.perf_counter()
        self.buffers = [torch.empty_like(t) for t in self.sources]
        self.save(0, ctx.state)
        #: The first copy, into memory never touched (each page faulted in as it is
        #: written): the least a job's first checkpoint can block, where nothing was
        #: staged before it.
        self.cold_copy = time.perf_counter() - t0

    def save(self, step: int, state: State) -> None:
        for src, dst in zip(self.sources, self.buffers):
            dst.copy_(src)

    def finish(self) -> None:
        pass


def _upload(response: Any) -> Future[Any]:
    """The future of the upload: ``dcp.async_save`` returns it, or a response holding it."""
    return getattr(response, "upload_completion", response)  # type: ignore[no-any-return]


class _Async:
    """Waits for the previous checkpoint before starting the next (one in flight, as
    torch's docs and our manager do); the wait is part of the stall."""

    def __init__(self) -> None:
        self.pending: list[Future[Any]] = []

    def wait_previous(self) -> None:
        if self.pending:
            self.pending[-1].result()

    def finish(self) -> None:
        for fut in self.pending:
            fut.result()


class StockSync:
    """Stock ``dcp.save`` with ``FsspecWriter`` (s3fs)."""

    def __init__(self, ctx: Context) -> None:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        self.ctx, self.writer = ctx, FsspecWriter

    def save(self, step: int, state: State) -> None:
        url = self.ctx.step_url(step)
        writer = self.writer(url, thread_count=self.ctx.thread_count, **self.ctx.storage_options)
        dcp.save(state(), storage_writer=writer)

    def finish(self) -> None:
        pass


class StockAsync(_Async):
    """Stock ``dcp.async_save`` with ``FsspecWriter``, thread or process executor."""

    def __init__(self, ctx: Context, kind: AsyncCheckpointerType) -> None:
        super().__init__()
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        self.ctx, self.kind, self.writer = ctx, kind, FsspecWriter

    def save(self, step: int, state: State) -> None:
        self.wait_previous()
        url = self.ctx.step_url(step)
        writer = self.writer(url, thread_count=self.ctx.thread_count, **self.ctx.storage_options)
        fut = dcp.async_save(
            state(),
            storage_writer=writer,
            async_checkpointer_type=self.kind,
            process_group=self.ctx.group,
        )
        self.pending.append(_upload(fut))


class S3ConnectorAsync(_Async):
    """s3torchconnector's ``S3StorageWriter`` (its CRT client) with ``dcp.async_save``."""

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        import s3torchconnector.dcp.s3_file_system as s3tc_fs
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3StorageWriter

        # Its DCP filesystem builds S3Client(region, ...) without an endpoint.
        s3tc_fs.S3Client = functools.partial(S3Client, endpoint=ctx.endpoint)  # type: ignore[misc,assignment]
        os.environ.setdefault("AWS_ACCESS_KEY_ID", KEY)
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", SECRET)
        self.ctx, self.writer = ctx, S3StorageWriter
        self.config = S3ClientConfig(force_path_style=True)

    def save(self, step: int, state: State) -> None:
        self.wait_previous()
        writer = self.writer(
            REGION,
            self.ctx.step_url(step),
            s3client_config=self.config,
            thread_count=self.ctx.thread_count,
        )
        fut = dcp.async_save(state(), storage_writer=writer, process_group=self.ctx.group)
        self.pending.append(_upload(fut))


class Ours:
    """Ours through a ``CheckpointManager`` on the bucket: blocking ``save``,
    ``save(blocking=False)``, or with a local tier (``local=``, ``keep_local=2``) whose
    drain copies each step to the bucket; ``persist`` as the manager takes it (``None``:
    the default, the persist worker process where the host has a core beyond one per
    rank, else threads) and other writer ``options``."""

    def __init__(
        self,
        ctx: Context,
        *,
        blocking: bool,
        tiered: bool = False,
        persist: str | None = None,
        **options: Any,
    ) -> None:
        import storage

        local: dict[str, Any] = {"local": ctx.local_dir, "keep_local": 2} if tiered else {}
        self.manager = storage.CheckpointManager(
            ctx.root, storage_options=ctx.storage_options, persist=persist, **local, **options
        )
        self.blocking = blocking
        self.pending: list[Future[None]] = []

    def save(self, step: int, state: State) -> None:
        fut = self.manager.save(step, state(), blocking=self.blocking)
        if fut is not None:
            self.pending.append(fut)

    def finish(self) -> None:
        for fut in self.pending:
            fut.result()
        self.manager.wait()  # a tiered manager: its drains, raising a failed one's error


Factory = Callable[[Context], Variant]

VARIANTS: dict[str, Factory] = {
    "none": NoCheckpoint,
    "floor": StagingFloor,
    "stock sync": StockSync,
    "stock async": lambda ctx: StockAsync(ctx, AsyncCheckpointerType.THREAD),
    "stock async process": lambda ctx: StockAsync(ctx, AsyncCheckpointerType.PROCESS),
    "s3tc async": S3ConnectorAsync,
    "ours sync": lambda ctx: Ours(ctx, blocking=True),
    "ours async": lambda ctx: Ours(ctx, blocking=False),
    "ours tiered": lambda ctx: Ours(ctx, blocking=False, tiered=True),
    # Each drain at the link's full speed (a tiered manager paces its drains by default).
    "ours tiered unpaced": lambda ctx: Ours(ctx, blocking=False, tiered=True, pace=None),
    # Every upload at the link's full speed (the manager paces by default: ``pace``).
    "ours async unpaced": lambda ctx: Ours(ctx, blocking=False, pace=None),
    # A smaller share of the interval than the default 0.8: fewer overruns, more slowdown.
    "ours async pace 0.5": lambda ctx: Ours(ctx, blocking=False, pace=0.5),
    "ours async thread": lambda ctx: Ours(ctx, blocking=False, persist="thread"),
    "ours async process": lambda ctx: Ours(ctx, blocking=False, persist="process"),
    "ours tiered thread": lambda ctx: Ours(ctx, blocking=False, tiered=True, persist="thread"),
    "ours tiered sync": lambda ctx: Ours(ctx, blocking=True, tiered=True),
}
# What a run without --variants measures ("none" is always run: the baseline).
DEFAULT = [
    n for n in VARIANTS if n not in ("ours tiered sync", "ours async unpaced", "ours async process")
]
WRITES_NOTHING = {"none", "floor"}  # every other variant commits checkpoints to the bucket
