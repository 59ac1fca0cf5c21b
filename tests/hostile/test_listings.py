"""Deciding under a listing that lags behind the store or misses objects (an eventually
consistent LIST, an S3-compatible store whose index lags): a deletion never removes what
a committed checkpoint needs, and no step passes for committed or uncommitted because a
listing missed one of its files. The store is local disk whose listings hide names;
reads and looks by name see everything. Every test names, in a comment, what happened
before the fix.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import storage
from extensions.errors import CheckpointInUseError, UnsafeCheckpointError
from storage import CheckpointManager, LocalFileSystem
from storage.checkpoint import siblings
from storage.ops.describe import describe
from tests.support.rank_local import RankWriter

FROZEN = torch.arange(4096.0)


class _Hiding(LocalFileSystem):
    """Local disk whose listing of a directory leaves out the names ``hides(directory,
    name)`` says (a listing that lags or misses objects); reads by name see all."""

    def __init__(self, hides: Callable[[str, str], bool]) -> None:
        super().__init__()
        self.hides = hides

    def ls(self, path: str) -> list[str]:
        return [n for n in super().ls(path) if not self.hides(path, n)]


def _load(path: Path, state: dict[str, Any]) -> None:
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in state.items()}
    storage.load(out, str(path))
    assert all(torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v
               for k, v in state.items())  # fmt: skip


# --- rank-local metadata (``use_collectives=False``) a listing misses ------------------


@pytest.fixture
def two_rank_user(tmp_path: Path) -> tuple[Path, dict[int, dict[str, Any]]]:
    """``root/step-1`` (full) and ``root/step-2``, committed by ``__0.metadata`` and
    ``__1.metadata``: only rank 1's frozen item references step-1."""
    root = tmp_path / "root"
    storage.save({"frozen": FROZEN.clone(), "step": 1}, str(root / "step-1"), fingerprint=True)
    states = {0: {"frozen": FROZEN + 1, "step": 2}, 1: {"frozen": FROZEN.clone(), "step": 2}}
    for rank, state in states.items():
        writer = RankWriter(rank, root / "step-2", base=str(root / "step-1"))
        dcp.save(state, storage_writer=writer, no_dist=True, use_collectives=False)
    names = os.listdir(root / "step-2")
    assert {"__0.metadata", "__1.metadata"} <= set(names) and ".metadata" not in names
    refs = {r.item: r.ref for r in describe(LocalFileSystem(), str(root / "step-2")).items}
    assert refs["rank 1: frozen"] == "step-1" and refs["rank 0: frozen"] is None
    return root, states


def test_a_rank_local_metadata_the_listing_misses_still_keeps_its_base(
    two_rank_user: tuple[Path, dict[int, dict[str, Any]]],
) -> None:
    # Before: step-2 was read from its listing alone; the listing showed __0.metadata
    # (referencing nothing) but not __1.metadata, so delete(1) and retention removed
    # step-1, whose bytes rank 1 of step-2 references.
    root, _ = two_rank_user
    fs = _Hiding(lambda d, n: d.endswith("step-2") and n.startswith("__1"))
    mgr = CheckpointManager(root, keep_last=1, filesystem=fs)
    with pytest.raises(CheckpointInUseError, match="step-2"):
        mgr.delete(1)
    assert mgr.apply_retention() == [] and mgr.cleanup(grace_seconds=0) == []
    _load(root / "step-1", {"frozen": FROZEN, "step": 1})
    assert (root / "step-2" / "__1.metadata").exists()


def test_a_step_whose_listing_misses_all_its_rank_local_metadata_is_still_committed(
    two_rank_user: tuple[Path, dict[int, dict[str, Any]]],
) -> None:
    # Before: a step committed only by rank-local metadata, whose listing missed every
    # __N.metadata, was taken for an interrupted save: steps() left it out, delete(1)
    # removed its base and cleanup(grace_seconds=0) removed its data files.
    root, _ = two_rank_user
    fs = _Hiding(lambda d, n: d.endswith("step-2") and n.endswith(".metadata"))
    mgr = CheckpointManager(root, filesystem=fs)
    assert mgr.steps() == [1, 2]
    with pytest.raises(CheckpointInUseError, match="step-2"):
        mgr.delete(1)
    assert mgr.cleanup(grace_seconds=0) == []
    assert sum(n.endswith(".distcp") for n in os.listdir(root / "step-2")) == 2


