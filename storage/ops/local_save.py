"""One save into a local tier: its refusals, its base, its writes, its replicas, each
node's commit.

Every rank writes its data files to its node's tier with a writer that does not publish
(``CheckpointWriter(publish=False)``): the coordinator's node does not hold the other
nodes' files. The coordinator's metadata is broadcast, each rank sends its files to its
peer (``replicate``), and once every rank is done, the lowest rank of each node commits
that node's copy with the commit transaction (``commit.commit_checkpoint``: its ranks'
files and the replicas it holds, under the writer's deadline). An error on any rank
fails the save on every rank, each removing what it wrote unless a commit may have
landed somewhere: also when a gather after the writes fails in the collective itself (a
rank died in it), as a leader that got through it may have committed this rank's files.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from extensions.errors import TierFullError, UnsafeCheckpointError, printable
from storage.backends import LocalFileSystem
from storage.checkpoint import api, heartbeat
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.commit import commit_checkpoint
from storage.checkpoint.deadline import DeadlineExceededError
from storage.checkpoint.layout import make_directory
from storage.checkpoint.writer import CheckpointWriter
from storage.ops._peers import Group, Move, gather_errors, transfer
from storage.ops.base_choice import Candidate, choose_base
from storage.ops.steps import StepRoot

log = logging.getLogger("storage.ops.tiers")  # one logger for everything tiers say


def base_for(
    g: Group,
    local: StepRoot,
    step: int,
    *,
    incremental: bool,
    full_every: int | None,
    transforms: Sequence[Any] = (),
    pg: Any = None,
) -> int | None:
    """The base of an incremental save of ``step``
    (:func:`~storage.ops.base_choice.choose_base`) among the steps committed in every
    node's local tier (a reference is resolved in the tier that holds the referencing
    step). A candidate that cannot be a base on some rank (``StepRoot.base_problem``,
    the root's rule) or whose nodes' copies are different saves (a reference names files
    of one save) makes the save a full one, which is logged. Collective on ``pg``."""

    def committed() -> set[int]:
        views = g.all_gather([s for s in local.steps() if s < step], pg=pg)
        return set.intersection(*(set(v) for v in views))

    def facts(base: int) -> Candidate:
        why = local.base_problem(base, transforms)
        verdicts = g.all_gather((why, None if why else local.save_id(base)), pg=pg)
        problems = [(rank, w) for rank, (w, _) in enumerate(verdicts) if w is not None]
        if problems:
            rank, why = problems[0]
            return Candidate(f"{why}, on rank {rank}" if g.world > 1 else why)
        if len({save_id for _, save_id in verdicts}) > 1:
            return Candidate("the nodes' local copies of it are different saves")
        return Candidate(None, local.model(base).chain)

    choice = choose_base(step, committed, facts, incremental=incremental, full_every=full_every)
    if choice.note is not None:
        log.info("%s", choice.note)
    return choice.base


def refuse_links(g: Group, local: StepRoot, root: StepRoot, step: int, *, pg: Any) -> None:
    """Raise on every rank, before anything is written, if ``step``'s directory is a
    symbolic link in some node's ``local`` tier (the save would write through it) or
    under the ``root`` (its drain would): ``StepRoot.refuse_link``. Collective on ``pg``."""
    error: UnsafeCheckpointError | None = None
    try:
        local.refuse_link(step)
        root.refuse_link(step)
    except UnsafeCheckpointError as exc:
        error = exc
    gather_errors(g, error, f"saving step {step}", pg=pg)


def refuse_shared_tier(g: Group, local: StepRoot) -> None:
    """Make ``local`` where it is on local disk (this user's from now on), then raise on
    every rank, before the tier is listed, drained or written, if some node's tier is
    open to other users (``StepRoot.open_to_others``); that refusal is raised even where
    making the tier failed (another user's link may lead where we cannot write, and
    the bare error of that never named the link). Collective."""
    error: Exception | None = None
    why: str | None = None
    try:
        if isinstance(local.fs, LocalFileSystem):
            # Made now, before the check: left for the first save, its name in a shared
            # sticky directory (/dev/shm/run) was anyone's to take with a link meanwhile.
            make_directory(local.fs, local.path)
    except OSError as exc:
        error = exc
    try:
        why = local.open_to_others()
    except OSError as exc:
        error = error or exc
    if why is not None:
        error = UnsafeCheckpointError(
            f"the local tier {local.url} {why}: another user or job on this host could put a "
            "step there that this manager would load, and drain to the root as its own, or "
            "change a step it saved; nothing was read or written. Make it yours and "
            "private (chmod o-w, or a directory of your own such as /local/$USER/run), then "
            "start again"
        )
    gather_errors(g, error, f"opening the local tier {local.url}")


#: The file in a local tier that names the root it drains to.
TIER_ROOT = ".dcp-tier-root"


def claim_tier(g: Group, local: StepRoot, root: StepRoot) -> None:
    """Raise on every rank, before the tier is listed, drained or written, unless
    ``local`` is a tier of ``root``'s own: not the root itself under another name (a
    link to it, ``file://``, a ``.``: the tier's retention would delete durable steps),
    and not a tier that drains to another root, as its :data:`TIER_ROOT` file (written
    by the first manager that opens the tier) says: two managers sharing one local tier
    would load and drain each other's steps as their own. Collective."""
    error: Exception | None = None
    try:
        if local.place() == root.place():
            raise ValueError(
                f"the local tier {local.url} and the root {root.url} are one directory "
                f"({root.place()}): point local= at a directory of its own"
            )
        # In the tier as the user named it (a link there followed), never through a link
        # swapped in since (write_atomic_in).
        home = heartbeat.resolved(local.fs, local.path)
        path = local.fs.concat_path(home, TIER_ROOT)
        ours = f"{root.place()}\n".encode()
        try:
            local.fs.write_atomic_in(home, TIER_ROOT, ours, exclusive=True)
        except FileExistsError:
            theirs = local.fs.read_bytes(path, limit=4096)
            if theirs != ours:
                recorded = printable(theirs.decode(errors="replace").strip(), 300)
                raise ValueError(
                    f"the local tier {local.url} drains to another root, {recorded} (its "
                    f"{TIER_ROOT} says so), not to {root.place()}: managers sharing one "
                    "local tier load and drain each other's steps as their own. Give this "
                    "manager a local directory of its own (such as /dev/shm/$JOB_ID), or "
                    f"remove {local.fs.url(path)} if that root is no longer used"
                ) from None
    except (OSError, ValueError) as exc:
        error = exc
    gather_errors(g, error, f"opening the local tier {local.url}")


def commit_step(
    g: Group,
    local: StepRoot,
    step: int,
    writer: CheckpointWriter,
    state_dict: dict[str, Any],
    *,
    pg: Any,
    sent: Callable[[int], None],
    deadline: float | None = None,
) -> None:
    """Write, replicate and commit ``step`` in ``local`` (see the module docstring;
    collective on ``pg``). Nothing is published if a rank is past ``deadline`` (a
    ``time.monotonic()`` time) once every file is written and replicated. ``sent`` is
    told the bytes this rank sent to its peer."""
    path = local.step_path(step)
    try:
        try:
            api.save_with(writer, state_dict, process_group=pg)
        except OSError as exc:
            full = full_or(exc, local.url)
            if full is exc:
                raise
            raise full from exc
        held = writer.unpublished  # the coordinator's: no need to unpickle it there
        payload = g.broadcast(None if held is None else held[1], pg=pg)
        assert payload is not None
        meta = fmt.load_metadata(payload, local.fs.url(path)) if held is None else held[0]
        error: BaseException | None = None
        try:
            sent(_replicate(g, local, path, meta, pg=pg, sync=writer.sync_files))
            if deadline is not None and time.monotonic() > deadline:
                raise DeadlineExceededError(
                    f"step {step} timed out: it was not ready to commit in {local.url} before "
                    "its deadline; nothing is published"
                )
        except Exception as exc:
            error = exc
        # A leader that gets through this gather commits: a rank whose gather fails in
        # the collective keeps its files, which that commit may name.
        what = f"writing and replicating step {step}"
        gather_errors(g, error, what, pg=pg, commit_follows=error is None)
        committed = False
        if g.leader:
            try:
                _commit_node(g, local, step, writer, payload, meta)
                committed = True
            except Exception as exc:
                error = full_or(exc, local.url)
        # A node whose commit landed keeps every rank's files when another node's failed.
        what = f"committing step {step} in the local tier"
        gather_errors(g, error, what, pg=pg, landed=committed, commit_follows=True)
    except BaseException as exc:
        writer.abort(exc)  # unless the commit may have landed on some node
        raise


def _commit_node(
    g: Group, local: StepRoot, step: int, writer: CheckpointWriter, payload: bytes, meta: Metadata
) -> None:
    """Commit this node's copy: its ranks' files and the replicas it holds."""
    here = set(g.node) | {r for r in range(g.world) if g.peer.get(r) in g.node}
    infos = list((meta.storage_data or {}).values())
    named = {i.relative_path for i in infos if fmt.stored_item(i).ref is None}
    save_id = getattr(meta.storage_meta, "save_id", None)
    assert isinstance(save_id, str)  # our writer's metadata names its save
    commit_checkpoint(
        local.fs,
        local.step_path(step),
        fmt.METADATA_NAME,
        payload,
        save_id=save_id,
        infos=infos,
        new_files={n for n in named if fmt.file_rank(n) in here},
        overwrite=writer.overwrite,
        sync=writer.sync_files,
        budget=writer.budget,
        home=writer.attempt.home,  # the step as resolved when this node's save began
    )
    local.remember(step, meta)


def _replicate(g: Group, local: StepRoot, path: str, meta: Metadata, *, pg: Any, sync: bool) -> int:
    """Send this rank's data files of the step at ``path`` to its peer (and receive
    the replicas it holds for others); returns the bytes this rank sent."""
    if not any(p is not None for p in g.peer.values()):
        return 0
    infos = (meta.storage_data or {}).values()  # a referenced item's file is the base's
    names = sorted({i.relative_path for i in infos if fmt.stored_item(i).ref is None})
    moves: list[Move] = []
    for rank, peer in sorted(g.peer.items()):
        if peer is not None and g.node_of(peer) != g.node_of(rank):
            moves.append((rank, peer, [n for n in names if fmt.file_rank(n) == rank]))
    return transfer(g, moves, local.fs, path, sync=sync, pg=pg)


def full_or(exc: BaseException, url: str) -> BaseException:
    """``exc``, or a :class:`TierFullError` naming ``url`` when it says the device is
    full (``ENOSPC``)."""
    if (
        isinstance(exc, OSError)
        and exc.errno == errno.ENOSPC
        and not isinstance(exc, TierFullError)
    ):
        return TierFullError(
            f"the local tier {url} is full (ENOSPC: {exc}); nothing committed there was "
            "deleted. Free space, lower keep_local or point local= at a larger device"
        )
    return exc
