"""Restoring a tiered manager's step from the nearest tier that holds a committed copy.

Every rank reports what its node's local tier holds: per committed step, the data files
its metadata names (key prefix directories included), the files present, the steps whose
bytes it references (incremental saves) and the id of the save it holds. Rank 0 picks
the newest step (or the one asked for) that every rank can read from its node's tier,
fetching what a node lacks from a node that holds it, else the durable copy under the
root. What is fetched: each rank's own files (from the rank holding its replica), then
the files of other nodes' ranks that its node's loads read (a replicated tensor saved
once by another rank, a reshard; every rank plans its load against the step's metadata
to tell, unless every node holds every file), bases before the steps that reference
them, each step's metadata after its files. Replicas a lost node kept for its peers
are not sent back unless read: its redundancy returns with the next save.

A local copy is used only when it is the same save as the durable one (or the
manager's own save whose drain has not landed, or the root has no such step); when the
root cannot be listed, the newest local step is used and the :class:`LoadedStep` says
the root was not consulted. Every rank then loads the same
copy; a local load that fails for any reason (a checksum, a missing file) falls back to
the durable copy when the step is durable, and says so in a warning.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from extensions.errors import CheckpointNotFoundError, CheckpointStorageError, quote
from storage.checkpoint import api
from storage.checkpoint import format as fmt
from storage.checkpoint.committed import files_read, open_committed
from storage.checkpoint.layout import StepInfo, parse_step
from storage.checkpoint.prefixes import expand
from storage.ops._peers import Group, Move, gather_errors, transfer
from storage.ops.manager import CheckpointManager

if TYPE_CHECKING:
    from storage.ops.tiers import LocalTier

log = logging.getLogger("storage.ops.tiers")  # one logger for everything tiers say

LOCAL, DURABLE = "local", "durable"


class LoadedStep(int):
    """The step a tiered :meth:`CheckpointManager.load` restored (an ``int``), with
    ``tier``: ``"local"`` or ``"durable"``, the copy it was read from;
    ``root_consulted``: ``False`` when the root could not be listed (an outage: the
    newest local step was loaded, and the root may hold a newer one); ``note``: why
    the copy loaded is not the obvious one (the root was not consulted, the local copy
    is another save than the durable one, the local load failed), else ``None``."""

    tier: str
    root_consulted: bool
    note: str | None

    def __new__(
        cls, step: int, tier: str, *, root_consulted: bool = True, note: str | None = None
    ) -> LoadedStep:
        obj = super().__new__(cls, step)
        obj.tier, obj.root_consulted, obj.note = tier, root_consulted, note
        return obj


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


def load(tier: LocalTier, state_dict: dict[str, Any], step: int | None = None) -> LoadedStep:
    """Load ``step`` (default: the newest committed in any tier) into ``state_dict``:
    from the local tier, restoring what a node lacks from its peers first, or from the
    root; on any error of the local load, from the root when the step is durable there.
    Waits for the local commit of an asynchronous save first. Collective under a
    process group: rank 0 decides from every rank's report."""
    tier.finish_commit()
    g = tier.group
    mine = report(tier)
    reports = g.all_gather(mine)
    outcome: tuple[Choice | str, str | None] = ("", None)
    error: Exception | None = None
    if g.rank == 0:
        try:
            outcome = (_decide(tier, reports, step), None)
        except Exception as exc:  # the other ranks must not wait for an answer forever
            notes = "".join(f"; {n}" for n in getattr(exc, "__notes__", ()))
            error, outcome = exc, ("", f"{type(exc).__name__}: {exc}{notes}")
    chosen, failed = g.broadcast(outcome)
    try:
        if error is not None:
            raise error
        if failed is not None:
            raise CheckpointStorageError(f"rank 0 could not pick the step to load: {failed}")
        if isinstance(chosen, str):
            raise CheckpointNotFoundError(chosen)
        return _load_planned(tier, state_dict, chosen, reports)
    finally:
        tier._schedule()  # collective like the load: a node restored from a peer drains


