"""``CheckpointManager``: numbered checkpoints under one root, with retention and cleanup.

Layout: ``root/step-{N}`` for each saved step ``N`` (a non-negative integer, written
without padding; steps sort as integers). A step exists once its ``.metadata`` does
(the commit protocol of DESIGN.md section 5), so a crashed save is never listed.

The manager only ever deletes what it recognises as its own: directories named exactly
``step-<N>`` (``N`` in canonical decimal form: ``step-7``, not ``step-07``, ``step--1``,
``step-3.14`` or ``step-300_extra``), and inside them only checkpoint files (metadata,
``__{rank}_{n}[-{save_id}].distcp`` data files and the temporary files of an
interrupted metadata write). Anything else under the root or inside a step directory is
left alone, and so is a step that is a symbolic link (a checkpoint from elsewhere,
linked in): it is listed and loaded like any step, but never deleted through.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import torch.distributed as dist

from extensions.base import Keys
from extensions.errors import (
    CheckpointNotFoundError,
    CheckpointStorageError,
)
from extensions.registry import ExtensionRegistry
from storage.backends.base import FileSystemBase, PendingUpload
from storage.checkpoint import api
from storage.checkpoint import format as fmt
from storage.checkpoint._common import resolve_location
from storage.checkpoint.committed import CommittedCheckpoint, ReadModels
from storage.checkpoint.layout import (
    STEP_PREFIX,
    StepInfo,
    directory_info,
    is_committed,
    parse_step,
)
from storage.checkpoint.writer import CheckpointWriter
from storage.ops.retention import Retention
from storage.ops.uploads import stale_uploads

if TYPE_CHECKING:
    from storage.ops.preemption import PreemptionGuard
    from storage.ops.tiers import LocalTier

log = logging.getLogger(__name__)

_WRITER_OPTIONS = frozenset(inspect.signature(CheckpointWriter.__init__).parameters) - {
    "self",
    "path",
    "transforms",
    "storage_options",
    "filesystem",
    "base",  # chosen per save: incremental=True
    "fingerprint",
}


class CheckpointManager:
    """Save, list, load and prune numbered checkpoints ``root/step-{N}``.

    ``keep_last=N`` keeps the ``N`` newest committed steps; ``keep_every=K`` also keeps
    every step divisible by ``K`` (it needs ``keep_last``; without ``keep_last`` nothing
    is ever deleted). Retention runs after a save commits, never before, and never
    deletes the step just saved. ``transforms`` and the writer options (``thread_count``,
    ``overwrite``, ``sync_files``, ...) go to every :class:`CheckpointWriter`; ``keys``,
    ``registry`` and ``require_encryption`` (default: on when ``keys`` are given; see
    :class:`CheckpointReader`) to every reader. ``filesystem`` supplies a backend instance directly.

    ``incremental=True`` saves each step against the newest committed step below it: items
    unchanged since then are referenced, not written again (docs/operations.md,
    "Incremental checkpoints"); ``full_every=K`` makes every K-th save a full one. Retention,
    :meth:`delete` and :meth:`cleanup` never remove a step that a kept step references.

    At most one save is in flight per manager: :meth:`save` first waits for the previous
    asynchronous save to finish (its outcome is reported through its own future and
    logged; it is not raised again by the next save). Under ``torch.distributed``,
    saves and loads are collective and only rank 0 deletes anything (``coordinator``
    overrides that choice for managers that are not shared by the ranks).

    Tiers: with ``local`` (a path or URL; ``local_storage_options`` /
    ``local_filesystem`` as for the root), :meth:`save` commits each step to that fast
    local tier and returns (``blocking=False``: once staged; the local commit runs in
    the background); a background drain copies it byte for byte to the root, the
    durable tier (incremental saves stay incremental in both tiers). ``keep_local=N``
    keeps at most ``N`` committed local steps besides the one being written (and the
    bases they reference), deleting local copies only once durable;
    ``replicate`` (``True``: the same position on the next node, or a callable
    ``rank -> peer rank``) also writes each rank's files to a peer's local tier before
    the save returns. :meth:`load` prefers the local copy when it is the same save as
    the durable one, falls back to the durable one, loads the newest local step when
    the root cannot be listed, and returns a :class:`~storage.ops.restore.LoadedStep`
    naming the tier used (and why, where it is not the obvious one);
    :meth:`wait` waits for the drains and raises a failed drain's error, as does the
    next :meth:`save`. Constructing a tiered manager is collective under a process
    group. See :mod:`storage.ops.tiers` and docs/operations.md.
    """

    def __init__(
        self,
        root_url: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        storage_options: dict[str, Any] | None = None,
        transforms: Sequence[Any] | None = None,
        keys: Keys | None = None,
        registry: ExtensionRegistry | None = None,
        require_encryption: bool | None = None,
        filesystem: FileSystemBase | None = None,
        coordinator: bool | None = None,
        incremental: bool = False,
        full_every: int | None = None,
        local: str | os.PathLike[str] | None = None,
        keep_local: int | None = None,
        replicate: bool | Callable[[int], int] = False,
        local_storage_options: dict[str, Any] | None = None,
        local_filesystem: FileSystemBase | None = None,
        **writer_options: Any,
    ) -> None:
        if not isinstance(incremental, bool):
            raise TypeError(f"incremental must be a bool, got {incremental!r}")
        if full_every is not None and not incremental:
            raise ValueError("full_every needs incremental=True")
        for name, value in (
            ("keep_last", keep_last),
            ("keep_every", keep_every),
            ("full_every", full_every),
        ):
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
        if keep_every is not None and keep_last is None:
            raise ValueError(
                "keep_every needs keep_last (without keep_last nothing is deleted); "
                "pass e.g. keep_last=3, keep_every=1000"
            )
        unknown = sorted(set(writer_options) - _WRITER_OPTIONS)
        if unknown:
            raise TypeError(
                f"unknown CheckpointManager option(s) {unknown}; writer options are "
                f"{sorted(_WRITER_OPTIONS)}"
            )
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.transforms = list(transforms or [])
        self.keys = keys
        self.require_encryption = require_encryption
        self.registry = registry
        self.writer_options = writer_options
        self.coordinator = coordinator
        self.incremental = incremental
        self.full_every = full_every
        self.fs, self.root = resolve_location(root_url, storage_options, filesystem)
        self._lock = threading.Lock()
        # The steps' read models, kept between saves: each metadata is read once.
        self.models = ReadModels()
        self.retention = Retention(self)
        self._pending: concurrent.futures.Future[None] | None = None
        self._saving: int | None = None
        self._saving_base: int | None = None
        self._async_group: Any = None
        self.tiers: LocalTier | None = None
        if local is not None:
            from storage.ops.tiers import LocalTier  # it builds on this module

            self.tiers = LocalTier(
                self,
                local,
                keep_local=keep_local,
                replicate=replicate,
                storage_options=local_storage_options,
                filesystem=local_filesystem,
            )
        elif keep_local is not None or replicate:
            raise ValueError("keep_local and replicate need a local tier (local=PATH_OR_URL)")

    # --- locations ------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.fs.url(self.root)

    def step_path(self, step: int) -> str:
        """The backend path of ``root/step-{step}``."""
        return self.fs.concat_path(self.root, f"{STEP_PREFIX}{_check_step(step)}")

    def step_url(self, step: int) -> str:
        return self.fs.url(self.step_path(step))

    # --- listing --------------------------------------------------------------------

    def _step_dirs(self) -> list[tuple[int, str]]:
        try:
            names = self.fs.ls(self.root)
        except (FileNotFoundError, NotADirectoryError):
            return []
        found = [(s, n) for n in names if (s := parse_step(n)) is not None]
        return sorted(found)

    def steps(self) -> list[int]:
        """Committed steps, ascending (in any tier: :meth:`durable_steps` for the root's)."""
        if self.tiers is not None:
            return list(self.tiers.tiers_by_step())
        return self.durable_steps()

    def durable_steps(self) -> list[int]:
        """Steps committed under the root, ascending."""
        return [
            step
            for step, name in self._step_dirs()
            if is_committed(self.fs, self.fs.concat_path(self.root, name))
        ]

    def latest(self) -> int | None:
        """The newest committed step, or ``None``."""
        steps = self.steps()
        return steps[-1] if steps else None

    def linked_steps(self) -> list[int]:
        """Steps whose directory is a symbolic link: retention, :meth:`cleanup` and
        :meth:`delete` never touch them."""
        return [
            s for s, n in self._step_dirs() if self.fs.is_link(self.fs.concat_path(self.root, n))
        ]

    def entries(self) -> list[StepInfo]:
        """Every ``step-<N>`` directory, committed or not, with size, age and the tiers
        holding a committed copy (a tiered manager adds the steps only its local tier holds)."""
        infos = []
        for step, name in self._step_dirs():
            info = directory_info(self.fs, self.fs.concat_path(self.root, name), name, step)
            if info is not None:
                infos.append(replace(info, tiers=("durable",) if info.committed else ()))
        return infos if self.tiers is None else self.tiers.merge_entries(infos)

    # --- save / load ----------------------------------------------------------------

    def save(
        self, step: int, state_dict: dict[str, Any], *, blocking: bool = True
    ) -> concurrent.futures.Future[None] | None:
        """Save ``state_dict`` as ``root/step-{step}``, then apply retention.

        ``blocking=False`` stages the state to CPU memory and returns a
        ``concurrent.futures.Future`` at once (the caller may change its tensors right
        away); the future resolves after the checkpoint is committed and retention has
        run, or raises the save's error. Either way, a previous asynchronous save of
        this manager is waited for first. A tiered save commits to the local tier (the
        future resolves then) and drains to the root in the background (see
        :meth:`storage.ops.tiers.LocalTier.save`)."""
        step = _check_step(step)
        if self.tiers is not None:
            return self.tiers.save(step, state_dict, blocking=blocking)
        self.wait()
        url = self.step_url(step)
        options = dict(self.writer_options, filesystem=self.fs)
        base, opened = self._incremental_base(step)
        if self.incremental:
            options["fingerprint"] = True
        if opened is not None:
            options["base"] = opened  # read once, here: the writer does not read it again
        if blocking:
            with self._lock:
                self._saving, self._saving_base = step, base
            try:
                writer = CheckpointWriter(url, transforms=self.transforms, **options)
                api.save_with(writer, state_dict)
                if writer.published is not None:
                    self.models.remember(self.fs, self.step_path(step), writer.published)
            finally:
                with self._lock:
                    self._saving, self._saving_base = None, None
            self._retain_quietly(step)
            return None
        outer: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            self._saving, self._saving_base = step, base
            self._pending = outer
        try:
            inner = api.async_save(
                state_dict,
                url,
                transforms=self.transforms,
                process_group=self._background_group(),
                **options,
            )
        except BaseException:
            with self._lock:
                self._saving, self._saving_base, self._pending = None, None, None
            raise

        def finished(fut: concurrent.futures.Future[None]) -> None:
            error = fut.exception()
            with self._lock:
                self._saving, self._saving_base = None, None
            if error is None:
                self._retain_quietly(step)
                outer.set_result(None)
            else:
                log.error("asynchronous save of %s failed: %s", url, error)
                outer.set_exception(error)

        inner.add_done_callback(finished)
        return outer

    def _background_group(self) -> Any:
        """Under a process group, a gloo group of this manager's own for the collectives
        of its asynchronous saves: they run in a background thread while the job's run
        on the default group (a DDP all-reduce), and gloo aborts when collectives from
        two threads interleave on one group. Made at the first asynchronous save, which
        every rank makes together."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if self._async_group is None:
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    def save_on_signal(
        self,
        state_fn: Callable[[], dict[str, Any]],
        *,
        signals: Iterable[int] = (signal.SIGTERM,),
        grace: float = 25.0,
        every: int = 1,
        chain: bool = False,
    ) -> PreemptionGuard:
        """Save ``state_fn()`` to the local tier when one of ``signals`` arrives, at the
        next step boundary the loop marks with ``guard.should_stop(step)``; the step
        drains to the root in the background or at the next start. Needs a tiered
        manager; installs signal handlers (main thread only) and, under a process group,
        creates a gloo group (collective). See :mod:`storage.ops.preemption` and
        docs/operations.md ("Preemption")."""
        from storage.ops.preemption import PreemptionGuard  # it builds on this module

        return PreemptionGuard(
            self, state_fn, signals=signals, grace=grace, every=every, chain=chain
        )

    def _incremental_base(self, step: int) -> tuple[int | None, CommittedCheckpoint | None]:
        """The step an incremental save of ``step`` references and its read model: the
        newest committed step below it, unless ``full_every`` says this save is a full
        one, or that step cannot serve as a base (committed only by rank-local metadata,
        unreadable, or a symbolic link): then the save is a full one, and says why."""
        if not self.incremental:
            return None, None
        below = [s for s in self.steps() if s < step]
        if not below:
            return None, None
        path = self.step_path(below[-1])
        checkpoint = self.models.open(self.fs, path)
        why = (
            "it is a symbolic link"
            if self.fs.is_link(path)
            else "its metadata cannot be read"
            if not checkpoint.readable
            else "it is committed only by rank-local metadata"
            if checkpoint.global_metadata is None
            else None
        )
        if why is not None:
            log.info("step %d is saved in full: step %d is no base (%s)", step, below[-1], why)
            return None, None
        if self.full_every is not None and checkpoint.chain + 1 >= self.full_every:
            return None, None
        return below[-1], checkpoint

    def wait(self) -> None:
        """Wait for the asynchronous save in flight, if any (its error is not raised);
        on a tiered manager, wait for the drains and raise a failed drain's error."""
        if self.tiers is not None:
            self.tiers.wait()
        with self._lock:
            pending = self._pending
        if pending is not None:
            concurrent.futures.wait([pending])
            with self._lock:
                if self._pending is pending:
                    self._pending = None

    def load(self, state_dict: dict[str, Any], step: int | None = None) -> int:
        """Load ``step`` (default: the latest committed one) into ``state_dict`` in
        place; returns the step loaded. Raises :class:`CheckpointNotFoundError` when
        there is no such committed step.

        This manager's own asynchronous save in flight is waited for first, so it can
        be the one loaded. Under ``torch.distributed`` rank 0 picks the latest step and
        every rank loads that one: listings seen by different ranks may disagree (an
        eventually consistent store, a save landing in between). A tiered manager
        restores from the nearest tier that holds a committed copy (``.tier`` of the
        returned step says which)."""
        if self.tiers is not None:
            return self.tiers.load(state_dict, step)
        self.wait()
        if step is None:
            step = _decided_by_rank_zero(self.latest)
            if step is None:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint under {self.url} (looked for "
                    f"{STEP_PREFIX}<N>/{fmt.METADATA_NAME}); save one first or check the root URL"
                )
        elif not is_committed(self.fs, self.step_path(step)):
            raise CheckpointNotFoundError(
                f"{self.step_url(step)} is not a committed checkpoint; committed steps "
                f"under {self.url}: {self.steps() or 'none'}"
            )
        api.load(
            state_dict,
            self.step_url(step),
            keys=self.keys,
            registry=self.registry,
            require_encryption=self.require_encryption,
            filesystem=self.fs,
        )
        return step

    # --- deleting (storage/ops/retention.py) -----------------------------------------

    def delete(self, step: int) -> None:
        """Delete ``root/step-{step}``: its metadata first, then the data files that
        metadata names, then the directory once empty. Raises
        :class:`UnsafeCheckpointError` for a step that is a symbolic link and
        :class:`CheckpointInUseError` for one that a committed step references."""
        self.retention.delete(step)

    def retained(self, steps: Sequence[int], protect: int | None = None) -> set[int]:
        """Which of ``steps`` the retention policy keeps."""
        return self.retention.retained(steps, protect)

    def apply_retention(self, *, dry_run: bool = False, protect: int | None = None) -> list[int]:
        """Delete committed steps the policy does not keep; returns them. Uncommitted
        directories are :meth:`cleanup`'s business; linked and referenced steps are kept
        (and logged)."""
        return self.retention.apply(dry_run=dry_run, protect=protect)

    def referenced_by(self) -> dict[int, list[int]]:
        """For each step whose bytes committed steps reference (incremental saves):
        those steps, ascending."""
        return self.retention.referenced_by()

    def cleanup(self, grace_seconds: float = 3600.0, *, dry_run: bool = False) -> list[int]:
        """Remove leftovers of interrupted saves older than ``grace_seconds`` (choose more
        than your longest save): uncommitted ``step-<N>`` directories of checkpoint files,
        and data files that a committed step's metadata does not name. Returns the steps
        removed whole."""
        return self.retention.cleanup(grace_seconds, dry_run=dry_run)

    def stale_uploads(
        self, grace_seconds: float = 3600.0, *, abort: bool = False
    ) -> list[PendingUpload]:
        """Uploads of checkpoint files under the root that interrupted saves left open
        (S3 multipart uploads: billed, and invisible to listings) and that began more
        than ``grace_seconds`` ago; with ``abort`` (only where this process deletes,
        see :meth:`may_delete`), they are aborted. See :mod:`storage.ops.uploads`."""
        return stale_uploads(self.fs, self.root, grace_seconds, abort=abort and self.may_delete())

    def _retain_quietly(self, step: int) -> None:
        # The save is committed; a failure to prune must not turn it into a failure.
        try:
            removed = self.apply_retention(protect=step)
        except Exception as exc:
            log.warning("retention after saving %s failed: %s", self.step_url(step), exc)
        else:
            if removed:
                log.info("retention removed steps %s under %s", removed, self.url)

    def may_delete(self) -> bool:
        """Whether this process deletes: rank 0 under a process group, unless
        ``coordinator`` says otherwise."""
        return self.coordinator if self.coordinator is not None else _is_rank_zero()


def _check_step(step: object) -> int:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return step


def _decided_by_rank_zero(decide: Callable[[], int | None]) -> int | None:
    """``decide()`` on rank 0, broadcast to every rank (just ``decide()`` without a
    process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return decide()
    choice: list[Any] = [None, None]  # the decision, or why rank 0 could not make it
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            choice[0] = decide()
        except Exception as exc:  # the other ranks must not wait for an answer forever
            error, choice[1] = exc, f"{type(exc).__name__}: {exc}"
    dist.broadcast_object_list(choice, src=0)
    if error is not None:
        raise error
    if choice[1] is not None:
        raise CheckpointStorageError(f"rank 0 could not pick the step to load: {choice[1]}")
    return cast(int | None, choice[0])


def _is_rank_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