def test_gc_keeps_the_files_of_a_rank_local_metadata_the_listing_misses(
    tmp_path: Path,
) -> None:
    # Before: beside .metadata, a rank-local __1.metadata the listing missed left its
    # data files named by no metadata gc could see, and gc removed them as orphans.
    step = tmp_path / "root" / "step-3"
    storage.save({"w": torch.ones(4)}, str(step))
    writer = RankWriter(1, step)
    dcp.save({"w": torch.full((4,), 2.0)}, storage_writer=writer, no_dist=True,
             use_collectives=False)  # fmt: skip
    rank1 = sorted(n for n in os.listdir(step) if n.startswith("__1_"))
    assert rank1 and (step / ".metadata").exists() and (step / "__1.metadata").exists()
    fs = _Hiding(lambda d, n: n == "__1.metadata")
    assert CheckpointManager(tmp_path / "root", filesystem=fs).orphans(grace_seconds=0) == []
    assert sorted(n for n in os.listdir(step) if n.startswith("__1_")) == rank1


# --- a step directory the root's listing misses ------------------------------------------


def _state(step: int) -> dict[str, Any]:
    """``frozen`` never changes, ``b`` changes up to step 2, ``w`` at every step: an
    incremental step 3 references step-2 (``b``) and step-1 (``frozen``)."""
    return {
        "frozen": FROZEN.clone(),
        "b": torch.full((8,), float(min(step, 2))),
        "w": torch.full((8,), float(step)),
        "step": step,
    }


def _hides(root: Path, steps: set[int]) -> Callable[[str, str], bool]:
    """The listing of ``root`` misses the directories of ``steps`` (as they are then)."""
    return lambda d, n: d.rstrip("/") == str(root) and n in {f"step-{s}" for s in steps}


def test_a_step_the_root_listing_misses_stays_latest_and_keeps_its_base(tmp_path: Path) -> None:
    # Before: right after this manager saved step-3, a listing that did not show it yet
    # made latest() (and load()) go back to step 2 and let delete(2), or a save over
    # step-2 in the same process, remove step-2's files, whose bytes step-3 references:
    # step-3 no longer loaded.
    root = tmp_path / "root"
    mgr = CheckpointManager(root, incremental=True, filesystem=_Hiding(_hides(root, {3})))
    for step in (1, 2, 3):
        mgr.save(step, _state(step))
    refs = {r.ref for r in describe(LocalFileSystem(), str(root / "step-3")).items}
    assert refs == {"step-1", "step-2", None}
    assert mgr.steps() == [1, 2, 3] and mgr.latest() == 3
    with pytest.raises(CheckpointInUseError, match="step-3"):
        mgr.delete(2)
    with pytest.raises(CheckpointInUseError, match="overwrite .*step-3"):
        storage.save(_state(9), str(root / "step-2"), overwrite=True, filesystem=mgr.fs)
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1
           for k, v in _state(0).items()}  # fmt: skip
    assert mgr.load(out) == 3 and out["step"] == 3
    _load(root / "step-3", _state(3))


def test_retention_keeps_the_base_of_a_kept_step_the_root_listing_misses(
    tmp_path: Path,
) -> None:
    # Before: step-2 (kept by keep_every=2, referencing step-1) went missing from the
    # root's listing; retention saw steps 1 and 3, kept step-3 and deleted step-1,
    # which step-2 needs: step-2 no longer loaded.
    root = tmp_path / "root"
    hidden: set[int] = set()
    fs = _Hiding(_hides(root, hidden))
    mgr = CheckpointManager(
        root, incremental=True, full_every=2, keep_last=1, keep_every=2, filesystem=fs
    )
    for step in (1, 2, 3):
        mgr.save(step, _state(step))
    assert mgr.steps() == [1, 2, 3]
    hidden.add(2)
    assert mgr.apply_retention() == []
    _load(root / "step-1", _state(1))
    _load(root / "step-2", _state(2))


class _CountingLooks(LocalFileSystem):
    """Local disk that counts the looks by name (``exists``)."""

    looks = 0

    def exists(self, path: str) -> bool:
        self.looks += 1
        return super().exists(path)


def test_a_directory_without_metadata_costs_two_looks_whatever_its_ranks(
    tmp_path: Path,
) -> None:
    # The looks by name for metadata a listing may miss are bounded: a directory of 64
    # ranks' data files and no metadata (a save in flight) costs .metadata and
    # __0.metadata, not one look per rank, each time steps() or the read model asks.
    from storage.checkpoint.committed import open_committed
    from storage.checkpoint.layout import is_committed

    step = tmp_path / "step-1"
    step.mkdir()
    for rank in range(64):
        (step / f"__{rank}_0-abc.distcp").write_bytes(b"x")
    fs = _CountingLooks()
    assert not is_committed(fs, str(step)) and fs.looks == 2
    fs.looks = 0
    assert not open_committed(fs, str(step)).committed and fs.looks == 2