def _decide(tier: LocalTier, reports: list[Report], step: int | None) -> Choice | str:
    """Rank 0: list the root (its error, an outage, is kept, not raised, while a local
    step can stand in) and plan. Raises the root's error, with a note, when only the
    root could hold what is asked for."""
    root = tier.manager
    try:
        durable: list[int] | None = root.durable_steps()
        unreachable = None
    except Exception as exc:
        durable, unreachable = None, exc
    chosen = plan(tier.group, reports, durable, step, lambda s: _durable_save(root, s))
    if isinstance(chosen, str) and unreachable is not None:
        unreachable.add_note(f"{chosen}; the root {root.url} could not be listed")
        raise unreachable
    if isinstance(chosen, Choice) and unreachable is not None:
        note = (
            f"the root {root.url} was not consulted (listing it failed: "
            f"{type(unreachable).__name__}: {unreachable}); using the local copy"
        )
        if step is None:
            note += ", the newest local step (the root may hold a newer one)"
        chosen = dataclasses.replace(chosen, root_consulted=False, note=note)
    return chosen


def _durable_save(root: CheckpointManager, step: int) -> str | None:
    """The save id of the root's copy of ``step`` (``None``: it has none)."""
    path = root.step_path(step)
    payload = root.fs.read_bytes(root.fs.concat_path(path, fmt.METADATA_NAME))
    return fmt.save_of(fmt.load_metadata(payload, root.fs.url(path)))


def _load_planned(
    tier: LocalTier, state_dict: dict[str, Any], chosen: Choice, reports: list[Report]
) -> LoadedStep:
    g, local, root = tier.group, tier.local, tier.manager
    step, note = chosen.step, chosen.note
    if note is not None:
        log.warning("loading step %d: %s", step, note)
    if chosen.where == LOCAL:
        try:
            error: BaseException | None = None
            try:
                # Each rank's own files, then what its node's loads read of other
                # ranks' files, then the metadata; bases first.
                reads = read_moves(g, reports, _reads(tier, state_dict, reports, step))
                planned = {s: (data, meta) for s, data, meta in chosen.moves}
                for s in sorted(set(planned) | set(reads)):
                    data, meta = planned.get(s, ([], []))
                    moves = [*data, *reads.get(s, []), *meta]
                    sent = transfer(g, moves, local.fs, local.step_path(s), sync=True)
                    tier.restored_bytes += sent
            except Exception as exc:
                error = exc
            gather_errors(g, error, f"restoring step {step} from the peers")
            _load_from(root, local, state_dict, step)
            log.info("loaded step %d from the local tier %s", step, local.url)
            return LoadedStep(step, LOCAL, root_consulted=chosen.root_consulted, note=note)
        except Exception as exc:
            if not chosen.is_durable:
                raise
            note = (
                f"loading it from the local tier {local.url} failed "
                f"({type(exc).__name__}: {exc}); loading the durable copy from {root.url}"
            )
            log.warning("loading step %d: %s", step, note)
    _load_from(root, root, state_dict, step)
    log.info("loaded step %d from the durable tier %s", step, root.url)
    return LoadedStep(step, DURABLE, note=note)


def _load_from(
    m: CheckpointManager, where: CheckpointManager, state_dict: dict[str, Any], step: int
) -> None:
    api.load(
        state_dict,
        where.step_url(step),
        keys=m.keys,
        registry=m.registry,
        require_encryption=m.require_encryption,
        filesystem=where.fs,
    )


class Held(NamedTuple):
    """What a node's tier holds of one committed step."""

    named: list[str]  # the data files its metadata names
    files: list[str]  # the files present, key prefix directories included
    bases: list[int]  # the steps whose bytes it references
    save: str | None  # the id of the save it holds (format.save_of)
    pending: bool  # this manager saved it and its drain has not landed yet


# Per rank: what its node's tier holds, per committed local step.
Report = dict[int, Held]


