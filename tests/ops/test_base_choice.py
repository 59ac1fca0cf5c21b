"""The base of an incremental save (``storage.ops.base_choice.choose_base``), case by case:
the one rule the root and a local tier both save by, from the committed steps and the
facts of the step it would reference."""

from __future__ import annotations

import pytest

from storage.ops.base_choice import BaseChoice, Candidate, choose_base

FULL_CHAIN = Candidate()  # a base that is a full save itself
NO_BASE = "full"

CASES = {
    "the newest committed step below is the base": (
        8,
        [2, 5, 7],
        {7: FULL_CHAIN},
        dict(incremental=True, full_every=None),
        7,
    ),
    "steps above the one saved are never a base (a restart below them)": (
        4,
        [2, 5, 7],
        {2: FULL_CHAIN},
        dict(incremental=True, full_every=None),
        2,
    ),
    "the step saved again is not its own base": (
        5,
        [2, 5],
        {2: FULL_CHAIN},
        dict(incremental=True, full_every=None),
        2,
    ),
    "nothing committed below: a full save": (
        3,
        [3, 4],
        {},
        dict(incremental=True, full_every=None),
        NO_BASE,
    ),
    "incremental off: a full save": (
        8,
        [7],
        {7: FULL_CHAIN},
        dict(incremental=False, full_every=None),
        NO_BASE,
    ),
    "full_every=3: a base whose chain is 1 still serves (this save's chain is 2)": (
        8,
        [7],
        {7: Candidate(chain=1)},
        dict(incremental=True, full_every=3),
        7,
    ),
    "full_every=3: a base whose chain is 2 makes this the third save, a full one": (
        8,
        [7],
        {7: Candidate(chain=2)},
        dict(incremental=True, full_every=3),
        NO_BASE,
    ),
    "full_every=1: every save is a full one": (
        8,
        [7],
        {7: FULL_CHAIN},
        dict(incremental=True, full_every=1),
        NO_BASE,
    ),
    "without full_every chains grow without bound": (
        8,
        [7],
        {7: Candidate(chain=1000)},
        dict(incremental=True, full_every=None),
        7,
    ),
    "a candidate that cannot be a base: a full save, not an older step": (
        8,
        [5, 7],
        {5: FULL_CHAIN, 7: Candidate(problem="it is a symbolic link")},
        dict(incremental=True, full_every=None),
        NO_BASE,
    ),
}


@pytest.mark.parametrize("step,committed,facts,settings,expected", CASES.values(), ids=list(CASES))
def test_choose_base(
    step: int,
    committed: list[int],
    facts: dict[int, Candidate],
    settings: dict,
    expected: int | str,
) -> None:
    asked: list[int] = []

    def candidate(s: int) -> Candidate:
        asked.append(s)
        return facts[s]

    choice = choose_base(step, lambda: committed, candidate, **settings)
    assert choice.base == (None if expected == NO_BASE else expected)
    assert len(asked) <= 1  # only the newest step below is looked at


def test_a_refused_candidate_says_why() -> None:
    """The tier logs this line; a save that is full by cadence or for want of a step
    below says nothing."""
    refused = choose_base(
        8,
        lambda: [7],
        lambda s: Candidate(problem="its metadata cannot be read"),
        incremental=True,
        full_every=None,
    )
    assert refused == BaseChoice(
        None, "step 8 is saved in full: step 7 is no base (its metadata cannot be read)"
    )
    by_cadence = choose_base(
        8, lambda: [7], lambda s: Candidate(chain=4), incremental=True, full_every=2
    )
    assert by_cadence == BaseChoice(None)


def test_a_full_save_by_setting_asks_nothing() -> None:
    """With incremental off the tier is neither listed nor read (the local tier's
    listing and facts are collectives: every rank skips them alike)."""

    def never() -> list[int]:
        raise AssertionError("listed")

    def no_facts(step: int) -> Candidate:
        raise AssertionError("read")

    assert choose_base(8, never, no_facts, incremental=False, full_every=None) == BaseChoice(None)
    assert choose_base(8, lambda: [], no_facts, incremental=True, full_every=4) == BaseChoice(None)
