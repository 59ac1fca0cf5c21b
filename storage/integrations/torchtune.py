"""torchtune: its distributed (DCP) checkpointer, writing and reading through dcp-storage.

torchtune (0.6) saves intermediate checkpoints with ``DistributedCheckpointer``, which
builds torch's ``FileSystemWriter`` / ``FileSystemReader`` on a local ``output_dir``;
its ``CheckpointClient`` (what the distributed recipes use) builds that checkpointer
itself when ``enable_async_checkpointing`` is on. Here:

* :class:`DistributedCheckpointer` is torchtune's, with ``output_dir`` any path or URL
  and saves and loads going through :class:`storage.CheckpointManager` (transforms,
  checksums, metadata-last commit, ``keep_last`` retention, asynchronous saves whose
  errors are raised). Epoch ``N`` is stored as ``<output_dir>/step-N``; resuming picks
  the newest *committed* one.
  Its ``prepare(state_dict)`` makes the persist worker's staging buffers for the
  state's tensors ahead of the first asynchronous save, so that save's stall is a copy,
  not the first touch of fresh memory (:meth:`storage.CheckpointManager.prepare`).
* :class:`CheckpointClient` is torchtune's, building that checkpointer from the recipe
  config's ``dcp_storage`` section. In a recipe (copied with ``tune cp``), import it
  instead of torchtune's; in the YAML::

      enable_async_checkpointing: True
      dcp_storage:
        url: s3://bucket/run1
        storage_options: {endpoint_url: ...}
        keep_last: 2
        transforms: [{_component_: extensions.ZStandard, level: 3}]

The final model is written by the recipe's own checkpointer, as before.
"""

from __future__ import annotations

import os
from typing import Any, cast

import torch.distributed as dist

from storage.checkpoint.api import load as _load_url
from storage.integrations._deps import require
from storage.ops.manager import CheckpointManager as _StepManager

require("torchtune.training.checkpointing", "torchtune")

from omegaconf import DictConfig, OmegaConf  # noqa: E402
from torchtune import config as _tt_config  # noqa: E402

from storage.integrations import _torchtune_compat as compat  # noqa: E402

__all__ = ["CheckpointClient", "DistributedCheckpointer"]


class DistributedCheckpointer(compat.TorchtuneDistributedCheckpointer):  # type: ignore[misc]
    """torchtune's ``DistributedCheckpointer`` on dcp-storage (see the module docstring).

    ``storage_options`` go to the client library, ``transforms`` to every save, ``keys``
    to every load (encrypted checkpoints), ``keep_last`` to retention. Recipes pass
    ``intermediate_checkpoint`` to a configured checkpointer's ``save_checkpoint`` and
    ``should_load_recipe_state`` to its constructor: both are accepted and change
    nothing (a DCP checkpoint holds exactly the state dict it is given)."""

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike[str],
        output_dir: str | os.PathLike[str],
        process_group: dist.ProcessGroup | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        transforms: list[Any] | None = None,
        keys: Any = None,
        keep_last: int | None = None,
        should_load_recipe_state: bool = False,
    ) -> None:
        super().__init__(os.fspath(checkpoint_dir), os.fspath(output_dir), process_group)
        self._options = dict(storage_options or {})
        self._keys = keys
        self._steps = _StepManager(
            output_dir,
            keep_last=keep_last,
            storage_options=self._options,
            transforms=transforms,
            keys=keys,
        )

    def _get_latest_intermediate_checkpoint(self) -> str | None:
        latest = self._steps.latest()
        return None if latest is None else self._steps.step_url(latest)

    def load_checkpoint(
        self,
        state_dict: dict[str, Any] | None = None,
        checkpoint_path: str | None = None,
    ) -> dict[str, Any]:
        """Load into ``state_dict`` in place: the checkpoint at ``checkpoint_path`` (a
        path or URL), else the newest committed epoch under ``output_dir``."""
        if state_dict is None:
            raise ValueError("State dict must be provided to load a distributed checkpoint.")
        if checkpoint_path is None:
            self._steps.load(state_dict)
        else:
            _load_url(state_dict, checkpoint_path, storage_options=self._options, keys=self._keys)
        return state_dict

    def save_checkpoint(
        self,
        state_dict: dict[str, Any],
        epoch: int,
        save_async: bool = False,
        intermediate_checkpoint: bool = True,
    ) -> None:
        """Save ``state_dict`` as epoch ``epoch``; ``save_async`` returns once it is
        staged (a previous asynchronous save is waited for first)."""
        future = self._steps.save(epoch, state_dict, blocking=not save_async)
        compat.set_checkpoint_future(self, future)

    def prepare(self, state_dict: dict[str, Any]) -> None:
        """Make the staging buffers of asynchronous saves (``save_async=True``) for the
        tensors of ``state_dict`` now (the model's ``state_dict()`` at setup, say: the
        buffers follow the tensors' storage, not their keys), so the first such save's
        stall is a copy into memory already touched. Stages and saves nothing; see
        :meth:`storage.CheckpointManager.prepare`."""
        self._steps.prepare(state_dict)


class CheckpointClient(compat.TorchtuneCheckpointClient):  # type: ignore[misc]
    """torchtune's ``CheckpointClient`` whose distributed checkpointer is
    :class:`DistributedCheckpointer`, configured by the ``dcp_storage`` section
    (``url``, default: the configured checkpointer's ``output_dir``;
    ``storage_options``, ``keep_last``, ``transforms`` as ``_component_`` entries)."""

    def _get_dcp_checkpointer(self) -> DistributedCheckpointer:
        if not compat.cached_dcp_checkpointer(self):
            section = compat.client_config(self).get("dcp_storage") or DictConfig({})
            url = section.get("url") or compat.output_dir(self._get_checkpointer())
            options = section.get("storage_options")
            storage_options = cast(dict[str, Any], OmegaConf.to_container(options or {}))
            checkpointer = DistributedCheckpointer(
                checkpoint_dir=url,
                output_dir=url,
                storage_options=storage_options,
                transforms=[_tt_config.instantiate(t) for t in section.get("transforms") or []],
                keep_last=section.get("keep_last"),
            )
            compat.cache_dcp_checkpointer(self, checkpointer)
        return cast(DistributedCheckpointer, compat.cached_dcp_checkpointer(self))