def report(tier: LocalTier) -> Report:
    """What this node's local tier holds, per committed step (see :class:`Held`)."""
    out = {}
    fs = tier.local.fs
    pending = tier.pending()
    for s in tier.local.steps():
        path = tier.local.step_path(s)
        try:
            checkpoint = open_committed(fs, path)
            checkpoint.require()
            named = checkpoint.data_files()
            meta = checkpoint.global_metadata
            save = fmt.save_of(meta) if meta is not None else None
            held = expand(fs, path, only={n.partition("/")[0] for n in named if "/" in n})
            bases = sorted(b for b in map(parse_step, checkpoint.references()) if b is not None)
            out[s] = Held(sorted(named), held, bases, save, s in pending)
        except FileNotFoundError:
            continue
        except Exception as exc:  # unreadable here: the load uses the durable copy, if any
            log.warning("local step %d under %s is not readable (%s)", s, tier.local.url, exc)
    return out


def plan(
    g: Group,
    reports: list[Report],
    durable: list[int] | None,
    step: int | None,
    durable_save: Callable[[int], str | None],
) -> Choice | str:
    """Rank 0's choice: the newest step that every rank can read from its node's tier
    (fetching missing files from a node that holds them) and may (:func:`_same_save`),
    else from the root. ``durable`` is ``None`` when the root could not be listed."""
    known = durable or []
    local_steps = set().union(*(set(r) for r in reports))
    candidates = [step] if step is not None else sorted(local_steps | set(known), reverse=True)
    for s in candidates:
        moves = _local_moves(g, reports, s)
        why = None
        if moves is not None:
            why = _same_save(reports, s, s in known, durable_save)
            if why is None:
                return Choice(s, LOCAL, moves, s in known)
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


def _reads(
    tier: LocalTier, state_dict: dict[str, Any], reports: list[Report], step: int
) -> list[list[tuple[int, str]]]:
    """Every rank's (step, file) pairs that its load of ``step`` reads, unless every
    node holds every file of ``step`` and of its bases (then nothing needs moving).
    Collective: the metadata comes from the lowest rank whose node holds the step."""
    g = tier.group
    steps = {step} | {b for r in reports if step in r for b in r[step].bases}
    if all(s in r and set(r[s].named) <= set(r[s].files) for r in reports for s in steps):
        return [[] for _ in range(g.world)]
    holder = min(q for q in range(g.world) if step in reports[q])
    payload = None
    if g.rank == holder:
        path = tier.local.fs.concat_path(tier.local.step_path(step), fmt.METADATA_NAME)
        try:
            payload = tier.local.fs.read_bytes(path)
        except Exception as exc:  # the others must not wait for it; the load will fail
            log.warning("cannot read %s (%s)", tier.local.fs.url(path), exc)
    payload = g.broadcast(payload, src=holder)
    mine: list[tuple[int, str]] = []
    try:
        if payload is None:
            raise CheckpointNotFoundError(f"rank {holder} could not read the metadata")
        meta = fmt.load_metadata(payload, tier.local.step_url(step))
        for name, file in files_read(meta, state_dict):
            where = step if name is None else parse_step(name)
            if where is not None:
                mine.append((where, file))
    except Exception as exc:  # the load itself fails the same way, then falls back
        log.warning("cannot tell which files the load of step %d reads (%s)", step, exc)
    return g.all_gather(sorted(mine))


def merge_entries(local: list[StepInfo], durable: list[StepInfo]) -> list[StepInfo]:
    """``durable`` (a root's entries) with the steps only ``local`` (a local tier's
    entries) holds committed added, and each entry's ``tiers`` filled in; a step in both
    tiers is listed with the root's facts."""
    merged = {i.step: i for i in durable}
    for info in local:
        if not info.committed:
            continue
        held = merged.get(info.step)
        if held is not None and held.committed:
            merged[info.step] = _with_tiers(held, (LOCAL, DURABLE))
        else:
            merged[info.step] = _with_tiers(info, (LOCAL,))
    return [merged[s] for s in sorted(merged, key=lambda s: -1 if s is None else s)]


def _with_tiers(info: StepInfo, tiers: tuple[str, ...]) -> StepInfo:
    return dataclasses.replace(info, tiers=tiers)
