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
manager's own save whose drain has not landed, or the root has no such step, or the
root's is a symbolic link to a checkpoint elsewhere, which never overrides the job's
own copy, nor stands in for it when its load fails); when the
root cannot be listed, the newest local step is used and the :class:`LoadedStep` says
the root was not consulted. Every rank then loads the same
copy; a local load that fails for any reason (a checksum, a missing file) falls back to
the durable copy when the step is durable, and says so in a warning. Rank 0's plan is
:mod:`storage.ops.restore_plan`; this module reports, decides and loads.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from extensions.errors import CheckpointNotFoundError, CheckpointStorageError
from storage.checkpoint import api
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.api import ReaderOptions
from storage.checkpoint.committed import files_read, open_committed
from storage.checkpoint.layout import StepInfo, parse_step
from storage.checkpoint.prefixes import expand
from storage.ops._peers import Group, Move, gather_errors, transfer
from storage.ops.restore_plan import DURABLE, LOCAL, Choice, Held, Report, plan, read_moves
from storage.ops.steps import StepRoot

log = logging.getLogger("storage.ops.tiers")  # one logger for everything tiers say


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


def load(
    g: Group,
    local: StepRoot,
    root: StepRoot,
    state_dict: dict[str, Any],
    step: int | None,
    *,
    reader: ReaderOptions,
    pending: set[int],
    sent: Callable[[int], None],
    decided: Callable[[], None],
) -> LoadedStep:
    """Load ``step`` (default: the newest committed in any tier) into ``state_dict``:
    from this node's ``local`` tier, restoring what a node lacks from its peers first,
    or from ``root``; on any error of the local load, from the root when the step is
    durable there. Collective under a process group: rank 0 decides from every rank's
    report. ``pending``: the steps this manager saved and has not drained yet;
    ``sent``: told the bytes this rank sends to restore other nodes' files;
    ``decided``: called on every rank once rank 0's decision is shared, whatever it is
    (the tier queues a drain pass there, collective like the load)."""
    reports = g.all_gather(report(local, pending))
    outcome: tuple[Choice | str, str | None] = ("", None)
    error: Exception | None = None
    if g.rank == 0:
        try:
            outcome = (_decide(g, root, reports, step), None)
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
        return _load_chosen(g, local, root, reader, state_dict, chosen, reports, sent)
    finally:
        decided()


def report(local: StepRoot, pending: set[int]) -> Report:
    """What this node's ``local`` tier holds, per committed step (see :class:`Held`);
    ``pending``: the steps this manager saved and has not drained yet."""
    out = {}
    fs = local.fs
    for s in local.steps():
        path = local.step_path(s)
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
            log.warning("local step %d under %s is not readable (%s)", s, local.url, exc)
    return out


def _decide(g: Group, root: StepRoot, reports: list[Report], step: int | None) -> Choice | str:
    """Rank 0: list the root (its error, an outage, is kept, not raised, while a local
    step can stand in) and plan. Raises the root's error, with a note, when only the
    root could hold what is asked for."""
    try:
        durable: list[int] | None = root.steps()
        unreachable = None
    except Exception as exc:
        durable, unreachable = None, exc
    chosen = plan(g, reports, durable, step, lambda s: _durable_save(root, s), root.is_link)
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


def _durable_save(root: StepRoot, step: int) -> str | None:
    """The save id of the root's copy of ``step`` (``None``: it has none);
    ``FileNotFoundError`` when the root has no ``.metadata`` for it."""
    model = root.model(step)
    model.require()
    metadata = model.global_metadata
    if metadata is None:
        raise CheckpointNotFoundError(f"{model.url} has no {fmt.METADATA_NAME}")
    return fmt.save_of(metadata)


def _load_chosen(
    g: Group,
    local: StepRoot,
    root: StepRoot,
    reader: ReaderOptions,
    state_dict: dict[str, Any],
    chosen: Choice,
    reports: list[Report],
    sent: Callable[[int], None],
) -> LoadedStep:
    step, note = chosen.step, chosen.note
    if note is not None:
        log.warning("loading step %d: %s", step, note)
    if chosen.where == LOCAL:
        try:
            _fetch(g, local, state_dict, chosen, reports, sent)
            api.load(state_dict, local.step_url(step), filesystem=local.fs, **reader.as_kwargs())
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
    api.load(state_dict, root.step_url(step), filesystem=root.fs, **reader.as_kwargs())
    log.info("loaded step %d from the durable tier %s", step, root.url)
    return LoadedStep(step, DURABLE, note=note)


def _fetch(
    g: Group,
    local: StepRoot,
    state_dict: dict[str, Any],
    chosen: Choice,
    reports: list[Report],
    sent: Callable[[int], None],
) -> None:
    """Bring each node what its ranks' loads of the chosen step read: each rank's own
    files, then what its node's loads read of other ranks' files, then the metadata;
    bases first. Nothing is received into a step whose directory is a symbolic link
    (``StepRoot.refuse_link``): every rank refuses the fetch before anything moves.
    Collective; raises on every rank if it failed on any."""
    error: BaseException | None = None
    steps: list[tuple[int, list[Move]]] = []
    try:
        reads = read_moves(g, reports, _reads(g, local, state_dict, reports, chosen.step))
        planned = {s: (data, meta) for s, data, meta in chosen.moves}
        for s in sorted(set(planned) | set(reads)):
            data, meta = planned.get(s, ([], []))
            steps.append((s, [*data, *reads.get(s, []), *meta]))
            if any(dst == g.rank != src and names for src, dst, names in steps[-1][1]):
                local.refuse_link(s, "nothing is fetched into it; remove the link to restore here")
    except Exception as exc:
        error = exc
    gather_errors(g, error, f"restoring step {chosen.step} from the peers")
    try:
        for s, moves in steps:
            sent(transfer(g, moves, local.fs, local.step_path(s), sync=True))
    except Exception as exc:
        error = exc
    gather_errors(g, error, f"restoring step {chosen.step} from the peers")


def _reads(
    g: Group, local: StepRoot, state_dict: dict[str, Any], reports: list[Report], step: int
) -> list[list[tuple[int, str]]]:
    """Every rank's (step, file) pairs that its load of ``step`` reads, unless every
    node holds every file of ``step`` and of its bases (then nothing needs moving).
    Collective: the metadata comes from the lowest rank whose node holds the step."""
    steps = {step} | {b for r in reports if step in r for b in r[step].bases}
    if all(s in r and set(r[s].named) <= set(r[s].files) for r in reports for s in steps):
        return [[] for _ in range(g.world)]
    holder = min(q for q in range(g.world) if step in reports[q])
    meta = None
    if g.rank == holder:
        model = local.model(step)
        try:
            model.require()
            meta = model.global_metadata
        except Exception as exc:  # the others must not wait for it; the load will fail
            log.warning("cannot read the metadata of %s (%s)", model.url, exc)
    meta = g.broadcast(meta, src=holder)
    mine: list[tuple[int, str]] = []
    try:
        if meta is None:
            raise CheckpointNotFoundError(f"rank {holder} could not read the metadata")
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


def durable_entries(root: StepRoot) -> list[StepInfo]:
    """``root``'s entries, each committed one held by the durable tier."""
    return [_with_tiers(i, (DURABLE,) if i.committed else ()) for i in root.entries()]


def _with_tiers(info: StepInfo, tiers: tuple[str, ...]) -> StepInfo:
    return dataclasses.replace(info, tiers=tiers)
