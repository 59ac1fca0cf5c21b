"""The error hierarchy shared by ``extensions`` and ``storage``.

Every error derives from :class:`CheckpointStorageError` and also from the built-in
exception a caller would naturally catch, so ``except FileNotFoundError`` keeps working.
Messages name the checkpoint, the item (when there is one) and what to do about it.
"""

from __future__ import annotations


class CheckpointStorageError(Exception):
    """Root of every error raised by dcp-storage."""


class CheckpointNotFoundError(CheckpointStorageError, FileNotFoundError):
    """The checkpoint, or a file it needs, does not exist (or is not committed)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CheckpointExistsError(CheckpointStorageError, FileExistsError, RuntimeError):
    """A committed checkpoint is already at the destination and overwriting was not allowed.

    Also a ``RuntimeError``, and its message starts with stock DCP's "Checkpoint already
    exists": code written against torch's ``FileSystemWriter`` catches it unchanged."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UnknownTransformError(CheckpointStorageError, KeyError):
    """A descriptor names a transform (or a version of one) that is not registered."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class MissingKeyError(CheckpointStorageError, KeyError):
    """An encrypted item needs a key id for which no key was provided."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class IntegrityError(CheckpointStorageError, ValueError):
    """Stored bytes do not match their checksum or fail authentication."""


class UnsafeCheckpointError(CheckpointStorageError, ValueError):
    """Metadata would execute code or reach outside the checkpoint; it is refused."""


class MissingDependencyError(CheckpointStorageError, ImportError):
    """An optional client library is not installed; the message names the extra."""


class TierFullError(CheckpointStorageError, OSError):
    """A checkpoint tier ran out of space (``ENOSPC``) while saving; nothing that was
    already committed there was deleted to make room."""
