"""The error hierarchy shared by ``extensions`` and ``storage``.

Every error derives from :class:`CheckpointStorageError` and also from the built-in
exception a caller would naturally catch, so ``except FileNotFoundError`` keeps working.
Messages name the checkpoint, the item (when there is one) and what to do about it.
"""

from __future__ import annotations

from itertools import islice


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


class CheckpointInUseError(UnsafeCheckpointError):
    """Deleting or overwriting a checkpoint would break others that reference its bytes
    (incremental checkpoints); it is refused. The message names them and the fix."""


class MissingDependencyError(CheckpointStorageError, ImportError):
    """An optional client library is not installed; the message names the extra."""


class TierFullError(CheckpointStorageError, OSError):
    """A checkpoint tier ran out of space (``ENOSPC``) while saving; nothing that was
    already committed there was deleted to make room."""


class WorkerDiedError(CheckpointStorageError, RuntimeError):
    """The checkpoint persist worker process died (killed, out of memory, crashed):
    the saves it was writing are not committed, committed checkpoints are untouched,
    and the next save starts a new worker."""


# --- quoting untrusted values in messages ---------------------------------------------
#
# Item names, paths and descriptors come from the checkpoint, which may be hostile: a
# value quoted in a message must cost little to format however it is built (shared
# references make a 2 KB pickle an exponential tree) and must not carry terminal escape
# sequences to whoever reads the message.

_QUOTE_LIMIT = 160
_QUOTE_ITEMS = 8
_QUOTE_DEPTH = 3
_PLAIN_ATOMS = (bool, float, complex, type(None))


def quote(value: object, limit: int = _QUOTE_LIMIT) -> str:
    """``repr`` of an untrusted ``value`` for a message: at most ``limit`` characters
    (plus ``...``), control characters escaped, containers cut after a few elements
    and levels, objects of other types shown by type name only."""
    text = _quote(value, _QUOTE_DEPTH, limit)
    return text if len(text) <= limit else text[:limit] + "..."


def _quote(value: object, depth: int, limit: int) -> str:
    if isinstance(value, str):
        return repr(value[:limit])  # repr escapes control and non-printable characters
    if isinstance(value, (bytes, bytearray)):
        return repr(bytes(value[:limit]))
    if isinstance(value, int) and not isinstance(value, bool):
        # Formatting a huge int is quadratic (and refused past 4300 digits).
        return repr(value) if value.bit_length() <= 128 else f"<int of {value.bit_length()} bits>"
    if isinstance(value, _PLAIN_ATOMS):
        return repr(value)
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        if depth <= 0:
            return f"<{type(value).__name__} of {len(value)}>"
        items = list(islice(value.items() if isinstance(value, dict) else value, _QUOTE_ITEMS))
        if isinstance(value, dict):
            parts = [
                f"{_quote(k, depth - 1, limit)}: {_quote(v, depth - 1, limit)}" for k, v in items
            ]
        else:
            parts = [_quote(v, depth - 1, limit) for v in items]
        more = ", ..." if len(value) > len(items) else ""
        body = ", ".join(parts)[:limit] + more
        if isinstance(value, dict):
            return "{" + body + "}"
        if isinstance(value, list):
            return "[" + body + "]"
        return f"{type(value).__name__}([{body}])" if type(value) is not tuple else f"({body})"
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def printable(text: str, limit: int | None = None) -> str:
    """``text`` with control and other non-printable characters escaped (``\\x1b``),
    cut to ``limit`` characters (plus ``...``) when one is given: safe to print to a
    terminal when parts of it come from a checkpoint."""
    if limit is not None and len(text) > limit:
        text = text[:limit] + "..."
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
