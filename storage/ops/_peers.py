"""Process-group plumbing for the manager and its tiers: which ranks share a node-local
tier, which peer holds a rank's replica, collectives on a group of their own, moving
checkpoint files between node-local tiers over the process group, errors and decisions
shared by every rank.

Without a process group everything here degrades to one rank on one node.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist

from extensions.errors import CheckpointStorageError
from extensions.streams import readinto_exact
from storage.backends.base import FileSystemBase
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.commit import commit_may_have_landed, mark_may_have_landed, remove_quietly

_CHUNK = 16 << 20  # bytes per send: bounds the memory a transfer holds


@dataclass
class Group:
    """This rank's place in the job. ``nodes`` lists the ranks of each node (ranks
    that see the same local tier), lowest rank first; ``peer[r]`` is the rank whose
    local tier holds rank ``r``'s replica (``None``: not replicated)."""

    rank: int = 0
    world: int = 1
    nodes: list[list[int]] = field(default_factory=lambda: [[0]])
    peer: dict[int, int | None] = field(default_factory=dict)
    # Gloo groups of our own, so background collectives never race the job's (on the
    # default group) or each other: ``drain_pg`` for drains, ``save_pg`` for the
    # background half of asynchronous saves.
    drain_pg: Any = None
    save_pg: Any = None

    @property
    def node(self) -> list[int]:
        return next(n for n in self.nodes if self.rank in n)

    @property
    def leader(self) -> bool:
        """The lowest rank of this node: it publishes and deletes in the local tier."""
        return self.node[0] == self.rank

    def node_of(self, rank: int) -> list[int]:
        return next(n for n in self.nodes if rank in n)

    def all_gather(self, obj: Any, *, pg: Any = None) -> list[Any]:
        """Every rank's ``obj``, over ``pg`` (default: the job's default group, from the
        caller's thread; background threads pass one of ours)."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=pg)
        return out

    def broadcast(self, obj: Any, *, pg: Any = None, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank, over ``pg``."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=pg)
        return box[0]


def make_group(local_url: str, replicate: bool | Callable[[int], int], *, own_pg: bool) -> Group:
    """Describe the job (collective under a process group). Ranks on one host that
    name the same local tier form a node. ``replicate=True`` picks the rank with the
    same position on the next node; a callable maps a rank to its peer."""
    if not (dist.is_available() and dist.is_initialized()):
        return Group(peer={0: None})
    rank, world = dist.get_rank(), dist.get_world_size()
    seen: list[Any] = [None] * world
    dist.all_gather_object(seen, (socket.gethostname(), local_url))
    by_key: dict[Any, list[int]] = {}
    for r, key in enumerate(seen):
        by_key.setdefault(key, []).append(r)
    nodes = sorted(by_key.values())
    peer: dict[int, int | None] = {}
    for r in range(world):
        if callable(replicate):
            peer[r] = int(replicate(r))
        elif replicate and len(nodes) > 1:
            index = next(i for i, n in enumerate(nodes) if r in n)
            position = nodes[index].index(r)
            after = nodes[(index + 1) % len(nodes)]
            peer[r] = after[min(position, len(after) - 1)]
        else:
            peer[r] = None
    drain_pg = dist.new_group(backend="gloo") if own_pg else None
    save_pg = dist.new_group(backend="gloo") if own_pg else None
    return Group(rank, world, nodes, peer, drain_pg, save_pg)


Move = tuple[int, int, Sequence[str]]  # (from rank, to rank, file names)


def transfer(
    group: Group,
    moves: Sequence[Move],
    fs: FileSystemBase,
    directory: str,
    *,
    sync: bool,
    pg: Any = None,
) -> int:
    """Copy files between node-local tiers: for each ``(src, dst, names)``, rank
    ``src`` sends each named file of ``directory`` in its tier and rank ``dst`` writes
    it under the same name in its own. Every rank walks the same list in order and
    takes part only in its moves, so no cycle of waits can form. Collective on ``pg``
    (default: the default group); returns the bytes this rank sent."""
    sent = 0
    for src, dst, names in moves:
        if group.rank not in (src, dst) or src == dst:
            continue
        for name in names:
            if group.rank == src:
                sent += _send_file(fs, fs.concat_path(directory, name), dst, pg)
            else:
                _recv_file(fs, directory, name, src, pg, sync=sync)
    return sent


def _send_file(fs: FileSystemBase, path: str, dst: int, pg: Any) -> int:
    size = fs.size(path)
    dist.send(torch.tensor([size], dtype=torch.int64), dst, group=pg)
    buffer = torch.empty(min(_CHUNK, size), dtype=torch.uint8)  # read into, sent from
    view = buffer.numpy().data
    with fs.create_stream(path, "rb") as stream:
        left = size
        while left:
            n = min(_CHUNK, left)
            if readinto_exact(stream, view[:n]) < n:
                raise EOFError(f"{fs.url(path)} ended early while sending it")
            dist.send(buffer[:n], dst, group=pg)
            left -= n
    return size


def _recv_file(
    fs: FileSystemBase, directory: str, name: str, src: int, pg: Any, *, sync: bool
) -> None:
    """Receive ``directory/name`` whole or not at all: a data file is written under a name of its
    own that no metadata names (:func:`receiving_name`), then renamed into place, so a
    receive that fails is removed here and one killed mid-file is an unnamed data file
    that ``gc`` sweeps, never a truncated file under a name the metadata trusts; the
    metadata is received in memory and published atomically."""
    path = fs.concat_path(directory, name)
    header = torch.zeros(1, dtype=torch.int64)
    dist.recv(header, src, group=pg)
    left = int(header.item())
    metadata = not path.endswith(fmt.DATA_SUFFIX)
    if left < 0 or (metadata and left > fmt.MAX_METADATA_BYTES):
        raise CheckpointStorageError(
            f"rank {src} announced {left} bytes for {fs.url(path)}, which no "
            f"{'metadata' if metadata else 'data'} file holds; nothing was written: the "
            "peer's local tier is damaged (restore from the bucket)"
        )
    buffer = torch.empty(min(_CHUNK, left), dtype=torch.uint8)
    if metadata:
        received = bytearray()
        while left:
            chunk = buffer[: min(_CHUNK, left)]
            dist.recv(chunk, src, group=pg)
            received += chunk.numpy().tobytes()
            left -= chunk.numel()
        fs.write_atomic_in(directory, name, bytes(received))  # never through a link below
        return
    partial = receiving_name(name)
    try:
        with fs.create_stream_in(directory, partial, "wb", sync=sync) as out:
            while left:
                chunk = buffer[: min(_CHUNK, left)]
                dist.recv(chunk, src, group=pg)
                out.write(chunk.numpy().data)
                left -= chunk.numel()
        fs.rename_in(directory, partial, name)
    except BaseException:
        remove_quietly(fs, directory, [partial])
        raise


def receiving_name(path: str) -> str:
    """Where a data file received from a peer is written before it is renamed to
    ``path``: the same name with a unique save id (``__0_1-<id>.distcp`` becomes
    ``__0_1-<id>r<hex>.distcp``), still a data file name."""
    stem = path[: -len(fmt.DATA_SUFFIX)]
    joint = "" if "-" in stem.rsplit("/", 1)[-1] else "-"
    return f"{stem}{joint}r{uuid.uuid4().hex[:12]}{fmt.DATA_SUFFIX}"


def gather_errors(
    group: Group,
    error: BaseException | None,
    what: str,
    *,
    pg: Any = None,
    landed: bool = False,
    commit_follows: bool = False,
) -> None:
    """Raise on every rank if ``error`` was raised on any: this rank's own error, or a
    ``RuntimeError`` naming the first failing rank's. A commit that landed on some rank
    (``landed``) or may have (``commit.commit_may_have_landed``) marks the error raised
    on every rank, so that none removes its files. ``commit_follows``: a rank that gets
    through this gather may commit this rank's files (or has committed them): when the
    gather itself fails here (a rank died in it, and the ranks no longer share one
    outcome), its error is marked the same way."""
    text = None if error is None else f"{type(error).__name__}: {error}"
    try:
        gathered = group.all_gather((text, landed or commit_may_have_landed(error)), pg=pg)
    except Exception as exc:
        if commit_follows:
            mark_may_have_landed(exc)
        raise
    failed = [(r, t) for r, (t, _) in enumerate(gathered) if t is not None]
    if error is None and failed:
        error = RuntimeError(f"{what} failed on rank {failed[0][0]}: {failed[0][1]}")
    if error is None:
        return
    if any(landed for _, landed in gathered):
        mark_may_have_landed(error)
    raise error


def decided_by_rank_zero(
    decide: Callable[[], int | None], what: str = "the step to load"
) -> int | None:
    """``decide()`` on rank 0, broadcast to every rank (just ``decide()`` without a
    process group): a choice made from a listing, which ranks may see differently.
    ``what``: the choice, for the error the other ranks raise when rank 0 failed."""
    if not (dist.is_available() and dist.is_initialized()):
        return decide()
    choice: list[Any] = [None, None]  # the decision, or why rank 0 could not make it
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            choice[0] = decide()
        except Exception as exc:  # the other ranks must not wait for an answer forever
            error, choice[1] = exc, f"{type(exc).__name__}: {exc}"
    dist.broadcast_object_list(choice, src=0)
    if error is not None:
        raise error
    if choice[1] is not None:
        raise CheckpointStorageError(f"rank 0 could not pick {what}: {choice[1]}")
    return cast(int | None, choice[0])
