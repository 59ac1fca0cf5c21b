"""torchtitan: its checkpoint manager, writing and reading through dcp-storage.

torchtitan's ``CheckpointManager`` (``torchtitan.components.checkpoint``, 0.3) calls
``dcp.save(..., checkpoint_id=...)`` with no writer hook and lists, checks and deletes
steps through fsspec with no client options. :class:`CheckpointManager` here is that
class with its storage seams replaced, selected in the trainer's config::

    from storage.integrations.torchtitan import CheckpointManager

    config.checkpoint = CheckpointManager.Config(
        enable=True, folder="s3://bucket/run1", interval=500, keep_latest_k=3,
        storage_options={"endpoint_url": ...}, transforms=[extensions.ZStandard()],
    )

Everything torchtitan decides stays torchtitan's (when to save, what goes in a step,
model-only and dtype-converted last steps, async modes and their process group,
``exclude_from_loading``, initial loads, Hugging Face exports). What changes:

* every DCP save goes through :class:`~storage.CheckpointWriter` (transforms,
  checksums, metadata-last commit) and every load through the checkpoint reader, with
  ``storage_options`` and ``keys``, for any path or URL dcp-storage serves;
* which step to resume from is the newest *committed* ``step-<N>`` (its metadata
  landed), found by :class:`storage.CheckpointManager`;
* with ``async_mode="async"``, the persist worker's staging buffers for the model's
  tensors are made when the manager is built (``storage.CheckpointManager.prepare``), so
  the first save's stall is a copy, not the first touch of fresh memory (tensors the
  optimizer makes at its first step get theirs at the first save);
* ``keep_latest_k`` is enforced by that manager's retention (metadata deleted first,
  steps that an incremental step references kept), on torchtitan's purge thread, after
  the last step's save too (torchtitan's own save skips its purge there).

Hugging Face safetensors exports and initial loads (``last_save_in_hf``,
``initial_load_in_hf``) are torchtitan's own local-disk code, unchanged.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import posixpath
import threading
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from storage.checkpoint.api import load as _load_url
from storage.checkpoint.api import save_with
from storage.checkpoint.layout import parse_step
from storage.checkpoint.writer import CheckpointWriter
from storage.integrations._deps import require
from storage.ops.manager import CheckpointManager as _StepManager

require(
    "torchtitan.components.checkpoint",
    "torchtitan",
    "pip install --no-deps torchtitan==0.3.0",  # its trainer's pins conflict with ours
)

from torch.distributed.checkpoint.state_dict_saver import (  # noqa: E402
    AsyncCheckpointerType,
    AsyncSaveResponse,
)
from torchtitan.components.checkpointer import dcp as _titan_dcp  # noqa: E402
from torchtitan.components.checkpointer.base import MODEL, purge_thread  # noqa: E402
from torchtitan.tools.utils import GarbageCollection  # noqa: E402

log = logging.getLogger(__name__)

__all__ = ["CheckpointManager"]


class CheckpointManager(_titan_dcp.CheckpointManager):
    """torchtitan's DCP checkpoint manager on dcp-storage (see the module docstring)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(_titan_dcp.CheckpointManager.Config):
        storage_options: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)
        """Client options for ``folder`` and ``initial_load_path`` (endpoint_url, key,
        secret, token, ...), as fsspec users pass them."""

        transforms: list[Any] = dataclasses.field(default_factory=list)
        """Stream transforms applied to every item, in order (e.g. ``ZStandard()``)."""

        keys: Any = dataclasses.field(default=None, repr=False)
        """Decryption keys for encrypted checkpoints: a mapping key_id -> 32-byte key, or
        a callable."""

        def to_dict(self) -> dict[str, Any]:
            # The trainer logs its config and writes it next to the run: option names
            # only, never a credential or a key.
            out = _titan_dcp.CheckpointManager.Config.to_dict(self)
            out["storage_options"] = sorted(self.storage_options)
            out["keys"] = None if self.keys is None else "<redacted>"
            return out

    def __init__(self, config: Config, **components: Any) -> None:
        super().__init__(config, **components)
        if not self.enable:
            return
        self._options = dict(config.storage_options)
        self._transforms = list(config.transforms)
        self._keys = config.keys
        self._steps = _StepManager(
            self.folder,
            keep_last=self.keep_latest_k or None,
            storage_options=self._options,
            transforms=self._transforms,
            keys=self._keys,
        )
        cached = getattr(self.states.get(MODEL), "cached_state_dict", None)
        if self.async_mode == _titan_dcp.AsyncMode.ASYNC and isinstance(cached, dict):
            # torchtitan's model wrapper holds its state dict from the start, so the
            # persist worker's staging buffers for it are made now, not by the first save.
            self._steps.prepare(cached)
        if self.purge_thread is not None:  # type: ignore[has-type]
            # torchtitan's thread deletes with fsspec's rmtree and no client options;
            # this one applies the step manager's retention instead.
            self.purge_queue.put(None)
            self.purge_thread.join()  # type: ignore[has-type]
            self.purge_thread = threading.Thread(
                target=purge_thread, args=(self.purge_queue, self._retain), daemon=True
            )
            self.purge_thread.start()

    # --- the DCP calls ---------------------------------------------------------------

    @torch.no_grad()
    def dcp_save(  # type: ignore[override]
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: _titan_dcp.AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future[Any] | AsyncSaveResponse | None:
        if to_hf:
            return super().dcp_save(
                state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
            )
        step = parse_step(posixpath.basename(checkpoint_id.rstrip("/")))
        if step is not None and checkpoint_id == self._create_checkpoint_id(step):
            self._steps.location.refuse_link(step)  # a linked step-N is someone else's
        writer = CheckpointWriter(
            checkpoint_id,
            transforms=self._transforms,
            storage_options=self._options,
            filesystem=self._fs_for(checkpoint_id),
        )
        result: Future[Any] | AsyncSaveResponse | None = None
        if async_mode == _titan_dcp.AsyncMode.ASYNC:
            result = dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)
        elif async_mode == _titan_dcp.AsyncMode.ASYNC_WITH_PINNED_MEM:
            result = dcp.async_save(
                state_dict,
                storage_writer=writer,
                process_group=self.pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self.stager,
            )
        else:
            save_with(writer, state_dict)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return result

    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        if from_hf:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        _load_url(
            state_dict,
            checkpoint_id,
            storage_options=self._options,
            keys=self._keys,
            filesystem=self._fs_for(checkpoint_id),
        )
        # torchtitan flattens the model's entries into the dict it loads.
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    # --- which step, and which steps to keep -----------------------------------------

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        committed = self._steps.steps()
        found = (committed[-1] if committed else None) if step == -1 else step
        if found is not None:
            checkpoint_id = self._create_checkpoint_id(found)
            if found not in committed:
                raise FileNotFoundError(
                    f"--checkpoint.load_step={step}: {checkpoint_id} is not a committed "
                    f"checkpoint; committed steps under {self.folder}: {committed or 'none'}"
                )
            states = self._states_to_load(model_only=found == 0)
            self.dcp_load(states, checkpoint_id, from_hf=False, from_quantized=False)
            log.info("loaded checkpoint %s", checkpoint_id)
            return True
        # Nothing committed under the folder: torchtitan's initial-load policy.
        from_hf = self.initial_load_in_hf
        if self.initial_load_path:
            checkpoint_id = self.initial_load_path
        elif from_hf and self.sd_adapter is not None and self.sd_adapter.hf_assets_path:
            checkpoint_id = self.sd_adapter.hf_assets_path
        else:
            log.info("no checkpoint under %s: a fresh start", self.folder)
            return False
        states = self._states_to_load(self.initial_load_model_only)
        self.dcp_load(
            states,
            checkpoint_id,
            from_hf=from_hf,
            from_quantized=self.initial_load_in_hf_quantized,
        )
        return True

    def _find_load_step(self, folder: str = "") -> int:
        steps = _StepManager(folder, storage_options=self._options) if folder else self._steps
        latest = steps.latest()
        return -1 if latest is None else latest

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        saved = bool(super()._save(curr_step, last_step))
        if saved and last_step:
            # torchtitan returns right after the last step's save, before its purge.
            self._purge_stale_checkpoints()
        return saved

    def _purge_stale_checkpoints(self) -> None:
        if self.keep_latest_k > 0 and self._steps.may_delete():
            self.purge_queue.put(self.folder)

    def _retain(self, folder: str) -> None:
        # Runs on the purge thread. An asynchronous save is still in flight when
        # torchtitan asks for the purge; retention counts committed steps only, so it
        # waits for that save to land first.
        pending = self.save_future
        if pending is not None:
            concurrent.futures.wait([pending])
        self._steps.apply_retention()

    def _fs_for(self, location: str) -> Any:
        """The step manager's backend where ``location`` lies under the folder (one set
        of connections), else None: the URL picks its own."""
        return self._steps.fs if location.startswith(self.folder) else None
