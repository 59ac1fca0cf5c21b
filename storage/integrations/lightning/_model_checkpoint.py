"""Lightning's ``ModelCheckpoint`` that finds the last checkpoint under a URL
(:class:`StorageModelCheckpoint`)."""

from __future__ import annotations

import os
import re
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint

from extensions.errors import CheckpointNotFoundError
from storage.checkpoint.layout import metadata_names
from storage.checkpoint.options import resolve_location
from storage.checkpoint.siblings import names_under
from storage.integrations._versions import unlisted_versions
from storage.integrations.lightning._checkpoint_io import StorageCheckpointIO, is_url, path_text


class StorageModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose ``fit(ckpt_path="last")`` finds its last checkpoint
    under a URL ``dirpath``.

    Lightning's lookup lists ``dirpath`` through fsspec, which names what it finds
    without the scheme (``bucket/run1/last.ckpt``): it finds no local path of that name,
    warns, and the fit starts from step 0; and fsspec cannot date a prefix. This lists
    the committed ``last*.ckpt`` of a URL ``dirpath`` with the Trainer's
    :class:`StorageCheckpointIO` settings, asking by name for those a listing that lags
    misses (so it never resumes from an older one), and offers each by its metadata
    file (dated; loads here take it for its checkpoint, and ``ckpt_path`` names it).
    Committed checkpoints but no last one (``save_last`` unset) raise
    :class:`CheckpointNotFoundError` rather than a fit from step 0 beside them. A local
    ``dirpath`` keeps Lightning's lookup.
    """

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        dirpath = path_text(self._ModelCheckpoint__resolve_ckpt_dir(trainer))  # type: ignore[attr-defined]
        if not is_url(dirpath):
            return super()._find_last_checkpoints(trainer)
        io = trainer.strategy.checkpoint_io
        io = io if isinstance(io, StorageCheckpointIO) else StorageCheckpointIO()
        fs, location = resolve_location(dirpath, io.options_for(dirpath), None)
        names = names_under(fs, location)
        last = re.compile(rf"{re.escape(self.CHECKPOINT_NAME_LAST)}(-\d+)?")
        found, others = set(), []
        unlisted = unlisted_versions(
            fs,
            location,
            names,
            (self.CHECKPOINT_NAME_LAST, self.FILE_EXTENSION, self.CHECKPOINT_JOIN_CHAR),
            self.STARTING_VERSION,
        )
        for name in [*names, *unlisted]:
            stem, ext = os.path.splitext(name)
            if ext != self.FILE_EXTENSION:
                continue
            committing = metadata_names(fs, fs.concat_path(location, name))
            if committing and last.match(stem):
                found.add(f"{dirpath.rstrip('/')}/{name}/{committing[0]}")
            elif committing:
                others.append(name)
        if not found and others:
            # Lightning would warn and train from step 0 beside these checkpoints.
            raise CheckpointNotFoundError(
                f'fit(ckpt_path="last"): {dirpath} holds committed checkpoints '
                f"({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}) but no "
                f"{self.CHECKPOINT_NAME_LAST}{self.FILE_EXTENSION}; pass ckpt_path= the URL "
                "of the one to resume from, and save with StorageModelCheckpoint(save_last=True)"
            )
        return found
