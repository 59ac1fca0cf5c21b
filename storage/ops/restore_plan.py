"""Rank 0's plan for a tiered load: which step, from which tier, after which moves.

Pure functions of what every rank reported its node's tier holds (:class:`Held`, per
committed step), the root's steps and the ranks' layout (``_peers.Group``): the newest
step every rank can read from its node's tier, fetching what a node lacks from a node
that holds it, else the durable copy (:func:`plan`); and which files of other nodes'
ranks each node's loads read (:func:`read_moves`). Every rank that computes a plan
from the same inputs gets the same moves. :mod:`storage.ops.restore` runs them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import NamedTuple

from extensions.errors import quote
from storage.checkpoint import storage_format as fmt
from storage.ops._peers import Group, Move

log = logging.getLogger("storage.ops.tiers")  # one logger for everything tiers say

LOCAL, DURABLE = "local", "durable"


class Held(NamedTuple):
    """What a node's tier holds of one committed step."""

    named: list[str]  # the data files its metadata names
    files: list[str]  # the files present, key prefix directories included
    bases: list[int]  # the steps whose bytes it references
    save: str | None  # the id of the save it holds (format.save_of)
    pending: bool  # this manager saved it and its drain has not landed yet


# Per rank: what its node's tier holds, per committed local step.
Report = dict[int, Held]


# A step's moves: (step, data files, then each node's copy of its metadata).
StepMoves = tuple[int, list[Move], list[Move]]


@dataclasses.dataclass(frozen=True)
class Choice:
    """Rank 0's decision, broadcast to every rank: load ``step`` from ``where`` after
    the ``moves`` (step by step); ``is_durable``: the root holds it (a fallback);
    ``note``: what the caller is told about the choice."""

    step: int
    where: str
    moves: list[StepMoves]
    is_durable: bool
    root_consulted: bool = True
    note: str | None = None


def plan(
    g: Group,
    reports: list[Report],
    durable: list[int] | None,
    step: int | None,
    durable_save: Callable[[int], str | None],
    linked: Callable[[int], bool] | None = None,
) -> Choice | str:
    """Rank 0's choice: the newest step that every rank can read from its node's tier
    (fetching missing files from a node that holds them) and may (:func:`_same_save`),
    else from the root. ``durable`` is ``None`` when the root could not be listed.
    ``linked(step)``: whether the root's ``step`` is a symbolic link, a checkpoint from
    elsewhere (a shared pretrained one): it never overrides the nodes' own copy of that
    step, one save, which is loaded instead, with a note and no fallback to the linked
    one (:func:`_over_link`); it is loaded where no node holds the step."""
    known = durable or []
    local_steps = set().union(*(set(r) for r in reports))
    candidates = [step] if step is not None else sorted(local_steps | set(known), reverse=True)
    for s in candidates:
        moves = _local_moves(g, reports, s)
        why = None
        if moves is None and s in local_steps:
            # A save failed after a node committed its copy, or a node's files were
            # removed: said, since the older step loaded instead looks like lost work.
            log.warning(
                "step %d is committed in the local tier but some of its files (or its "
                "bases') are on no node; not loading it from there",
                s,
            )
        if moves is not None:
            why = _same_save(reports, s, s in known, durable_save)
            if why is None:
                return Choice(s, LOCAL, moves, s in known)
            over = _over_link(reports, s) if s in known and linked and linked(s) else None
            if over is not None:
                return Choice(s, LOCAL, moves, False, note=over)
        if s in known:
            return Choice(s, DURABLE, [], True, note=why)
        if why is not None:
            log.warning("step %d is not loaded: %s", s, why)
    where = "no committed step" if step is None else f"step {step} is not committed"
    return f"{where} in the local tier or under the root {sorted(known) or ''}".strip()


def _same_save(
    reports: list[Report], step: int, durable: bool, durable_save: Callable[[int], str | None]
) -> str | None:
    """Why the local copies of ``step`` must not be loaded, or ``None`` if they may: the
    nodes hold one save, and it is the durable copy's (or the root has none, or this
    manager saved it and has not drained it yet)."""
    held = [r[step] for r in reports if step in r]
    saves = sorted({h.save or "" for h in held})
    if len(saves) > 1:
        return f"the nodes' local copies are different saves ({', '.join(map(quote, saves))})"
    if not durable or all(h.pending for h in held):
        return None
    try:
        theirs = durable_save(step)
    except FileNotFoundError:
        return None  # deleted from the root meanwhile
    except Exception as exc:  # the durable copy cannot be loaded either
        log.warning("cannot read the durable metadata of step %d (%s)", step, exc)
        return None
    if held[0].save is None or held[0].save != theirs:
        return (
            f"the local copy is another save ({quote(held[0].save)}) than the durable one "
            f"({quote(theirs)}: another run's tier, or a save again of this step that was "
            "never drained); using the durable copy"
        )
    return None


