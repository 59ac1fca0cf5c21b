"""Restoring a tiered manager's step from the nearest tier that holds a committed copy.

Every rank reports what its node's local tier holds: per committed step, the data files
its metadata names, the files present and the steps whose bytes it references
(incremental saves). Rank 0 picks the newest step (or the one asked for) that every
rank can read from its node's tier, fetching what a node lacks from a node that holds
it (a peer's replica; bases before the steps that reference them, each step's metadata
after its files), else the durable copy under the root. Every rank then loads the same
copy; a local load that fails for any reason (a checksum, a missing file) falls back to
the durable copy when the step is durable, and says so in a warning.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from extensions.errors import CheckpointNotFoundError
from storage.checkpoint import api
from storage.checkpoint import format as fmt
from storage.checkpoint.committed import open_committed
from storage.checkpoint.layout import StepInfo
from storage.ops._peers import Group, Move, gather_errors, transfer
from storage.ops.manager import CheckpointManager

if TYPE_CHECKING:
    from storage.ops.tiers import LocalTier

log = logging.getLogger("storage.ops.tiers")  # one logger for everything tiers say

LOCAL, DURABLE = "local", "durable"


class LoadedStep(int):
    """The step a tiered :meth:`CheckpointManager.load` restored (an ``int``), with
    ``tier``: ``"local"`` or ``"durable"``, the copy it was read from."""

    tier: str

    def __new__(cls, step: int, tier: str) -> LoadedStep:
        obj = super().__new__(cls, step)
        obj.tier = tier
        return obj


def load(tier: LocalTier, state_dict: dict[str, Any], step: int | None = None) -> LoadedStep:
    """Load ``step`` (default: the newest committed in any tier) into ``state_dict``:
    from the local tier, restoring what a node lacks from its peers first, or from the
    root; on any error of the local load, from the root when the step is durable there.
    Waits for the local commit of an asynchronous save first. Collective under a
    process group: rank 0 decides from every rank's report."""
    tier.finish_commit()
    g = tier.group
    mine = report(tier)
    durable = tier.manager.durable_steps() if g.rank == 0 else []
    reports = g.all_gather(mine)
    chosen = plan(g, reports, durable, step) if g.rank == 0 else None
    chosen = g.broadcast(chosen)
    if isinstance(chosen, str):
        raise CheckpointNotFoundError(chosen)
    try:
        return _load_planned(tier, state_dict, *chosen)
    finally:
        tier._schedule()  # collective like the load: a node restored from a peer drains


def _load_planned(
    tier: LocalTier,
    state_dict: dict[str, Any],
    chosen: int,
    where: str,
    moves: list[tuple[int, list[Move]]],
    is_durable: bool,
) -> LoadedStep:
    g, local, root = tier.group, tier.local, tier.manager
    if where == LOCAL:
        try:
            error: BaseException | None = None
            try:
                for s, step_moves in moves:  # bases first
                    transfer(g, step_moves, local.fs, local.step_path(s), sync=True)
            except Exception as exc:
                error = exc
            gather_errors(g, error, f"restoring step {chosen} from the peers")
            _load_from(root, local, state_dict, chosen)
            log.info("loaded step %d from the local tier %s", chosen, local.url)
            return LoadedStep(chosen, LOCAL)
        except Exception as exc:
            if not is_durable:
                raise
            log.warning(
                "loading step %d from the local tier %s failed (%s: %s); "
                "loading the durable copy from %s",
                chosen,
                local.url,
                type(exc).__name__,
                exc,
                root.url,
            )
    _load_from(root, root, state_dict, chosen)
    log.info("loaded step %d from the durable tier %s", chosen, root.url)
    return LoadedStep(chosen, DURABLE)


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


def report(tier: LocalTier) -> Report:
    """Per step committed in this node's local tier: the data files its metadata
    names, the files this node holds, and the steps whose bytes it references."""
    out = {}
    fs = tier.local.fs
    for s in tier.local.steps():
        path = tier.local.step_path(s)
        try:
            named = open_committed(fs, path).data_files()
            out[s] = (sorted(named), sorted(fs.ls(path)), sorted(tier.references(s)))
        except FileNotFoundError:
            continue
    return out


# Per rank: per committed local step, (data files named, files held, bases referenced).
Report = dict[int, tuple[list[str], list[str], list[int]]]


def plan(
    g: Group, reports: list[Report], durable: list[int], step: int | None
) -> tuple[int, str, list[tuple[int, list[Move]]], bool] | str:
    """Rank 0's choice: the newest step that every rank can read from its node's tier
    (fetching missing files from a node that holds them), else from the root."""
    local_steps = set().union(*(set(r) for r in reports))
    candidates = [step] if step is not None else sorted(local_steps | set(durable), reverse=True)
    for s in candidates:
        moves = _local_moves(g, reports, s)
        if moves is not None:
            return (s, LOCAL, moves, s in durable)
        if s in durable:
            return (s, DURABLE, [], True)
    where = "no committed step" if step is None else f"step {step} is not committed"
    return f"{where} in the local tier or under the root {sorted(durable) or ''}".strip()


def _local_moves(g: Group, reports: list[Report], step: int) -> list[tuple[int, list[Move]]] | None:
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
        todo.extend(b for b in facts[2] if b not in needed)
    out = []
    for s in sorted(needed):  # a base is older than the steps that reference it
        moves = _step_moves(g, reports, s)
        if moves is None:
            return None
        if moves:
            out.append((s, moves))
    return out


def _step_moves(g: Group, reports: list[Report], step: int) -> list[Move] | None:
    named = next(set(r[step][0]) for r in reports if step in r)
    have = [set(r[step][1]) if step in r else set() for r in reports]
    data: list[Move] = []
    meta: list[Move] = []
    for rank in range(g.world):
        need = {n for n in named if fmt.file_rank(n) == rank} - have[rank]
        if need:
            src = next((q for q in range(g.world) if need <= have[q]), None)
            if src is None:
                return None
            data.append((src, rank, sorted(need)))
        if g.node_of(rank)[0] == rank and step not in reports[rank]:
            src = next(q for q in range(g.world) if step in reports[q])
            meta.append((src, rank, [fmt.METADATA_NAME]))
    return data + meta  # metadata last: a node's copy counts once its files are there


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
