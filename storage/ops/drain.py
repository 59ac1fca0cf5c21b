"""The drain's copy of one step from a local tier to the durable root.

Each rank copies its own data files from its node's tier (items keep their stored
bytes; references to a base stay references where the root holds that base, see
:func:`storage.ops.copy.copy_data_files`), pausing while a save of the same manager
writes locally. Rank 0 publishes the root's metadata once every rank reports its files
there, or removes them all when any rank failed, so the durable copy exists only whole.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from extensions.errors import CheckpointNotFoundError
from storage.checkpoint import persist
from storage.checkpoint.commit import remove_quietly
from storage.ops.copy import copy_data_files, publish_copy
from storage.ops.tools import read_metadata

if TYPE_CHECKING:
    from storage.ops.tiers import LocalTier

log = logging.getLogger("storage.ops.tiers")  # one logger for everything tiers say


def drain_step(tier: LocalTier, step: int) -> None:
    """Copy ``step`` from ``tier`` to its manager's root; collective (on the drains'
    group), raises on every rank if it failed on any, and commits nothing then."""
    g, local, root = tier.group, tier.local, tier.manager
    fs = root.fs
    src, dst = local.step_path(step), root.step_path(step)
    copied, error, part = None, None, None
    try:
        parts = read_metadata(local.fs, src, opened=tier._model(step))
        if len(parts) != 1:  # the manager saves with collectives: one .metadata
            raise CheckpointNotFoundError(
                f"{local.step_url(step)} is committed by rank-local metadata "
                f"({', '.join(p.name for p in parts)}); only a checkpoint with one "
                ".metadata drains"
            )
        part = parts[0]
        copied = persist.run(
            persist.mode_for(root.writer_options, local.fs, fs),
            copy_data_files,
            local.fs,
            src,
            fs,
            dst,
            part,
            ranks=None if g.world == 1 else {g.rank},
            thread_count=root.writer_options.get("thread_count"),
            pace=tier.pause,
            keep_references=True,
        )
    except Exception as exc:
        error = exc
    gathered = g.all_gather((copied, _text(error)), pg=g.drain_pg)
    outcome = next((t for _, t in gathered if t is not None), None)
    if g.rank == 0:
        copies = [c for c, _ in gathered if c is not None]
        if outcome is not None:
            remove_quietly(fs, [p for c in copies for p in c.written])
        else:
            assert part is not None
            try:
                overwrite = bool(root.writer_options.get("overwrite", True))
                publish_copy(fs, dst, part, copies, overwrite=overwrite)
            except Exception as exc:
                error, outcome = exc, _text(exc)
    outcome = g.broadcast(outcome, pg=g.drain_pg)
    if error is not None:
        raise error
    if outcome is not None:
        raise RuntimeError(f"draining step {step} to {root.url} failed: {outcome}")
    log.info("step %d is durable at %s", step, root.step_url(step))


def _text(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"
