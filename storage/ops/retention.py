"""Retention and cleanup of the steps under one :class:`~storage.ops.steps.StepRoot`
(a manager's root): what is deleted, in which order, and what is kept and why.

Deletion trusts only what is ours (docs/format.md, "What deletion trusts"): a step
directory named exactly ``step-<N>`` and not a symbolic link, the data files its
removed metadata names (never through a linked prefix directory), never a step a kept
step references (incremental saves, rank-local metadata included) and never the step
being saved or its base. Each pass reads every step's metadata at most once
(``siblings.Siblings``); a step whose metadata cannot be read may reference any other,
so while one is kept, every step is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

import torch.distributed as dist

from extensions.errors import CheckpointNotFoundError, UnsafeCheckpointError
from storage.checkpoint import heartbeat
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.commit import remove_quietly
from storage.checkpoint.deletion import MOVED_ASIDE, delete_checkpoint, remove_leftovers
from storage.checkpoint.latest import stale_temporaries
from storage.checkpoint.layout import (
    STEP_PREFIX,
    is_checkpoint_file_name,
    is_data_file_name,
    is_metadata_temporary,
    parse_step,
    present_metadata,
)
from storage.checkpoint.prefixes import expand, is_linked, is_prefix, split
from storage.checkpoint.safetensors.staging import sweep
from storage.checkpoint.siblings import Siblings
from storage.ops.steps import StepRoot

log = logging.getLogger("storage.ops.manager")


class Retention:
    """What is deleted under ``root`` (a manager's ``retention``; the manager's public
    :meth:`~CheckpointManager.delete`, :meth:`~CheckpointManager.apply_retention`,
    :meth:`~CheckpointManager.cleanup` and friends delegate here).

    ``keep_last=N`` keeps the ``N`` newest committed steps, ``keep_every=K`` also every
    step divisible by ``K`` (``keep_last=None``: nothing is pruned); the save in flight
    at ``root`` (``root.in_flight``) and its base are always kept. ``coordinator``: whether
    this process deletes (default: rank 0 under a process group, see :meth:`may_delete`)."""

    def __init__(
        self,
        root: StepRoot,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        coordinator: bool | None = None,
    ) -> None:
        self.root = root
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.coordinator = coordinator

    def may_delete(self) -> bool:
        """Whether this process deletes: rank 0 under a process group, unless
        ``coordinator`` says otherwise."""
        if self.coordinator is not None:
            return self.coordinator
        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0

    def delete(self, step: int, siblings: Siblings | None = None) -> None:
        """Delete ``root/step-{step}``: its metadata first, then the data files that
        metadata names, then the directory once empty (see
        :func:`~storage.checkpoint.deletion.delete_checkpoint`). Raises
        :class:`UnsafeCheckpointError` for a step that is a symbolic link or holds a
        linked prefix directory, :class:`CheckpointInUseError` for one that a step
        references or that an unreadable step might, :class:`CheckpointNotFoundError`
        for one that is not committed (nothing removed). ``siblings``: the steps as this
        pass read them."""
        path = self.root.step_path(step)
        name = f"{STEP_PREFIX}{step}"
        siblings = siblings or self._siblings()
        try:
            checkpoint = siblings.open(name)
            if not checkpoint.committed:
                raise FileNotFoundError(path)
            siblings.refuse_if_referenced(name)
            delete_checkpoint(
                self.root.fs, path, checkpoint, recheck=lambda: siblings.recheck_users(name)
            )
        except FileNotFoundError:
            url = self.root.fs.url(path)
            if not self.root.fs.exists(path):
                raise CheckpointNotFoundError(f"{url} does not exist") from None
            raise CheckpointNotFoundError(
                f"{url} is not a committed checkpoint (no metadata: an interrupted save, or "
                "a save in flight); nothing was deleted. cleanup() (`dcp-storage gc`) removes "
                "interrupted saves once older than its grace period"
            ) from None
        siblings.forget(name)

    def _siblings(self) -> Siblings:
        return Siblings(self.root.fs, self.root.path, self.root.models)

    def retained(self, steps: Sequence[int], protect: int | None = None) -> set[int]:
        """Which of ``steps`` the retention policy keeps."""
        if self.keep_last is None:
            return set(steps)
        ordered = sorted(steps)
        keep = set(ordered[-self.keep_last :])
        if self.keep_every is not None:
            keep |= {s for s in ordered if s % self.keep_every == 0}
        if protect is not None:
            keep.add(protect)
        return keep

    def apply(self, *, dry_run: bool = False, protect: int | None = None) -> list[int]:
        """Delete committed steps the policy does not keep; returns them.

        Uncommitted directories are :meth:`cleanup`'s business and are not touched;
        steps that are symbolic links are kept (and logged)."""
        if self.keep_last is None or not self.may_delete():
            return []
        steps = self.root.steps()
        keep = self.retained(steps, protect) | self.root.in_flight.held()
        keep |= self._skip_linked(s for s in steps if s not in keep)
        siblings = self._siblings()
        if any(s not in keep for s in steps):
            keep |= self._bases_of(keep, steps, siblings)
        doomed = [s for s in steps if s not in keep]
        if not dry_run:
            for step in reversed(doomed):  # references point to older steps: users first
                try:
                    self.delete(step, siblings)
                except UnsafeCheckpointError as exc:  # referenced from outside, or linked
                    log.warning("kept %s: %s", self.root.step_url(step), exc)
                    doomed.remove(step)
                except CheckpointNotFoundError:  # another process deleted it meanwhile
                    doomed.remove(step)
        return doomed

    def after_save(self, step: int) -> None:
        """:meth:`apply` once ``step`` is committed, keeping it: a failure is logged,
        never raised (the save is committed; failing to prune must not undo that)."""
        self.root.saw(step)  # listed from now on, even where a listing lags behind
        try:
            removed = self.apply(protect=step)
        except Exception as exc:
            log.warning("retention after saving %s failed: %s", self.root.step_url(step), exc)
        else:
            if removed:
                log.info("retention removed steps %s under %s", removed, self.root.url)

    def referenced_by(self) -> dict[int, list[int]]:
        """For each step whose bytes committed steps reference (incremental saves):
        those steps, ascending."""
        siblings = self._siblings()
        users: dict[int, list[int]] = {}
        for step in self.root.steps():
            for name in siblings.open(f"{STEP_PREFIX}{step}").references():
                base = parse_step(name)
                if base is not None:
                    users.setdefault(base, []).append(step)
        return users

    def _bases_of(self, keep: set[int], steps: Sequence[int], siblings: Siblings) -> set[int]:
        """The steps that the steps in ``keep`` reference, directly or through each
        other: retention keeps them, and says so. A kept step whose metadata cannot be
        read might reference any step: then every step is kept."""
        found: set[int] = set()
        frontier = sorted(keep)
        while frontier:
            step = frontier.pop()
            checkpoint = siblings.open(f"{STEP_PREFIX}{step}")
            if not checkpoint.readable:
                log.warning(
                    "kept every step under %s: the metadata of %s cannot be read (%s), so "
                    "it may reference any of them; repair or delete it",
                    self.root.url,
                    checkpoint.name,
                    checkpoint.why_unreadable(),
                )
                return set(steps) - keep
            for name in checkpoint.references():
                base = parse_step(name)
                if base is not None and base not in keep and base not in found:
                    log.info(
                        "kept %s: %s references its bytes", self.root.step_url(base), f"step-{step}"
                    )
                    found.add(base)
                    frontier.append(base)
        return found

    def cleanup(self, grace_seconds: float = 3600.0, *, dry_run: bool = False) -> list[int]:
        """Remove leftovers of interrupted saves: ``step-<N>`` directories without
        metadata whose files are all older than ``grace_seconds`` (choose more than
        your longest save). Directories holding anything that is not a checkpoint file,
        or whose age the backend cannot tell, are kept. Inside committed checkpoints, data
        files that the metadata does not name are removed too (:meth:`orphans`). Returns
        the steps removed whole."""
        self.orphans(grace_seconds, dry_run=dry_run)  # checks grace_seconds first
        if not self.may_delete():
            return []
        removed = []
        dirs = self.root.step_dirs()
        linked = self._skip_linked(s for s, _ in dirs)
        for step, name in dirs:
            if step == self.root.in_flight.step or step in linked:
                continue
            path = self.root.fs.concat_path(self.root.path, name)
            stale = self._stale_leftover(path, grace_seconds)
            if stale is not None and not self._put_back_if_referenced(name, path, stale, dry_run):
                if not dry_run:
                    remove_leftovers(self.root.fs, path, stale)
                removed.append(step)
        self._stale_pointer_temporaries(grace_seconds, dry_run)
        return removed

    def _stale_pointer_temporaries(self, grace_seconds: float, dry_run: bool) -> None:
        """Remove the latest-step pointer's temporaries a killed process left in the root
        (``latest.stale_temporaries``), never through a linked root (:meth:`_places`)."""
        fs, root = self.root.fs, self.root.path
        doomed = [] if fs.is_link(root) else stale_temporaries(fs, root, _horizon(grace_seconds))
        for name in doomed:
            where = fs.url(fs.concat_path(root, name))
            log.info("%s: a latest-step pointer a killed process left half-written", where)
        if not dry_run:
            remove_quietly(fs, root, doomed)

    def _put_back_if_referenced(
        self, name: str, path: str, stale: list[str], dry_run: bool
    ) -> bool:
        """A deletion killed between moving a step's metadata aside and looking once more
        for steps that reference it (``deletion.delete_checkpoint``) may have missed an
        incremental save that chose the step as its base meanwhile: when a committed
        step references ``name``, its metadata is moved back (not in a ``dry_run``) and
        True returned; the step is then a checkpoint again, not a leftover."""
        aside = {n: m[1] for n in stale if (m := MOVED_ASIDE.fullmatch(n)) is not None}
        if not aside:
            return False
        users = [c.name for c in self._siblings().users(name)]
        if not users:
            return False
        log.warning(
            "%s: put back the metadata a killed deletion moved aside: %s reference%s it",
            self.root.fs.url(path),
            ", ".join(users),
            "" if len(users) > 1 else "s",
        )
        if not dry_run:
            for moved, original in aside.items():
                self.root.fs.rename_in(path, moved, original)
        return True

    def orphans(self, grace_seconds: float = 3600.0, *, dry_run: bool = False) -> list[str]:
        """Data files inside committed checkpoints (each ``step-<N>`` and the root itself,
        when it is one; or all of an uncommitted root's, by :meth:`_stale_leftover`'s
        rule) that no metadata names, older than ``grace_seconds``: what a save, ``cp``,
        drain or peer restore killed mid-copy leaves beside the files a retry committed
        (and a multi-rank save that failed on another rank). Also the
        stale heartbeats of writers that died there. Removed unless ``dry_run``; returns
        their URLs. Only data file names, never through a link, never in a checkpoint
        with a live heartbeat (a save in flight) or whose metadata cannot be read, never in a
        key prefix directory holding anything but data files (a checkpoint of its own)."""
        horizon = _horizon(grace_seconds)
        if not self.may_delete():
            return []
        fs = self.root.fs
        found: list[str] = []
        for path in self._places(skip={self.root.in_flight.step, *self.root.linked_steps()}):
            doomed = self._orphans_in(path, grace_seconds, horizon)
            for name in doomed:
                log.info("%s: %s is not named by its metadata", fs.url(path), name)
            found += [fs.url(fs.concat_path(path, n)) for n in doomed]
            if not dry_run:
                remove_quietly(fs, path, doomed)
        return found

    def stale_staging(self, grace_seconds: float = 3600.0, *, dry_run: bool = False) -> list[str]:
        """The staging areas that consolidating safetensors saves killed mid-save left
        in the root or a step directory not linked in, stale by
        :func:`storage.checkpoint.safetensors.staging.sweep`'s rule, removed unless
        ``dry_run`` (only where this process deletes); their URLs."""
        if not self.may_delete():
            return []
        places = self._places(skip=set(self.root.linked_steps()))
        return [
            url for p in places for url in sweep(self.root.fs, p, grace_seconds, dry_run=dry_run)
        ]

    def _places(self, skip: set[int | None]) -> list[str]:
        """Where checkpoints' files lie under the root: each ``step-<N>`` directory not
        in ``skip``, and the root itself unless it is a link."""
        fs, root = self.root.fs, self.root.path
        places = [
            fs.concat_path(root, name) for step, name in self.root.step_dirs() if step not in skip
        ]
        if not fs.is_link(root):
            places.append(root)
        return places

    def _orphans_in(self, path: str, grace_seconds: float, horizon: float) -> list[str]:
        fs = self.root.fs
        try:
            names = expand(fs, path)  # never into a linked prefix directory
        except (FileNotFoundError, NotADirectoryError):
            return []
        checkpoint = self.root.models.open(fs, path)
        if path == self.root.path and checkpoint.readable and not checkpoint.metadata:
            # A save or cp killed into a root of its own (a root of steps holds no file of one)
            ours = any(is_checkpoint_file_name(n) for n in names)
            return (self._stale_leftover(path, grace_seconds) if ours else None) or []
        if not checkpoint.readable or list(checkpoint.metadata) != [fmt.METADATA_NAME]:
            # Unreadable metadata: touch nothing. Rank-local metadata: which files are
            # whose is not ours to guess.
            return []
        beating, stale = heartbeat.live(fs, path, grace_seconds)
        if beating:
            return []  # a save or copy is writing here: its files are not orphans
        referenced = checkpoint.data_files()
        if not referenced:
            return []
        doomed = list(stale)
        # A prefix directory holding anything but data files (a checkpoint copied or
        # saved into `0a/`, its heartbeat, a user's file) is not one of this
        # checkpoint's: its files are not orphans here.
        foreign = {p for n in names if (p := split(n)[0]) is not None and not is_data_file_name(n)}
        for name in names:
            # A metadata temporary beside committed metadata: a save over this checkpoint
            # killed before its rename (the grace keeps one in flight).
            temporary = is_metadata_temporary(name)
            if not temporary and (
                not is_data_file_name(name) or name in referenced or split(name)[0] in foreign
            ):
                continue
            try:
                mtime = fs.modified(fs.concat_path(path, name))
            except FileNotFoundError:
                continue
            if mtime is not None and mtime < horizon:
                doomed.append(name)
        # A rank's own metadata beside .metadata names its files; a listing may miss it.
        ranks = {fmt.file_rank(n) for n in doomed if is_data_file_name(n)}
        if any(fs.exists(fs.concat_path(path, fmt.metadata_name(r))) for r in ranks):
            return []
        return doomed

    def _skip_linked(self, steps: Iterable[int]) -> set[int]:
        """Those of ``steps`` that are symbolic links, each logged as kept."""
        linked = set()
        for step in steps:
            if self.root.is_link(step):
                log.warning(
                    "%s is a symbolic link to a checkpoint elsewhere: kept, never deleted "
                    "through the link",
                    self.root.step_url(step),
                )
                linked.add(step)
        return linked

    def _stale_leftover(self, path: str, grace_seconds: float) -> list[str] | None:
        """The names in ``path`` if it is an uncommitted directory of checkpoint files
        all older than ``grace_seconds`` and no live heartbeat, else ``None``."""
        horizon = _horizon(grace_seconds)
        try:
            names = expand(self.root.fs, path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        # The listing may lag or miss an object: before a committed step's files are
        # taken for leftovers, its metadata is asked for by name too.
        if present_metadata(self.root.fs, path, names):
            return None
        if heartbeat.live(self.root.fs, path, grace_seconds)[0]:
            return None  # a save or copy is writing here, whatever the files' dates say
        linked = [n for n in names if is_prefix(n) and is_linked(self.root.fs, path, n)]
        if linked:
            log.warning(
                "%s: not cleaned up: %s is a symbolic link, never followed",
                self.root.fs.url(path),
                ", ".join(linked),
            )
            return None
        if not all(is_checkpoint_file_name(n) for n in names):
            log.info("%s: not cleaned up, it holds files that are not ours", self.root.fs.url(path))
            return None
        try:
            times = [self.root.fs.modified(self.root.fs.concat_path(path, n)) for n in names] or [
                self.root.fs.modified(path)
            ]
        except FileNotFoundError:
            return None
        return names if all(t is not None and t < horizon for t in times) else None


def _horizon(grace_seconds: float) -> float:
    if not isinstance(grace_seconds, (int, float)) or grace_seconds < 0:
        raise ValueError(f"grace_seconds must be a number >= 0, got {grace_seconds!r}")
    return time.time() - grace_seconds