def _over_link(reports: list[Report], step: int) -> str | None:
    """The note of a load of the nodes' own copy of ``step`` over the root's, a symbolic
    link to another save; ``None`` when the nodes' copies are different saves (none is
    theirs to prefer: the root's is loaded, with :func:`_same_save`'s note)."""
    saves = {r[step].save for r in reports if step in r}
    if len(saves) != 1:
        return None
    return (
        f"the root's step {step} is a symbolic link to a checkpoint elsewhere, another save "
        f"than the local copy ({quote(saves.pop())}); loading the local copy, this job's own "
        "(a linked step is loaded only where no local copy is: remove the link, or this "
        "step's local copy, to change that)"
    )


def _local_moves(g: Group, reports: list[Report], step: int) -> list[StepMoves] | None:
    """The moves, step by step (bases first), that make ``step`` and every step it
    references readable from each node's tier; ``None`` if some file is on no node."""
    needed: set[int] = set()
    todo = [step]
    while todo:
        s = todo.pop()
        facts = next((r[s] for r in reports if s in r), None)
        if facts is None:
            return None
        needed.add(s)
        todo.extend(b for b in facts.bases if b not in needed)
    out = []
    for s in sorted(needed):  # a base is older than the steps that reference it
        moves = _step_moves(g, reports, s)
        if moves is None:
            return None
        out.append(moves)
    return out


def _step_moves(g: Group, reports: list[Report], step: int) -> StepMoves | None:
    """Each rank's own files of ``step`` where its node lacks them (from the rank holding
    its replica first, so each node's ranks send in parallel), then each node's copy of
    the metadata; ``None`` if some rank's files are on no node."""
    named = next(set(r[step].named) for r in reports if step in r)
    have = [set(r[step].files) if step in r else set() for r in reports]
    data: list[Move] = []
    meta: list[Move] = []
    for rank in range(g.world):
        need = {n for n in named if fmt.file_rank(n) == rank} - have[rank]
        if need:
            order = [q for q in (g.peer.get(rank),) if q is not None] + list(range(g.world))
            src = next((q for q in order if need <= have[q]), None)
            if src is None:
                return None
            data.append((src, rank, sorted(need)))
        if g.node_of(rank)[0] == rank and step not in reports[rank]:
            src = next(q for q in range(g.world) if step in reports[q])
            meta.append((src, rank, [fmt.METADATA_NAME]))
    return step, data, meta  # metadata last: a node's copy counts once its files are there


def read_moves(
    g: Group, reports: list[Report], reads: list[list[tuple[int, str]]]
) -> dict[int, list[Move]]:
    """Per step, the moves that bring each node the files of other nodes' ranks that
    its ranks' loads read (``reads[rank]``: (step, file) pairs; a replicated tensor saved
    once, a reshard): one copy per node, received by the reader at the owner's position
    on its node if it reads it (so pairs of ranks move in parallel), sent by the owner
    or else the rank holding its replica, else any holder. Every rank computes the same
    moves from the same inputs."""
    out: dict[int, list[Move]] = {}
    wants = [set(r) for r in reads]
    for node in g.nodes:
        for s, f in sorted(set().union(*(wants[r] for r in node))):
            owner = fmt.file_rank(f)
            if owner in node or f in _files(reports, node[0], s):  # own files: _step_moves
                continue
            readers = [r for r in node if (s, f) in wants[r]]
            position = g.node_of(owner).index(owner) if owner < g.world else len(node)
            same = node[position] if position < len(node) else None  # saved by more ranks
            receiver = same if same in readers else readers[0]
            order = [owner, *[q for q in (g.peer.get(owner),) if q is not None], *range(g.world)]
            src = next((q for q in order if f in _files(reports, q, s)), None)
            if src is not None:  # else the load fails and falls back to the durable copy
                out.setdefault(s, []).append((src, receiver, [f]))
    return out


def _files(reports: list[Report], rank: int, step: int) -> set[str]:
    held = reports[rank].get(step)
    return set() if held is None else set(held.files)
