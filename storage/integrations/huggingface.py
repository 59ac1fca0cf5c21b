"""Hugging Face: the Transformers ``Trainer`` and Accelerate keep saving checkpoint folders
locally, as they do today; each folder is then drained to a bucket with the commit
protocol, checksums and retention of :mod:`storage.integrations.folders`, and training
resumes from the bucket.

* :class:`StorageTrainerCallback`: ``Trainer(..., callbacks=[StorageTrainerCallback(URL)])``
  drains every ``checkpoint-N`` after the Trainer wrote it; :meth:`~StorageTrainerCallback.restore`
  downloads one for ``trainer.train(resume_from_checkpoint=...)``.
* :class:`AcceleratorCheckpoints`: ``save_state`` / ``load_state`` around
  ``accelerator.save_state`` / ``accelerator.load_state``. Accelerate offers hooks only
  before it writes (``register_save_state_pre_hook``), so the drain wraps the call.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from extensions.errors import CheckpointStorageError
from storage.integrations._deps import require
from storage.integrations.folders import FolderCheckpoints

require("transformers", "huggingface")

from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR  # noqa: E402


class StorageTrainerCallback(TrainerCallback):
    """Drain each checkpoint folder the ``Trainer`` saves to ``root_url/step-N``
    (``N`` the global step), as one committed, checksummed checkpoint.

    Options are :class:`~storage.integrations.folders.FolderCheckpoints`' (``keep_last``
    for the bucket's retention, ``blocking``, ``storage_options``, ``transforms``, ...;
    the Trainer's ``save_total_limit`` still prunes the local folders). Uploads run in
    the background, one at a time, on the main process once every process has written
    its files; the next save and the end of training wait for them and raise a failed
    upload's error. Folders are found under ``args.output_dir`` (not a hyperparameter
    search's per-trial directories).
    """

    def __init__(self, root_url: str | os.PathLike[str], **options: Any) -> None:
        self.checkpoints = FolderCheckpoints(root_url, **options)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _barrier()  # every process has written its part of the folder (rng_state_N.pth)
        if state.is_world_process_zero:
            step = state.global_step
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
            self.checkpoints.save(folder, step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            self.checkpoints.close()

    def restore(self, output_dir: str | os.PathLike[str], step: int | None = None) -> str:
        """Download ``step`` (default: the newest committed) into
        ``output_dir/checkpoint-N`` and return that path, for
        ``trainer.train(resume_from_checkpoint=path)``. Run it on one process whose
        ``output_dir`` the others see (or on each node's for node-local disks)."""
        step = self.checkpoints.pick(step)
        folder = os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        return self.checkpoints.restore(folder, step)


class AcceleratorCheckpoints:
    """Accelerate's ``save_state`` folders drained to ``root_url/step-N``, and restored.

    Options are :class:`~storage.integrations.folders.FolderCheckpoints`'. Call both
    methods on every process, as Accelerate's own."""

    def __init__(self, root_url: str | os.PathLike[str], **options: Any) -> None:
        self.checkpoints = FolderCheckpoints(root_url, **options)

    def save_state(
        self,
        accelerator: Any,
        output_dir: str | os.PathLike[str] | None = None,
        *,
        step: int | None = None,
        **save_state_options: Any,
    ) -> str:
        """``accelerator.save_state(output_dir, ...)``, then drain the folder it wrote as
        ``step-{step}`` (default: Accelerate's save iteration). Returns the folder."""
        if step is None:
            step = accelerator.save_iteration
        if accelerator.is_main_process:
            self.checkpoints.wait()  # the upload in flight may be reading this very folder
        folder = os.fspath(accelerator.save_state(output_dir, **save_state_options))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            self.checkpoints.save(folder, step)
        return folder

    def load_state(
        self,
        accelerator: Any,
        local_dir: str | os.PathLike[str],
        *,
        step: int | None = None,
        **load_state_options: Any,
    ) -> int:
        """Download ``step`` (default: the newest committed) into
        ``local_dir/checkpoint_N`` on the main process, then
        ``accelerator.load_state`` it on every process; returns the step.
        ``local_dir`` must be visible to every process."""
        chosen: list[Any] = [None, None]  # the step, or why the main process failed
        if accelerator.is_main_process:
            try:
                chosen[0] = self.checkpoints.pick(step)
                self.checkpoints.restore(_accelerate_folder(local_dir, chosen[0]), chosen[0])
            except Exception as exc:  # the other processes must not wait forever
                chosen[1] = f"{type(exc).__name__}: {exc}"
                _share(chosen)
                raise
        _share(chosen)
        if chosen[1] is not None:
            raise CheckpointStorageError(f"the main process could not restore: {chosen[1]}")
        accelerator.wait_for_everyone()
        accelerator.load_state(_accelerate_folder(local_dir, chosen[0]), **load_state_options)
        return int(chosen[0])

    def wait(self) -> None:
        """Wait for the upload in flight; raise its error."""
        self.checkpoints.wait()


def _accelerate_folder(local_dir: str | os.PathLike[str], step: int) -> str:
    return os.path.join(local_dir, f"checkpoint_{step}")  # Accelerate's own naming


def _share(values: list[Any]) -> None:
    """The main process's ``values`` on every process."""
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(values, src=0)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
