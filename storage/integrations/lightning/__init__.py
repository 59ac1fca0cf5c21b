"""PyTorch Lightning: checkpoints to any dcp-storage URL (``s3://``, ``gs://``, fsspec,
local paths).

* :class:`StorageCheckpointIO`, a ``CheckpointIO`` plugin, for the strategies that save
  one checkpoint from global rank 0 (single device, DDP):
  ``Trainer(plugins=[StorageCheckpointIO(storage_options=...)])``.
* :class:`StorageModelParallelStrategy` and :class:`StorageFSDPStrategy`, Lightning's
  ``ModelParallelStrategy`` (FSDP2, tensor parallel) and ``FSDPStrategy`` (FSDP1) whose
  sharded saves and loads go through our writer and reader: the stock strategies
  bypass ``CheckpointIO`` and let ``dcp.save`` pick a local ``FileSystemWriter``. They
  take their settings from a ``StorageCheckpointIO`` among the Trainer's plugins.
* :class:`StorageModelCheckpoint`, a ``ModelCheckpoint`` whose ``ckpt_path="last"``
  finds the last checkpoint under a URL ``dirpath`` (Lightning's lookup finds none
  there and starts from step 0).

A checkpoint path names a DCP checkpoint directory (or key prefix), committed like
every save here: data first, metadata last, one CRC-32C per item, the plugin's
transforms. ``ModelCheckpoint(dirpath="s3://...")`` works as with any fsspec URL (it
lists and checks existence through fsspec, so that client must reach the bucket too,
e.g. through ``AWS_ENDPOINT_URL``); ``trainer.fit(ckpt_path=URL)`` resumes.
"""

from storage.integrations._deps import require

require("lightning.pytorch.plugins.io", "lightning")

from storage.integrations.lightning._checkpoint_io import PREFIX, StorageCheckpointIO  # noqa: E402
from storage.integrations.lightning._model_checkpoint import StorageModelCheckpoint  # noqa: E402
from storage.integrations.lightning._sharded import (  # noqa: E402
    StorageFSDPStrategy,
    StorageModelParallelStrategy,
)

__all__ = [
    "PREFIX",
    "StorageCheckpointIO",
    "StorageFSDPStrategy",
    "StorageModelCheckpoint",
    "StorageModelParallelStrategy",
]
