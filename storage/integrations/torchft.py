"""torchft: a replica group heals from a live one through storage (disk or a bucket).

torchft's ``Manager`` moves the state of a healthy replica group to one that (re)joins
the quorum through a ``CheckpointTransport`` (HTTP between the hosts by default).
:class:`StorageCheckpointTransport` is one that goes through any root URL dcp-storage
serves (a local or shared path, ``s3://``, ``gs://``, any fsspec URL), with the
transforms and checksums of every dcp-storage checkpoint::

    from torchft import Manager
    from storage.integrations.torchft import StorageCheckpointTransport

    transport = StorageCheckpointTransport(
        "s3://bucket/ft", replica_id=replica_id, group_rank=group_rank,
        storage_options={...}, transforms=[extensions.ZStandard(level=1)],
    )
    manager = Manager(pg=pg, ..., replica_id=replica_id, checkpoint_transport=transport)

Worker ``group_rank`` of replica group ``replica_id`` writes the steps it sends to
``root/<replica_id>/replica-<group_rank>/step-<step>`` and keeps the newest ``keep_last``
of them (healing needs only the step in flight); a new transport deletes the steps it
finds there, sent before a restart (a receiver waiting for step N would otherwise load
the previous run's step N before this run's send of it lands). Its ``metadata()`` is that directory,
so a receiver reads from it whatever replica rank the sender has in the current quorum;
it also carries the sending transport's id (``<dir>#sender=<id>``), recorded in every
step it sends, and a receiver refuses a step there that another transport wrote
(another job given the same root and replica ids, a run before a restart).
A timeout raises ``TimeoutError`` saying "timed out", as torchft expects.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from extensions.base import Keys
from extensions.errors import UnsafeCheckpointError, quote
from extensions.registry import ExtensionRegistry
from storage.backends.base import FileSystemBase
from storage.checkpoint.options import resolve_location
from storage.integrations._deps import require
from storage.ops.transport import StorageTransport

require("torchft.checkpointing.transport", "torchft")

from torchft.checkpointing.transport import CheckpointTransport  # noqa: E402

__all__ = ["StorageCheckpointTransport"]

_REPLICA = re.compile(r"replica-[0-9]{1,9}")
_SENDER = "#sender="
_METADATA = re.compile(r"(.*)" + _SENDER + r"([0-9a-f]{32})", re.DOTALL)


def _is_group_name(name: object) -> bool:
    """Whether ``name`` can name a replica group's directory: one printable path
    component, never ``.`` or ``..`` (they would put it beside or above the root)."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and len(name) <= 255
        and name.isprintable()
        and not any(c in name for c in "/\\")
    )


