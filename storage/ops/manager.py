"""``CheckpointManager``: numbered checkpoints under one root, with retention and cleanup.

Layout: ``root/step-{N}`` for each saved step ``N`` (a non-negative integer, written
without padding; steps sort as integers). A step exists once its ``.metadata`` does
(docs/format.md, "Commit protocol"), so a crashed save is never listed. Beside them,
``root/.dcp-latest`` names the newest committed step, written by name after each commit, so
a listing that misses the newest step does not send a restarted job back to an older
one (:mod:`storage.checkpoint.latest`).

The manager only ever deletes what it recognises as its own: directories named exactly
``step-<N>`` (``N`` in canonical decimal form: ``step-7``, not ``step-07``, ``step--1``,
``step-3.14`` or ``step-300_extra``), and inside them only checkpoint files (metadata,
``__{rank}_{n}[-{save_id}].distcp`` data files and the temporary files of an
interrupted metadata write), and ``root/.dcp-latest`` once it names a step deleted.
Anything else under the root or inside a step directory is
left alone, and so is a step that is a symbolic link (a checkpoint from elsewhere,
linked in): it is listed and loaded like any step, but never deleted through.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from extensions.base import Keys
from extensions.registry import ExtensionRegistry
from storage.backends.base import FileSystemBase, PendingUpload
from storage.checkpoint import api, persist
from storage.checkpoint.layout import StepInfo
from storage.checkpoint.options import resolve_location
from storage.ops.manager_options import check_options, check_pace
from storage.ops.retention import Retention
from storage.ops.root_tier import RootTier
from storage.ops.steps import StepRoot, check_step
from storage.ops.tier import Tier
from storage.ops.uploads import stale_uploads

if TYPE_CHECKING:
    from storage.ops.preemption import PreemptionGuard
    from storage.ops.tiers import LocalTier

log = logging.getLogger(__name__)


class CheckpointManager:
    """Save, list, load and prune numbered checkpoints ``root/step-{N}``.

    ``keep_last=N`` keeps the ``N`` newest committed steps; ``keep_every=K`` also keeps
    every step divisible by ``K`` (it needs ``keep_last``; without ``keep_last`` nothing
    is ever deleted). Retention runs after a save commits, never before, and never
    deletes the step just saved. ``transforms`` and the writer options (``thread_count``,
    ``overwrite``, ``sync_files``, ...; checked when the manager is made, as the writer
    checks them) go to every :class:`CheckpointWriter`; ``keys``,
    ``registry`` and ``require_encryption`` (default: on when ``keys`` are given; see
    :class:`CheckpointReader`) to every reader. ``filesystem`` supplies a backend instance directly.

    ``incremental=True`` saves each step against the newest committed step below it: items
    unchanged since then are referenced, not written again (docs/operations.md,
    "Incremental checkpoints"); ``full_every=K`` makes every K-th save a full one. Retention,
    :meth:`delete` and :meth:`cleanup` never remove a step that a kept step references.

    ``pace`` (default 0.8): an asynchronous save written by the persist worker spreads
    its upload over that share of the time since the previous asynchronous save began
    (at most a minute), so it shares the cores and the link with training instead of
    taking them in a burst; the next save, :meth:`wait` and its future's ``result()``
    lift the pace. With a local tier, each step's drain to the root is paced so (from
    one save's start to the next's). ``None``: every upload at full speed. The first
    save is not paced.

    At most one save is in flight per manager: :meth:`save` first waits for the previous
    asynchronous save to finish (its outcome is reported through its own future and
    logged; it is not raised again by the next save). Under ``torch.distributed``,
    saves and loads are collective and only rank 0 deletes anything (``coordinator``
    overrides that choice for managers that are not shared by the ranks).

    Tiers: with ``local`` (a path or URL; ``local_storage_options`` /
    ``local_filesystem`` as for the root), :meth:`save` commits each step to that fast
    local tier and returns (``blocking=False``: once staged); a background drain copies
    it byte for byte to the root, the durable tier. ``keep_local=N`` keeps at most ``N``
    committed local steps besides the one being written (and the bases they reference),
    deleting local copies only once durable; ``replicate`` (``True``: the same position
    on the next node, or a callable ``rank -> peer rank``) also writes each rank's files
    to a peer's local tier. :meth:`load` reads the nearest tier holding the step and
    returns a :class:`~storage.ops.restore.LoadedStep` naming it; :meth:`wait` (and the
    next :meth:`save`) raises a failed drain's error. Constructing a tiered manager is
    collective under a process group. See :mod:`storage.ops.tiers` and
    docs/operations.md ("Tiered checkpoints").
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
        pace: float | None = 0.8,
        **writer_options: Any,
    ) -> None:
        self.settings = check_options(
            incremental, full_every, keep_last, keep_every, keep_local, writer_options
        )
        self.transforms = list(transforms or [])
        self.reader_options = api.ReaderOptions(keys, registry, require_encryption)
        self.incremental = incremental
        self.full_every = full_every
        self.location = StepRoot(*resolve_location(root_url, storage_options, filesystem))
        shared = self.location.open_to_others(owner=False)  # a team's root may be a colleague's
        if shared is not None:
            log.warning(
                "the checkpoint root %s %s: another user or job on this host could put a step "
                "there that load() takes as the newest, or change a saved one; make it "
                "writable by you (and your group) only: chmod o-w",
                self.location.url,
                shared,
            )
        self.retention = Retention(
            self.location, keep_last=keep_last, keep_every=keep_every, coordinator=coordinator
        )
        pace = check_pace(pace)
        self.root_tier = RootTier(
            self.location,
            self.retention,
            transforms=self.transforms,
            settings=self.settings,
            incremental=incremental,
            full_every=full_every,
            reader=self.reader_options,
            pace=pace,
        )
        self.tiers: LocalTier | None = None
        if local is not None:
            from storage.ops.tiers import LocalTier  # imported only when a tier is asked for

            self.tiers = LocalTier(
                self.location,
                local,
                transforms=self.transforms,
                settings=self.settings,
                incremental=incremental,
                full_every=full_every,
                reader=self.reader_options,
                keep_local=keep_local,
                replicate=replicate,
                storage_options=local_storage_options,
                filesystem=local_filesystem,
                on_durable=self.retention.after_save,
                pace=pace,
            )
        elif keep_local is not None or replicate:
            raise ValueError("keep_local and replicate need a local tier (local=PATH_OR_URL)")
        #: Where saves, loads, listings and waits go: the local tier, else the root.
        self.tier: Tier = self.root_tier if self.tiers is None else self.tiers
        # The worker starts now (its imports take seconds): the first asynchronous save
        # then neither waits for it nor shares the cores with its start.
        persist.start(self.settings, self.tier.saves_to.fs)

    # --- locations ------------------------------------------------------------------

    @property
    def writer_options(self) -> dict[str, Any]:
        """The keyword options of this manager's writers (its ``settings``)."""
        return self.settings.writer_kwargs()

    @property
    def keys(self) -> Keys | None:
        return self.reader_options.keys

    @property
    def registry(self) -> ExtensionRegistry | None:
        return self.reader_options.registry

    @property
    def require_encryption(self) -> bool | None:
        return self.reader_options.require_encryption

    @property
    def fs(self) -> FileSystemBase:
        return self.location.fs

    @property
    def root(self) -> str:
        """The backend path of the root."""
        return self.location.path

    @property
    def keep_last(self) -> int | None:
        return self.retention.keep_last

    @property
    def keep_every(self) -> int | None:
        return self.retention.keep_every

    @property
    def coordinator(self) -> bool | None:
        return self.retention.coordinator

    @property
    def url(self) -> str:
        return self.location.url

    def step_path(self, step: int) -> str:
        """The backend path of ``root/step-{step}``."""
        return self.location.step_path(step)

    def step_url(self, step: int) -> str:
        return self.location.step_url(step)

    # --- listing --------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending (in any tier: :meth:`durable_steps` for the root's)."""
        return self.tier.steps()

    def durable_steps(self) -> list[int]:
        """Steps committed under the root, ascending."""
        return self.tier.durable_steps()

    def latest(self) -> int | None:
        """The newest committed step, or ``None``: the listing's newest, or the step the
        root's latest-step pointer names (once its metadata is found by name), whichever is
        higher, so a listing that lags does not send a restarted job back a step."""
        steps = self.steps()
        return steps[-1] if steps else None

    def linked_steps(self) -> list[int]:
        """Steps whose directory is a symbolic link: retention, :meth:`cleanup` and
        :meth:`delete` never touch them."""
        return self.location.linked_steps()

    def entries(self) -> list[StepInfo]:
        """Every ``step-<N>`` directory, committed or not, with size, age and the tiers
        holding a committed copy (a tiered manager adds the steps only its local tier holds)."""
        return self.tier.entries()

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
        :meth:`storage.ops.tiers.LocalTier.save`). A step under the root that is a
        symbolic link (a checkpoint from elsewhere, linked in) is refused with
        :class:`UnsafeCheckpointError` before anything is written: saving over it would
        replace someone else's checkpoint through the link; so is one whose directory in
        the local tier is a link (:meth:`StepRoot.refuse_link`)."""
        return self.tier.save(check_step(step), state_dict, blocking=blocking)

    def prepare(self, state_dict: dict[str, Any]) -> None:
        """Make the staging buffers of asynchronous saves for ``state_dict`` now, before
        the first save, so that save's stall is a copy into memory already touched (the
        first touch of fresh memory costs ~1 ms per MB on some hosts, paid here
        instead). Optional: integrations that know the state at setup call it; a save
        without it makes what it needs. Stages and saves nothing; tensors added or
        resized later get their buffers at the save that first sees them. Does nothing
        with ``persist="thread"``. See docs/operations.md ("The persist worker")."""
        w = persist.start(self.settings, self.tier.saves_to.fs)
        if w is not None:
            try:
                w.reserve(api.plain_state_dict(state_dict))
            except persist.SharedMemoryFull as exc:
                named = persist.SharedMemoryFull(f"preparing saves to {self.url}: {exc}")
                if self.settings.persist is not None:  # "process", named
                    raise named from exc
                persist.shm_full(named)  # the default: saves persist in threads instead

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
        from storage.ops.preemption import PreemptionGuard

        if self.tiers is None:
            raise ValueError(
                f"save_on_signal needs a tiered manager: CheckpointManager({self.url!r}, "
                "local=FAST_LOCAL_PATH); a save to the root alone does not promise to fit "
                "a preemption's grace period"
            )
        return PreemptionGuard(
            self.tiers, state_fn, signals=signals, grace=grace, every=every, chain=chain
        )

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the asynchronous save in flight, if any (its error is not raised);
        on a tiered manager, wait for the drains and raise a failed drain's error.
        ``timeout`` (seconds; default: none) bounds the wait: past it, raises
        :class:`DeadlineExceededError` naming the step not done, and the work goes on
        (a step not drained stays local; wait again, or a later save's drain takes it)."""
        self.tier.wait(timeout)

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
        return self.tier.load(state_dict, step)

    # --- deleting (storage/ops/retention.py) -----------------------------------------

    def delete(self, step: int) -> None:
        """Delete ``root/step-{step}``: its metadata first, then the data files that
        metadata names, then the directory once empty. Raises
        :class:`UnsafeCheckpointError` for a step that is a symbolic link,
        :class:`CheckpointInUseError` for one that a committed step references and
        :class:`CheckpointNotFoundError` for one that is not committed (an interrupted
        save is :meth:`cleanup`'s), removing nothing."""
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

    def orphans(self, grace_seconds: float = 3600.0, *, dry_run: bool = False) -> list[str]:
        """The data files in committed checkpoints here that no metadata names, older
        than ``grace_seconds`` (a copy or save killed mid-file leaves them beside the
        files a retry committed), removed unless ``dry_run``; their URLs. :meth:`cleanup`
        removes them too. See :meth:`Retention.orphans`."""
        return self.retention.orphans(grace_seconds, dry_run=dry_run)

    def stale_staging(self, grace_seconds: float = 3600.0, *, dry_run: bool = False) -> list[str]:
        """The staging areas (``.dcp-staging-<id>/``) that consolidating safetensors saves
        killed mid-save left in the root or a step directory, stale by :meth:`cleanup`'s
        rule (no live heartbeat, every object older than ``grace_seconds``), removed
        unless ``dry_run`` (only where this process deletes); their URLs. See
        :mod:`storage.checkpoint.safetensors.staging`."""
        return self.retention.stale_staging(grace_seconds, dry_run=dry_run)

    def stale_uploads(
        self, grace_seconds: float = 3600.0, *, abort: bool = False
    ) -> list[PendingUpload]:
        """Uploads of checkpoint files under the root that interrupted saves left open
        (S3 multipart uploads: billed, and invisible to listings), begun more than
        ``grace_seconds`` ago, in no directory with a live writer's heartbeat; with
        ``abort`` (only where this process deletes, see :meth:`may_delete`), they are
        aborted. See :mod:`storage.ops.uploads`."""
        return stale_uploads(self.fs, self.root, grace_seconds, abort=abort and self.may_delete())

    def may_delete(self) -> bool:
        """Whether this process deletes: rank 0 under a process group, unless
        ``coordinator`` says otherwise."""
        return self.retention.may_delete()
