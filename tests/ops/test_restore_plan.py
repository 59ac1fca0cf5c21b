"""Rank 0's plan for a tiered load (``storage.ops.restore_plan.plan``), case by case: four
ranks on two nodes, each rank's replica on the other node; what each rank reported its
node's tier holds decides the step, the tier and the moves."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from storage.checkpoint import storage_format as fmt
from storage.ops._peers import Group
from storage.ops.restore_plan import DURABLE, LOCAL, Choice, Held, Report, plan

GROUP = Group(rank=0, world=4, nodes=[[0, 1], [2, 3]], peer={0: 2, 1: 3, 2: 0, 3: 1})
NAMES = [fmt.data_file_name(rank, 0, "s") for rank in range(4)]


def held(files: list[str] = NAMES, *, save: str = "s", bases: tuple[int, ...] = ()) -> Held:
    return Held(NAMES, list(files), list(bases), save, False)


def both_nodes(step_facts: dict[int, Held]) -> list[Report]:
    """Every rank's report when both nodes hold ``step_facts``."""
    return [dict(step_facts) for _ in range(4)]


def durable_is(save: str | None) -> Callable[[int], str | None]:
    return lambda step: save


def node0_only(facts: Held, step: int = 5) -> list[Report]:
    return [{step: facts}, {step: facts}, {}, {}]


CASES = {
    "both nodes hold the newest step: load it locally, nothing moves": (
        both_nodes({4: held(), 5: held()}),
        [4, 5],
        None,
        (5, LOCAL, [(5, [], [])]),
    ),
    "node 1 lost its tier: its ranks' files come from their replicas on node 0": (
        node0_only(held()),
        [5],
        None,
        (5, LOCAL, [(5, [(0, 2, [NAMES[2]]), (1, 3, [NAMES[3]])], [(0, 2, [".metadata"])])]),
    ),
    "a rank's files are on no node: the durable copy": (
        node0_only(held(NAMES[:3])),
        [5],
        None,
        (5, DURABLE, []),
    ),
    "the newest local step is not durable and cannot be completed: an older durable one": (
        [{6: held(NAMES[:3])}, {6: held(NAMES[:3])}, {}, {}],
        [5],
        None,
        (5, DURABLE, []),
    ),
    "the nodes hold different saves of the step: the durable copy": (
        [{5: held()}, {5: held()}, {5: held(save="t")}, {5: held(save="t")}],
        [5],
        None,
        (5, DURABLE, []),
    ),
    "the local copy is another save than the durable one: the durable copy": (
        both_nodes({5: held(save="old")}),
        [5],
        None,
        (5, DURABLE, []),
    ),
    "an incremental step whose base only node 0 holds: the base moves first": (
        [
            {4: held(), 5: held(bases=(4,))},
            {4: held(), 5: held(bases=(4,))},
            {5: held(bases=(4,))},
            {5: held(bases=(4,))},
        ],
        [4, 5],
        None,
        (
            5,
            LOCAL,
            [
                (4, [(0, 2, [NAMES[2]]), (1, 3, [NAMES[3]])], [(0, 2, [".metadata"])]),
                (5, [], []),
            ],
        ),
    ),
    "the step asked for, though a newer one is local": (
        both_nodes({4: held(), 5: held()}),
        [4, 5],
        4,
        (4, LOCAL, [(4, [], [])]),
    ),
}


@pytest.mark.parametrize("reports,durable,step,expected", CASES.values(), ids=list(CASES))
def test_plan(
    reports: list[Report],
    durable: list[int],
    step: int | None,
    expected: tuple[int, str, list[object]],
) -> None:
    choice = plan(GROUP, reports, durable, step, durable_is("s"))
    assert isinstance(choice, Choice), choice
    assert (choice.step, choice.where, choice.moves) == expected
    assert choice.is_durable == (choice.step in durable)


def test_a_pending_step_loads_locally_whatever_the_root_holds() -> None:
    """This manager saved it and its drain has not landed: the root's copy is older."""
    pending = Held(NAMES, NAMES, [], "new", True)
    choice = plan(GROUP, both_nodes({5: pending}), [5], None, durable_is("old"))
    assert isinstance(choice, Choice) and (choice.step, choice.where) == (5, LOCAL)


def test_nothing_committed_anywhere_says_so() -> None:
    assert plan(GROUP, [{}, {}, {}, {}], [], None, durable_is(None)) == (
        "no committed step in the local tier or under the root"
    )
    why = plan(GROUP, both_nodes({5: held()}), [5], 7, durable_is("s"))
    assert why == "step 7 is not committed in the local tier or under the root [5]"


def test_a_root_that_cannot_be_listed_still_loads_locally() -> None:
    choice = plan(GROUP, both_nodes({5: held()}), None, None, durable_is("s"))
    assert isinstance(choice, Choice)
    assert (choice.step, choice.where, choice.is_durable) == (5, LOCAL, False)


def test_a_local_step_with_files_on_no_node_is_skipped_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # An older step loaded silently in place of the newest one looked like lost work
    # (a save failed after node 0 committed, and rank 3's files went with node 1).
    reports = [{6: held(NAMES[:3]), 4: held()}, {6: held(NAMES[:3]), 4: held()}, {}, {}]
    with caplog.at_level("WARNING", logger="storage.ops.tiers"):
        choice = plan(GROUP, reports, [], None, durable_is(None))
    assert isinstance(choice, Choice) and (choice.step, choice.where) == (4, LOCAL)
    assert "step 6 is committed in the local tier but some of its files" in caplog.text
