"""Retention and cleanup of a :class:`~storage.ops.manager.CheckpointManager`'s steps:
what is deleted, in which order, and what is kept and why.

Deletion trusts only what is ours (docs/format.md, "What deletion trusts"): a step
directory named exactly ``step-<N>`` and not a symbolic link, the data files its
removed metadata names (never through a linked prefix directory), never a step a kept
step references (incremental saves, rank-local metadata included) and never the step
being saved or its base. Each pass reads every step's metadata at most once
(``committed.Siblings``); a step whose metadata cannot be read may reference any other,
so while one is kept, every step is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from extensions.errors import CheckpointNotFoundError, UnsafeCheckpointError
from storage.checkpoint import format as fmt
from storage.checkpoint.commit import remove_quietly
from storage.checkpoint.committed import Siblings
from storage.checkpoint.deletion import delete_checkpoint, remove_leftovers
from storage.checkpoint.layout import (
    STEP_PREFIX,
    is_checkpoint_file_name,
    is_data_file_name,
    is_metadata_name,
    parse_step,
)
from storage.checkpoint.prefixes import expand, is_linked, is_prefix

if TYPE_CHECKING:
    from storage.ops.manager import CheckpointManager

log = logging.getLogger("storage.ops.manager")


class Retention:
    """The deleting half of one manager (``manager.retention``); the manager's public
    :meth:`~CheckpointManager.delete`, :meth:`~CheckpointManager.apply_retention`,
    :meth:`~CheckpointManager.cleanup` and friends delegate here."""

    def __init__(self, manager: CheckpointManager) -> None:
        self.m = manager

    def delete(self, step: int, siblings: Siblings | None = None) -> None:
        """Delete ``root/step-{step}``: its metadata first, then the data files that
        metadata names, then the directory once empty (see
        :func:`~storage.checkpoint.deletion.delete_checkpoint`). Raises
        :class:`UnsafeCheckpointError` for a step that is a symbolic link or holds a
        linked prefix directory, :class:`CheckpointInUseError` for one that a step
        references or that an unreadable step might. ``siblings``: the steps as this
        pass read them."""
        path = self.m.step_path(step)
        name = f"{STEP_PREFIX}{step}"
        siblings = siblings or self._siblings()
        try:
            siblings.refuse_if_referenced(name)
            delete_checkpoint(self.m.fs, path, siblings.open(name))
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.m.fs.url(path)} does not exist") from None
        siblings.forget(name)

    def _siblings(self) -> Siblings:
        return Siblings(self.m.fs, self.m.root, self.m.models)

    def retained(self, steps: Sequence[int], protect: int | None = None) -> set[int]:
        """Which of ``steps`` the retention policy keeps."""
        if self.m.keep_last is None:
            return set(steps)
        ordered = sorted(steps)
        keep = set(ordered[-self.m.keep_last :])
        if self.m.keep_every is not None:
            keep |= {s for s in ordered if s % self.m.keep_every == 0}
        if protect is not None:
            keep.add(protect)
        return keep

    def apply(self, *, dry_run: bool = False, protect: int | None = None) -> list[int]:
        """Delete committed steps the policy does not keep; returns them.

        Uncommitted directories are :meth:`cleanup`'s business and are not touched;
        steps that are symbolic links are kept (and logged)."""
        if self.m.keep_last is None or not self.m.may_delete():
            return []
        steps = self.m.durable_steps()
        with self.m._lock:
            in_flight = {s for s in (self.m._saving, self.m._saving_base) if s is not None}
        keep = self.retained(steps, protect) | in_flight
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
                    log.warning("kept %s: %s", self.m.step_url(step), exc)
                    doomed.remove(step)
        return doomed

    def referenced_by(self) -> dict[int, list[int]]:
        """For each step whose bytes committed steps reference (incremental saves):
        those steps, ascending."""
        siblings = self._siblings()
        users: dict[int, list[int]] = {}
        for step in self.m.steps():
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
                    self.m.url,
                    checkpoint.name,
                    checkpoint.why_unreadable(),
                )
                return set(steps) - keep
            for name in checkpoint.references():
                base = parse_step(name)
                if base is not None and base not in keep and base not in found:
                    log.info(
                        "kept %s: %s references its bytes", self.m.step_url(base), f"step-{step}"
                    )
                    found.add(base)
                    frontier.append(base)
        return found

    def cleanup(self, grace_seconds: float = 3600.0, *, dry_run: bool = False) -> list[int]:
        """Remove leftovers of interrupted saves: ``step-<N>`` directories without
        metadata whose files are all older than ``grace_seconds`` (choose more than
        your longest save). Directories holding anything that is not a checkpoint file,
        or whose age the backend cannot tell, are kept. Inside committed steps, data
        files that the metadata does not name (a multi-rank save that failed on another
        rank leaves them) are removed once older than the grace too. Returns the steps
        removed whole."""
        if not isinstance(grace_seconds, (int, float)) or grace_seconds < 0:
            raise ValueError(f"grace_seconds must be a number >= 0, got {grace_seconds!r}")
        if not self.m.may_delete():
            return []
        horizon = time.time() - grace_seconds
        removed = []
        dirs = self.m._step_dirs()
        linked = self._skip_linked(s for s, _ in dirs)
        for step, name in dirs:
            with self.m._lock:
                if step == self.m._saving or step in linked:
                    continue
            path = self.m.fs.concat_path(self.m.root, name)
            stale = self._stale_leftover(path, horizon)
            if stale is not None:
                if not dry_run:
                    remove_leftovers(self.m.fs, path, stale)
                removed.append(step)
            elif not dry_run:
                self._remove_orphans(path, horizon)
        return removed

    def _remove_orphans(self, path: str, horizon: float) -> None:
        try:
            names = expand(self.m.fs, path)  # never into a linked prefix directory
        except (FileNotFoundError, NotADirectoryError):
            return
        if fmt.METADATA_NAME not in names or any(
            is_metadata_name(n) and n != fmt.METADATA_NAME for n in names
        ):
            return  # rank-local metadata: which files are whose is not ours to guess
        checkpoint = self.m.models.open(self.m.fs, path)
        referenced = checkpoint.data_files()
        if not checkpoint.readable or not referenced:
            return  # unreadable metadata: touch nothing
        for name in names:
            if not is_data_file_name(name) or name in referenced:
                continue
            file_path = self.m.fs.concat_path(path, name)
            try:
                mtime = self.m.fs.modified(file_path)
            except FileNotFoundError:
                continue
            if mtime is not None and mtime < horizon:
                log.info("%s: removing %s, which its metadata does not name", path, name)
                remove_quietly(self.m.fs, [file_path])

    def _skip_linked(self, steps: Any) -> set[int]:
        """Those of ``steps`` that are symbolic links, each logged as kept."""
        linked = set()
        for step in steps:
            path = self.m.fs.concat_path(self.m.root, f"{STEP_PREFIX}{step}")
            if self.m.fs.is_link(path):
                log.warning(
                    "%s is a symbolic link to a checkpoint elsewhere: kept, never deleted "
                    "through the link",
                    self.m.fs.url(path),
                )
                linked.add(step)
        return linked

    def _stale_leftover(self, path: str, horizon: float) -> list[str] | None:
        """The names in ``path`` if it is an uncommitted directory of checkpoint files
        all older than ``horizon``, else ``None``."""
        try:
            names = expand(self.m.fs, path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if any(is_metadata_name(n) for n in names):
            return None
        linked = [n for n in names if is_prefix(n) and is_linked(self.m.fs, path, n)]
        if linked:
            log.warning(
                "%s: not cleaned up: %s is a symbolic link, never followed",
                self.m.fs.url(path),
                ", ".join(linked),
            )
            return None
        if not all(is_checkpoint_file_name(n) for n in names):
            log.info("%s: not cleaned up, it holds files that are not ours", self.m.fs.url(path))
            return None
        try:
            times = [self.m.fs.modified(self.m.fs.concat_path(path, n)) for n in names] or [
                self.m.fs.modified(path)
            ]
        except FileNotFoundError:
            return None
        return names if all(t is not None and t < horizon for t in times) else None
