"""Operations around checkpoints: the ``CheckpointManager`` (steps, retention,
cleanup), the tools behind the CLI (describe, verify, copy), the recovery transport and
the demo. Imports ``storage.checkpoint`` and ``storage.backends``; never ``storage.cli``."""

from storage.ops.manager import CheckpointManager
from storage.ops.transport import StorageTransport

__all__ = ["CheckpointManager", "StorageTransport"]