# --- a base whose own listing misses its files ----------------------------------------


def test_saves_whose_listing_misses_their_files_or_their_bases_files_commit(
    tmp_path: Path,
) -> None:
    # Before: a save's own files, and those it references in its base, were looked for
    # in a listing alone. A listing that did not show step-1's files yet (just written)
    # failed step-1's own save ("data file(s) of this save vanished"), made the next
    # save a full one ("step-1 lacks its file"), and failed a save with an explicit
    # base ("base checkpoint lost its file"), or withdrew its metadata once landed.
    root = tmp_path / "root"
    fs = _Hiding(lambda d, n: d.rstrip("/") == str(root / "step-1"))
    mgr = CheckpointManager(root, incremental=True, filesystem=fs)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    storage.save(_state(3), str(root / "other"), base=str(root / "step-1"), filesystem=fs)
    for name in ("step-2", "other"):
        refs = {r.ref for r in describe(LocalFileSystem(), str(root / name)).items}
        assert "step-1" in refs, name
    _load(root / "step-2", _state(2))
    _load(root / "other", _state(3))


# --- on a real S3 server (moto), with its listings hiding a step -------------------------


@pytest.fixture
def s3_hiding_step_3(request: pytest.FixtureRequest) -> Any:
    """An ``S3FileSystem`` on the session's moto server whose listings miss ``step-3``."""
    from storage import S3FileSystem
    from tests.support.servers import endpoint_with_bucket, s3_options

    endpoint = endpoint_with_bucket(request, "dcp-listings")

    class Hiding(S3FileSystem):
        def ls(self, path: str) -> list[str]:
            return [n for n in super().ls(path) if n != "step-3"]

    return Hiding(storage_options=s3_options(endpoint))


def test_on_s3_a_step_the_listing_misses_stays_latest_and_keeps_its_base(
    s3_hiding_step_3: Any,
) -> None:
    # The same as on local disk above, through S3's listings and looks by name: before,
    # latest() went back to step 2 and delete(2) removed the base step-3 references.
    import uuid

    fs = s3_hiding_step_3
    root = f"s3://dcp-listings/{uuid.uuid4().hex}/"
    mgr = CheckpointManager(root, incremental=True, filesystem=fs)
    for step in (1, 2, 3):
        mgr.save(step, _state(step))
    assert mgr.steps() == [1, 2, 3] and mgr.latest() == 3
    with pytest.raises(CheckpointInUseError, match="step-3"):
        mgr.delete(2)
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1
           for k, v in _state(0).items()}  # fmt: skip
    assert mgr.load(out) == 3 and torch.equal(out["b"], _state(3)["b"])
    # A restarted job, which never saw step-3, finds it through the root's latest
    # pointer (a PUT, then a ranged GET by name): before, it resumed from step 2.
    _fresh_process(mgr, (1, 2, 3))
    fresh = CheckpointManager(root, filesystem=fs)
    assert fresh.steps() == [1, 2, 3] and fresh.latest() == 3


# --- a fresh process whose root listing misses the newest step: the latest pointer --------


def _fresh_process(mgr: CheckpointManager, steps: Any) -> None:
    """Forget that this process saw ``steps`` committed under ``mgr``'s root, as a
    restarted job never saw them."""
    for step in steps:
        siblings.forget(mgr.fs, mgr.step_path(step))


def _pointer_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "storage.checkpoint.latest"]


def test_a_fresh_process_whose_listing_misses_the_newest_step_resumes_from_it(
    tmp_path: Path,
) -> None:
    # Before: a restarted job (which never saw step-3 committed) whose listing missed
    # step-3 resumed from step 2: latest() and load() said 2, and its next incremental
    # save referenced step-2 instead of step-3.
    root = tmp_path / "root"
    CheckpointManager(root, incremental=True).save(1, _state(1))
    writer = CheckpointManager(root, incremental=True)
    for step in (2, 3):
        writer.save(step, _state(step))
    assert (root / ".dcp-latest").read_bytes() == b"step-3\n"
    _fresh_process(writer, (1, 2, 3))
    mgr = CheckpointManager(root, incremental=True, filesystem=_Hiding(_hides(root, {3})))
    assert mgr.steps() == [1, 2, 3] and mgr.latest() == 3
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1
           for k, v in _state(0).items()}  # fmt: skip
    assert mgr.load(out) == 3 and out["step"] == 3
    mgr.save(4, {**_state(3), "step": 4})  # unchanged since step 3 but for "step"
    refs = {r.item: r.ref for r in describe(LocalFileSystem(), str(root / "step-4")).items}
    assert refs["w"] == "step-3", refs
    assert (root / ".dcp-latest").read_bytes() == b"step-4\n"


