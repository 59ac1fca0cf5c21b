"""The DCP plug-in: ``CheckpointWriter`` / ``CheckpointReader`` (torch's
``StorageWriter`` / ``StorageReader``), the on-storage format, what counts as a
checkpoint on storage (layout), the commit protocol and the one-call helpers.

Imports ``storage.backends`` and ``extensions``; never ``storage.ops`` or ``storage.cli``."""

from storage.checkpoint.api import async_save, load, save
from storage.checkpoint.reader import CheckpointReader
from storage.checkpoint.writer import CheckpointWriter

__all__ = ["CheckpointReader", "CheckpointWriter", "async_save", "load", "save"]
