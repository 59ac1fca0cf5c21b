"""One-call helpers: ``save``, ``load`` and ``async_save``.

Unlike ``dcp.save``/``dcp.load``, which wrap every storage error in
``CheckpointException`` (a ``BaseException`` carrying the real error as text), these
raise the real error: ``FileNotFoundError``, ``IntegrityError``, ... with its message.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from extensions.base import Keys
from extensions.errors import quote
from extensions.registry import ExtensionRegistry
from storage.checkpoint.reader import CheckpointReader
from storage.checkpoint.writer import CheckpointWriter


@dataclass(frozen=True)
class ReaderOptions:
    """What every load of a caller's checkpoints needs besides their location (see
    :class:`CheckpointReader`): ``keys`` for encrypted items, a ``registry`` of
    transforms, ``require_encryption`` (default: on when ``keys`` are given). Callers
    that load many times (a manager and its tiers, a framework plugin) hold them here."""

    keys: Keys | None = field(default=None, repr=False)  # key bytes: never in a repr
    registry: ExtensionRegistry | None = None
    require_encryption: bool | None = None

    def as_kwargs(self) -> dict[str, Any]:
        """As keyword arguments of :class:`CheckpointReader` and :func:`load`."""
        return {
            "keys": self.keys,
            "registry": self.registry,
            "require_encryption": self.require_encryption,
        }


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    # torch warns on every call without a process group, even with no_dist=True;
    # one process is a normal way to use the helpers.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def unwrap_checkpoint_exception(exc: CheckpointException, plugin: Any = None) -> BaseException:
    """The real error inside a ``CheckpointException``: the one this process's
    writer/reader raised if any (torch may have replaced it by an AssertionError that
    only quotes it), else the first rank's."""
    own = getattr(plugin, "last_error", None)
    if isinstance(own, BaseException):
        return own
    failures = getattr(exc, "failures", None) or {}
    for rank in sorted(failures):
        failure = failures[rank]
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            return inner
    return exc