class StorageCheckpointTransport(CheckpointTransport[dict[str, Any]]):
    """torchft's ``CheckpointTransport`` over :class:`~storage.StorageTransport`.

    ``replica_id`` is this replica group's id (the ``replica_id`` given to torchft's
    ``Manager``; one path segment, stable across restarts so a restarted group reuses
    and prunes its own directory) and ``group_rank`` this worker's rank in the group.
    ``keep_last``, ``storage_options``, ``transforms``, ``keys``, ``registry``,
    ``filesystem``, ``poll_interval``, ``max_bytes`` and the writer options are
    :class:`~storage.StorageTransport`'s. Every replica group needs the same root, the
    same ``storage_options`` and the keys of the transforms used.

    ``state_dict`` (as torchft's ``PGTransport`` takes it) returns this worker's own
    state as the Manager sends it, ``{"user": {"default": <the Manager's state_dict()>},
    "torchft": ...}`` (one entry per key registered with ``register_state_dict_fn``):
    a received DTensor is rebuilt on the mesh of this worker's DTensor at the same place.
    It is needed for DTensors on a slice of a device mesh (HSDP, FSDP with tensor
    parallelism); one on a whole mesh is rebuilt from the sender's ranks without it.
    It also sizes what a heal may allocate for what it receives: 4 times this state's
    bytes plus 64 MiB (a peer whose optimizer has stepped sends Adam's two moments this
    worker's may not hold yet); without it, this machine's memory. ``max_bytes`` sets
    that budget explicitly (:class:`~storage.StorageTransport`).
    """

    def __init__(
        self,
        root_url: str | os.PathLike[str],
        *,
        replica_id: str,
        group_rank: int = 0,
        keep_last: int = 1,
        storage_options: dict[str, Any] | None = None,
        transforms: Sequence[Any] | None = None,
        keys: Keys | None = None,
        registry: ExtensionRegistry | None = None,
        filesystem: FileSystemBase | None = None,
        poll_interval: float = 0.05,
        state_dict: Callable[[], Any] | None = None,
        max_bytes: int | None = None,
        **writer_options: Any,
    ) -> None:
        if not _is_group_name(replica_id):
            raise ValueError(
                f"replica_id must be a non-empty printable string without '/' or '\\', "
                f"and not '.' or '..' (it names the replica group's directory under "
                f"{os.fspath(root_url)!r}), got {quote(replica_id)}"
            )
        fs, root = resolve_location(root_url, storage_options, filesystem)
        self._root_url = fs.url(root)
        self.transport = StorageTransport(
            fs.url(fs.concat_path(root, replica_id)),
            rank=group_rank,
            keep_last=keep_last,
            storage_options=storage_options,
            transforms=transforms,
            keys=keys,
            registry=registry,
            filesystem=filesystem,
            poll_interval=poll_interval,
            state_dict=state_dict,
            max_bytes=max_bytes,
            **writer_options,
        )
        # A restarted group's directory holds what it sent before: a receiver told to
        # heal from step N at this worker would load that run's step N if one is there.
        self.transport.forget_sent()

    def metadata(self) -> str:
        """This worker's directory and this transport's id (``<dir>#sender=<id>``);
        torchft hands it to the workers that heal from it."""
        return f"{self.transport.replica_url()}{_SENDER}{self.transport.sender_id}"

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: dict[str, Any], timeout: timedelta
    ) -> None:
        self.transport.send_checkpoint(dst_ranks, step, state_dict, timeout)

    def disallow_checkpoint(self) -> None:
        self.transport.disallow_checkpoint()

    def recv_checkpoint(
        self, src_rank: int, metadata: str, step: int, timeout: timedelta
    ) -> dict[str, Any]:
        """Load the step that replica ``src_rank`` sent; ``metadata`` is what its
        :meth:`metadata` returned, which the quorum relays from the sender: it must be a
        worker's directory under this transport's root, or it is refused before anything
        is read (a sender could otherwise have this worker read, with its credentials,
        any location they reach, and send that state on at its next heal). A step
        there that another transport wrote than the one ``metadata`` names is refused."""
        url, sender_id = self._check_sender(src_rank, metadata)
        return self.transport.recv_replica(
            url, step, timeout, src_rank=src_rank, sender_id=sender_id
        )

    def _check_sender(self, src_rank: int, metadata: object) -> tuple[str, str]:
        """The directory and the sender's id in ``metadata``, refused unless the
        directory is a worker's under this transport's root."""
        base = self._root_url.rstrip("/") + "/"
        found = _METADATA.fullmatch(metadata) if isinstance(metadata, str) else None
        url = found[1] if found else ""
        group, _, replica = url[len(base) :].partition("/")
        if not (
            found and url.startswith(base) and _is_group_name(group) and _REPLICA.fullmatch(replica)
        ):
            raise UnsafeCheckpointError(
                f"replica {src_rank} sent {quote(metadata)} as where to heal from, which is "
                f"not a worker's directory under this transport's root {self._root_url} "
                f"with its transport's id (<root>/<replica_id>/replica-<group_rank>{_SENDER}"
                "<id>, what metadata() returns); nothing was read: give every replica group "
                "the same root URL and the same dcp-storage version"
            )
        return url, found[2]

    def shutdown(self, wait: bool = True) -> None:
        self.transport.shutdown(wait=wait)