def test_the_pointer_never_goes_back_and_goes_with_the_step_it_names(tmp_path: Path) -> None:
    # Saving an older step after a newer one keeps the pointer on the newer one (it is
    # still committed); deleting the step it names removes it, so the next save sets it
    # afresh; a root without one (written before it existed) is listed as ever.
    root = tmp_path / "root"
    mgr = CheckpointManager(root)
    mgr.save(10, _state(10))
    mgr.save(5, _state(5))
    assert (root / ".dcp-latest").read_bytes() == b"step-10\n"
    mgr.delete(10)
    assert not (root / ".dcp-latest").exists()
    mgr.save(6, _state(6))
    assert (root / ".dcp-latest").read_bytes() == b"step-6\n"
    (root / ".dcp-latest").unlink()
    _fresh_process(mgr, (5, 6))
    assert CheckpointManager(root).latest() == 6


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"step-9\n", id="an-absent-step"),
        pytest.param(b"step-4\n", id="an-uncommitted-step"),
    ],
)
def test_a_pointer_to_a_step_that_is_not_committed_is_passed_over(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    # A pointer is trusted only for a step whose metadata is found by name: one naming a
    # deleted step, or an interrupted save's directory the listing misses, must not make
    # latest() a step that does not load. The listing decides, and a warning says why.
    root = tmp_path / "root"
    mgr = CheckpointManager(root)
    mgr.save(2, _state(2))
    (root / "step-4").mkdir()
    (root / "step-4" / "__0_0-abc.distcp").write_bytes(b"interrupted")
    (root / ".dcp-latest").write_bytes(content)
    _fresh_process(mgr, (2,))
    with caplog.at_level("WARNING", logger="storage.checkpoint.latest"):
        assert CheckpointManager(root, filesystem=_Hiding(_hides(root, {4}))).latest() == 2
    (warning,) = _pointer_warnings(caplog)
    assert "is not a committed checkpoint" in warning and content.decode().strip() in warning


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"step-07\n", id="not-canonical"),
        pytest.param(b"../step-3", id="a-path"),
        pytest.param(b"step-3\x1b[2J", id="an-escape-sequence"),
        pytest.param(b"global_step3", id="another-tools-latest"),
        pytest.param(b"step-3\n" * 4096, id="oversized"),
        pytest.param(b"\xff\xfe", id="not-text"),
    ],
)
def test_a_pointer_that_is_not_ours_is_refused_and_never_overwritten(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    # Whoever can write the root can write `.dcp-latest`: its content names no step unless it
    # is exactly `step-<N>`, it is read only up to its bound, the warning quotes it
    # escaped, and a save leaves another tool's object alone.
    from storage.checkpoint import latest

    root = tmp_path / "root"
    mgr = CheckpointManager(root)
    mgr.save(2, _state(2))
    (root / ".dcp-latest").write_bytes(content)
    with pytest.raises(UnsafeCheckpointError, match="not a latest-step pointer"):
        latest.read(mgr.fs, str(root))
    _fresh_process(mgr, (2,))
    fs = _Hiding(_hides(root, {3}))
    with caplog.at_level("WARNING", logger="storage.checkpoint.latest"):
        fresh = CheckpointManager(root, filesystem=fs)
        assert fresh.latest() == 2
        fresh.save(3, _state(3))
    (warning,) = _pointer_warnings(caplog)  # once, for the look and the save
    assert "not a latest-step pointer" in warning and "\x1b" not in warning
    assert len(warning) < 1024
    assert (root / ".dcp-latest").read_bytes() == content


def test_pointer_warnings_remembered_are_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each distinct bad content of `.dcp-latest` was remembered (to warn once) for as long
    # as the process ran: whoever can write the root could grow that memory at will.
    from storage.checkpoint import latest

    monkeypatch.setattr(latest, "_warned", set())
    root = tmp_path / "root"
    mgr = CheckpointManager(root)
    mgr.save(2, _state(2))
    fs = _Hiding(_hides(root, {3}))
    fresh = CheckpointManager(root, filesystem=fs)
    for i in range(latest._MAX_WARNED + 50):
        (root / ".dcp-latest").write_bytes(f"junk-{i}".encode())
        assert fresh.latest() == 2
    assert 0 < len(latest._warned) <= latest._MAX_WARNED
