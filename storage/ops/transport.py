"""``StorageTransport``: recover a replica's state through storage (disk or a bucket).

It has the interface of torchft's ``CheckpointTransport`` (``metadata``,
``send_checkpoint``, ``disallow_checkpoint``, ``recv_checkpoint``, ``shutdown``) without
depending on torchft: a healthy replica writes its state with :class:`CheckpointWriter`
to ``root/replica-{rank}/step-{step}``; a replica that fell behind polls for that
checkpoint to be committed and reads it back, bit for bit, with
:class:`CheckpointReader`. Every call is local to its process (no collectives), so it
works under any process group. A received checkpoint is loaded, its metadata checked,
by :mod:`storage.ops.transport_load`.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from extensions._compat import load_state_dict_without_collectives
from extensions.base import Keys
from extensions.errors import (
    CheckpointNotFoundError,
    IntegrityError,
    UnsafeCheckpointError,
    quote,
)
from extensions.registry import ExtensionRegistry
from storage.backends.base import FileSystemBase
from storage.checkpoint.api import unwrap_checkpoint_exception
from storage.checkpoint.layout import is_committed
from storage.checkpoint.options import resolve_location
from storage.checkpoint.reader import CheckpointReader
from storage.checkpoint.writer import CheckpointWriter
from storage.ops.manager import CheckpointManager
from storage.ops.transport_budget import check_max_bytes
from storage.ops.transport_load import PlainDataPlanner
from storage.ops.transport_shape import (
    SENDER_KEY,
    SHAPE_KEY,
    Shape,
    local,
    rebuild,
    record,
)
from storage.ops.transport_sweep import Sweeper

REPLICA_PREFIX = "replica-"


def _data_files(storage_data: Mapping[Any, Any]) -> set[Any]:
    return {getattr(info, "relative_path", None) for info in storage_data.values()}


def _seconds(timeout: timedelta | float) -> float:
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not seconds >= 0:  # NaN too: no wait ends at it (send's clamp made it none)
        raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
    return seconds


#: The longest wait between two checks for the sender's commit.
_POLL_CAP = 0.25


class StorageTransport:
    """Checkpoint transport through a root URL shared by the replicas.

    ``rank`` is this replica's rank; its checkpoints go to ``root/replica-{rank}``,
    where the newest ``keep_last`` steps are kept. When a replica has several workers,
    give each worker its own root (e.g. ``.../rank-{local_rank}``). ``transforms``,
    ``keys``, ``registry``, ``storage_options`` and the writer options (``thread_count``,
    ...) are as for :class:`CheckpointWriter` / :class:`CheckpointReader`.

    ``send_checkpoint`` writes in a background thread and returns once the checkpoint is
    committed, or raises ``TimeoutError`` after ``timeout`` while the write goes on;
    ``disallow_checkpoint`` waits for that write, after which the caller may change the
    state dict. ``recv_checkpoint`` polls until the sender's checkpoint is committed
    (``TimeoutError`` after ``timeout``) and returns a new state dict.

    ``state_dict``, if given, returns this replica's own state, laid out as the sender
    sends it; a received DTensor is rebuilt on the device mesh of the DTensor at the same
    place in it (else on a mesh rebuilt from the sender's ranks, which a DTensor on a
    slice of a mesh cannot be: see :mod:`~storage.ops.transport_dtensor`); and a
    received tensor whose stored chunks hold less than the size its sender claims (a
    tensor sharded over ranks, of which the sender stores its own shards) is allocated
    only where this state has a tensor of that shape and dtype at the same place (of a
    DTensor, its local shard), else refused
    (:class:`~storage.ops.transport_load.PlainDataPlanner`).

    A receive allocates the tensors its sender's metadata claims only within a budget,
    checked from the claims before any is allocated (a compression bomb's claim is
    refused with ``UnsafeCheckpointError``): ``max_bytes`` where given, else
    4 times the bytes of this replica's own state (``state_dict``) plus 64 MiB, at
    most the memory this process may use (the host's, or its cgroup's limit where
    lower), else that memory (:mod:`~storage.ops.transport_budget`).
    """

    def __init__(
        self,
        root_url: str | os.PathLike[str],
        *,
        rank: int,
        keep_last: int = 1,
        storage_options: dict[str, Any] | None = None,
        transforms: Sequence[Any] | None = None,
        keys: Keys | None = None,
        registry: ExtensionRegistry | None = None,
        filesystem: FileSystemBase | None = None,
        poll_interval: float = 0.05,
        state_dict: Callable[[], Any] | None = None,
        max_bytes: int | None = None,
        **writer_options: Any,
    ) -> None:
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(f"rank must be an int >= 0, got {rank!r}")
        check_max_bytes(max_bytes)
        self.rank = rank
        self.state_dict = state_dict
        self.max_bytes = max_bytes
        self.storage_options = storage_options
        self.keys = keys
        self.registry = registry
        self.poll_interval = poll_interval
        self._explicit_fs = filesystem
        self.fs, self.root = resolve_location(root_url, storage_options, filesystem)
        self._manager = CheckpointManager(
            self.fs.url(self._replica_path(self.fs, self.root, rank)),
            keep_last=keep_last,
            transforms=transforms,
            filesystem=self.fs,
            coordinator=True,  # each replica prunes its own directory
            **writer_options,
        )
        #: Recorded in every step this transport sends: a receiver given it (see
        #: :meth:`recv_replica`) refuses a step of the same number another sender wrote.
        self.sender_id = uuid.uuid4().hex
        self._pid = os.getpid()
        self._executor = self._new_executor()
        self._lock = threading.Lock()
        self._inflight: concurrent.futures.Future[None] | None = None
        self._closed = False
        self._closing = threading.Event()  # wakes the receives waiting for a commit
        self._resolved: dict[str, tuple[FileSystemBase, str]] = {}
        self._sweeper = Sweeper(self._manager)  # what killed sends left (transport_sweep)

    @staticmethod
    def _replica_path(fs: FileSystemBase, root: str, rank: int) -> str:
        return fs.concat_path(root, f"{REPLICA_PREFIX}{rank}")

    # --- CheckpointTransport --------------------------------------------------------

    def metadata(self) -> str:
        """The root URL; a receiving replica passes it to :meth:`recv_checkpoint`."""
        return self.fs.url(self.root)

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta
    ) -> None:
        """Write ``state_dict`` as ``root/replica-{rank}/step-{step}`` (refused, before
        anything is written, where that directory is a symbolic link).

        Any replica may read it, so ``dst_ranks`` only documents who is waiting."""
        seconds = _seconds(timeout)
        self._check_open()
        url = self._manager.step_url(step)
        for reserved in (SHAPE_KEY, SENDER_KEY):
            if reserved in state_dict:
                raise ValueError(
                    f"sending step {step} to {url}: the state dict has a top-level key "
                    f"{reserved!r}, which the transport reserves; rename that key"
                )
        try:
            shape = record(state_dict, "")
        except ValueError as exc:
            raise ValueError(f"sending step {step} to {url}: {exc}") from None
        self._manager.location.refuse_link(step, "remove the link; a replica's steps are its own")
        self._in_this_process()
        with self._lock:
            future = self._executor.submit(self._write, step, state_dict, shape)
            self._inflight = future
            # Apart from the write: the send is done once committed, whatever a sweep takes.
            self._executor.submit(self._sweeper.after, future)
        try:
            # A timeout too far to wait for (timedelta.max) is none: waiting on it
            # would raise OverflowError.
            future.result(timeout=seconds if seconds < threading.TIMEOUT_MAX else None)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"sending step {step} to replicas {list(dst_ranks)} timed out after "
                f"{seconds:g} s: {url} is not committed yet; the write goes on "
                "(disallow_checkpoint() waits for it)"
            ) from None

    def disallow_checkpoint(self) -> None:
        """Wait for the write in flight; then the state dict is no longer read."""
        self._in_this_process()
        with self._lock:
            future = self._inflight
        if future is not None:
            concurrent.futures.wait([future])

    def recv_checkpoint(
        self, src_rank: int, metadata: str, step: int, timeout: timedelta
    ) -> dict[str, Any]:
        """Wait for replica ``src_rank``'s step ``step`` under the root ``metadata``
        (what that replica's :meth:`metadata` returned) and load all of it."""
        seconds = _seconds(timeout)
        self._check_open()
        fs, root = self._location(metadata)
        return self._receive(fs, self._replica_path(fs, root, src_rank), src_rank, step, seconds)

    def replica_url(self) -> str:
        """This replica's own directory, where :meth:`send_checkpoint` writes
        ``step-{step}``; :meth:`recv_replica` reads from such a URL."""
        return self.fs.url(self._replica_path(self.fs, self.root, self.rank))

    def recv_replica(
        self,
        replica_url: str,
        step: int,
        timeout: timedelta,
        *,
        src_rank: int | None = None,
        sender_id: str | None = None,
    ) -> dict[str, Any]:
        """As :meth:`recv_checkpoint`, from the sender's :meth:`replica_url` rather than
        from a root and a rank (``src_rank`` only names the sender in errors). With
        ``sender_id`` (the sender's :attr:`sender_id`), a step there that another
        sender wrote (another job given the same directory, a run before a restart) is
        refused rather than loaded as the sender's."""
        seconds = _seconds(timeout)
        self._check_open()
        fs, path = self._location(replica_url)
        return self._receive(fs, path, src_rank, step, seconds, sender_id)

    def forget_sent(self) -> None:
        """Delete the committed steps in this replica's directory: what an earlier
        process of this rank sent. A receiver polls for the step it is told to heal
        from, so one such step of the same number, left by the run before a restart,
        would be taken for the send it waits for and loaded in its place."""
        for step in self._manager.steps():
            self._manager.delete(step)

    def shutdown(self, wait: bool = True) -> None:
        """Stop accepting work; with ``wait``, finish the write in flight first. A receive
        waiting for a commit stops waiting and raises ``RuntimeError``."""
        self._closed = True
        self._closing.set()
        self._executor.shutdown(wait=wait)

    # --- internals ------------------------------------------------------------------

    def _new_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=f"dcp-storage-send-{self.rank}"
        )

    def _in_this_process(self) -> None:
        """A child made with ``fork`` sends with its own thread: the parent's pool
        thread is not in the child (a send submitted to it would never run, and wait
        out its timeout), nor is the parent's write in flight (the parent finishes it)."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._executor = self._new_executor()
            self._lock = threading.Lock()
            self._inflight = None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the transport for {self.metadata()} is shut down")

    def _receive(
        self,
        fs: FileSystemBase,
        replica: str,
        src_rank: int | None,
        step: int,
        seconds: float,
        sender_id: str | None = None,
    ) -> dict[str, Any]:
        path = fs.concat_path(replica, f"step-{step}")
        url = fs.url(path)
        sender = "the sender" if src_rank is None else f"replica {src_rank}"
        deadline = time.monotonic() + seconds
        delay = self.poll_interval
        while not is_committed(fs, path):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"receiving step {step} from {sender} timed out after {seconds:g} s: "
                    f"no committed checkpoint at {url}; the sender has not committed it "
                    "(is it alive, and writing to the same root?)"
                )
            if self._closing.wait(min(delay, left)):
                raise RuntimeError(
                    f"receiving step {step} from {sender}: the transport for "
                    f"{self.metadata()} was shut down while it waited for {url}"
                )
            # Backs off to a quarter second: a heal waits on the commit it polls for (at
            # 1 s, a receiver noticed a commit 0.76 s late in the healing benchmark).
            delay = min(delay * 2, max(self.poll_interval, _POLL_CAP))
        if fs.is_link(path):  # as a send refuses one: never the sender's
            raise UnsafeCheckpointError(
                f"receiving step {step} from {sender}: {url} is a symbolic link, which no "
                "send writes (a send refuses one); it could point at any checkpoint on the "
                "machine, so nothing was read: remove the link"
            )
        while True:
            reader = self._reader(fs, url)
            try:
                return self._load(reader, url, sender, sender_id)
            except CheckpointNotFoundError:
                # torchft sends a step again when its commit failed (the heal did): the
                # files of the save being read go once the new one commits, and the
                # same race would fail every later try. Read the new save instead.
                if time.monotonic() >= deadline or not self._sent_again(fs, url, reader):
                    raise

    def _reader(self, fs: FileSystemBase, url: str) -> CheckpointReader:
        return CheckpointReader(url, keys=self.keys, registry=self.registry, filesystem=fs)

    def _load(
        self, reader: CheckpointReader, url: str, sender: str, sender_id: str | None
    ) -> dict[str, Any]:
        state: dict[str, Any] = {}
        # This worker's own state, asked for once, and only if needed.
        own = functools.cache(lambda: None if self.state_dict is None else self.state_dict())

        try:
            # dcp.load would fill a copy of ``state``; this fills ``state`` itself.
            load_state_dict_without_collectives(
                state,
                reader,
                planner=PlainDataPlanner(url, sender, own, self.max_bytes),
                no_dist=True,
            )
        except CheckpointException as exc:
            real = unwrap_checkpoint_exception(exc, reader)
            raise real from real.__cause__  # its own cause kept, DCP's wrapper hidden
        sent_by = state.pop(SENDER_KEY, None)
        if sender_id is not None and sent_by != sender_id:
            raise IntegrityError(
                f"{url}: this step was written by another sender than {sender} (item "
                f"{SENDER_KEY!r} is {quote(sent_by)}, {sender}'s transport is "
                f"{quote(sender_id)}): another job or worker sends to the same directory; "
                "nothing received was used: give each job its own root URL (or replica ids)"
            )
        if SHAPE_KEY not in state:  # written before the shape was recorded
            return state
        shape = state.pop(SHAPE_KEY)
        rebuilt: dict[str, Any] = rebuild(state, shape, url, own=own())
        return rebuilt

    def _sent_again(self, fs: FileSystemBase, url: str, reader: CheckpointReader) -> bool:
        """Whether ``url`` is now committed by another save than the one ``reader``
        read (its data files differ: each save names its own)."""
        try:
            now = self._reader(fs, url).read_metadata()
        except Exception:
            return False  # gone, or unreadable: the error being handled stands
        return _data_files(now.storage_data or {}) != _data_files(reader.storage_data)

    def _location(self, url: str) -> tuple[FileSystemBase, str]:
        if url == self.metadata():
            return self.fs, self.root
        if url not in self._resolved:  # one client per location, not one per receive
            self._resolved[url] = resolve_location(url, self.storage_options, self._explicit_fs)
        return self._resolved[url]

    def _write(self, step: int, state_dict: Any, shape: Shape) -> None:
        mgr = self._manager
        writer = CheckpointWriter(
            mgr.step_url(step),
            transforms=mgr.transforms,
            filesystem=self.fs,
            **mgr.writer_options,
        )
        try:
            dcp.save(
                {**local(state_dict), SHAPE_KEY: shape, SENDER_KEY: self.sender_id},
                storage_writer=writer,
                no_dist=True,
            )
        except CheckpointException as exc:
            real = unwrap_checkpoint_exception(exc, writer)
            raise real from real.__cause__  # its own cause kept, DCP's wrapper hidden
        mgr.retention.after_save(step)