def save(
    state_dict: dict[str, Any],
    url: str | os.PathLike[str],
    *,
    transforms: Sequence[Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    **writer_options: Any,
) -> None:
    """Save ``state_dict`` to ``url`` (a path or URL) with :class:`CheckpointWriter`.

    ``writer_options`` are the writer's keyword options (``overwrite``,
    ``thread_count``, ...). Runs collectively when a process group is initialized."""
    writer = CheckpointWriter(
        url, transforms=transforms, storage_options=storage_options, **writer_options
    )
    save_with(writer, state_dict)


def save_with(
    writer: StorageWriter, state_dict: dict[str, Any], *, process_group: Any = None
) -> None:
    """``dcp.save`` through ``writer`` (collective under a process group: the default
    one, or ``process_group``), raising the real error and removing what this rank wrote
    when the save fails (a writer with an ``abort``, as ours)."""
    try:
        with _quiet_single_process():
            dcp.save(
                state_dict,
                storage_writer=writer,
                no_dist=_no_dist(),
                process_group=process_group,
            )
    except CheckpointException as exc:
        abort = getattr(writer, "abort", None)
        if abort is not None:
            abort(exc)
        real = unwrap_checkpoint_exception(exc, writer)
        raise real from real.__cause__  # its own cause kept, DCP's wrapper hidden


def load(
    state_dict: dict[str, Any],
    url: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    keys: Keys | None = None,
    registry: ExtensionRegistry | None = None,
    require_encryption: bool | None = None,
    **reader_options: Any,
) -> None:
    """Load the checkpoint at ``url`` into ``state_dict`` in place.

    With ``keys``, every item must be encrypted unless ``require_encryption=False``
    (see :class:`CheckpointReader`)."""
    # Every rank reads the metadata here together: the coordinator reads it for all.
    reader_options.setdefault("share_metadata", not _no_dist())
    reader = CheckpointReader(
        url,
        storage_options=storage_options,
        keys=keys,
        registry=registry,
        require_encryption=require_encryption,
        **reader_options,
    )
    load_with(reader, state_dict)


def load_with(reader: StorageReader, state_dict: dict[str, Any]) -> None:
    """``dcp.load`` through ``reader`` into ``state_dict`` in place (collective under a
    process group), raising the real error."""
    _check_top_keys(state_dict)
    try:
        with _quiet_single_process():
            dcp.load(state_dict, storage_reader=reader, no_dist=_no_dist())
    except CheckpointException as exc:
        real = unwrap_checkpoint_exception(exc, reader)
        raise real from real.__cause__  # its own cause kept, DCP's wrapper hidden


def _check_top_keys(state_dict: dict[Any, Any]) -> None:
    # dcp.load sorts the top-level keys: {1: ..., "a": ...} saves, then fails to load
    # with a bare "'<' not supported" (stock too).
    try:
        sorted(state_dict)
    except TypeError:
        kinds = ", ".join(sorted({type(k).__name__ for k in state_dict}))
        raise TypeError(
            f"the state dict's top-level keys mix types ({kinds}: "
            f"{quote(list(state_dict)[:6])}), and dcp.load sorts them: load into "
            "{str(k): v for k, v in state_dict.items()} instead (a checkpoint names every "
            "key as str(key), so the same items load)"
        ) from None


def plain_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with its ``Stateful`` values replaced by their state dicts, as
    ``dcp.async_save`` does before staging."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}


def async_save(
    state_dict: dict[str, Any],
    url: str | os.PathLike[str],
    *,
    transforms: Sequence[Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    async_checkpointer_type: AsyncCheckpointerType = AsyncCheckpointerType.THREAD,
    process_group: Any = None,
    **writer_options: Any,
) -> Future[None]:
    """Stage ``state_dict`` to CPU memory now and save it in the background.

    Returns a ``concurrent.futures.Future`` that resolves to ``None`` once the
    checkpoint is committed, or raises the real error. The caller may change its
    tensors as soon as this returns. ``async_checkpointer_type`` picks DCP's executor:
    a background thread (default) or a separate process (``PROCESS``, which needs an
    initialized process group, as in torch).

    Under a process group the save's collectives run in the background, beside the
    job's own: pass a ``process_group`` that nothing else uses while the save runs
    (e.g. ``dist.new_group(backend="gloo")``, made once), or the two interleave on the
    default group and gloo aborts. :class:`~storage.ops.manager.CheckpointManager`
    makes one for its asynchronous saves."""
    writer = CheckpointWriter(
        url, transforms=transforms, storage_options=storage_options, **writer_options
    )
    return async_save_with(
        writer,
        state_dict,
        async_checkpointer_type=async_checkpointer_type,
        process_group=process_group,
    )


def async_save_with(
    writer: CheckpointWriter,
    state_dict: dict[str, Any],
    *,
    async_checkpointer_type: AsyncCheckpointerType = AsyncCheckpointerType.THREAD,
    process_group: Any = None,
) -> Future[None]:
    """:func:`async_save` through ``writer``, made by the caller (who may read what it
    published once the future resolves)."""
    with _quiet_single_process():
        inner = dcp.async_save(
            state_dict,
            storage_writer=writer,
            no_dist=_no_dist(),
            async_checkpointer_type=async_checkpointer_type,
            process_group=process_group,
        )
    staging = getattr(inner, "staging_completion", None)
    if staging is not None:  # async_staging: this returns once the copy is done
        concurrent.futures.wait([staging])  # its error, if any, fails the upload
    upload: Any = getattr(inner, "upload_completion", inner)
    outer: Future[None] = Future()

    def done(fut: Any) -> None:
        try:
            fut.result()
        except CheckpointException as exc:
            writer.abort(exc)
            outer.set_exception(unwrap_checkpoint_exception(exc, writer))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            outer.set_exception(exc)
        else:
            outer.set_result(None)

    upload.add_done_callback(done)
    return outer
