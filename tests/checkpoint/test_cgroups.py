"""The memory this process may use: the host's physical memory, lowered by the memory
limit of its cgroup or of one above it (v2 ``memory.max``, v1
``memory.limit_in_bytes``), read from a cgroup tree built here (the functions take the
mount and the membership file as parameters). Before, a recovery receive's budget was
the host's physical memory alone: in a container limited to 4 GiB on a 512 GiB host it
let a receive allocate far past what the container may use, and the kernel's
out-of-memory killer ended the replica that was healing."""

from __future__ import annotations

from pathlib import Path

import pytest

from storage.checkpoint import cgroups
from storage.ops.transport_budget import budget

LIMIT = 64 << 20  # below any host's memory
#: What v1 reports for "no limit" (PAGE_COUNTER_MAX pages of 4 KiB).
V1_UNLIMITED = "9223372036854771712"


def _tree(top: Path, directory: str, files: dict[str, str]) -> None:
    where = top / directory
    where.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (where / name).write_text(text)


def _usable(top: Path, membership: Path) -> int | None:
    return cgroups.usable_memory(str(top), str(membership))


def test_a_v2_memory_limit_on_this_cgroup_or_one_above_lowers_the_usable_memory(
    tmp_path: Path,
) -> None:
    host = cgroups.physical_memory()
    assert host is not None and host > LIMIT
    membership = tmp_path / "cgroup"
    membership.write_text("0::/kubepods/pod1/job\n")
    _tree(tmp_path, "kubepods/pod1/job", {"memory.max": "max\n"})
    _tree(tmp_path, "kubepods/pod1", {"memory.max": f"{LIMIT}\n"})
    assert _usable(tmp_path, membership) == LIMIT
    (tmp_path / "kubepods/pod1/job/memory.max").write_text(f"{LIMIT // 2}\n")
    assert _usable(tmp_path, membership) == LIMIT // 2  # the lowest counts
    for name in ("kubepods/pod1", "kubepods/pod1/job"):
        (tmp_path / name / "memory.max").write_text("max\n")
    assert _usable(tmp_path, membership) == host
    (tmp_path / "kubepods/pod1/memory.max").write_text(f"{host * 4}\n")  # above the host's
    assert _usable(tmp_path, membership) == host
    # A cgroup this mount does not show (a container seeing only its own): the top counts.
    membership.write_text("0::/elsewhere/job\n")
    (tmp_path / "memory.max").write_text(f"{LIMIT}\n")
    assert _usable(tmp_path, membership) == LIMIT
    assert cgroups.usable_memory(str(tmp_path / "missing"), str(membership)) == host


def test_a_v1_memory_limit_lowers_the_usable_memory_and_its_unlimited_value_is_none(
    tmp_path: Path,
) -> None:
    host = cgroups.physical_memory()
    membership = tmp_path / "cgroup"
    membership.write_text("7:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    _tree(tmp_path, "memory/docker/abc", {"memory.limit_in_bytes": f"{V1_UNLIMITED}\n"})
    _tree(tmp_path, "memory", {"memory.limit_in_bytes": f"{V1_UNLIMITED}\n"})
    assert cgroups.memory_limit(str(tmp_path), str(membership)) is None
    assert _usable(tmp_path, membership) == host
    (tmp_path / "memory/docker/abc/memory.limit_in_bytes").write_text(f"{LIMIT}\n")
    assert _usable(tmp_path, membership) == LIMIT
    # A v1 file is not read as v2's, nor the other way round.
    (tmp_path / "memory/docker/abc/memory.max").write_text("1\n")
    (tmp_path / "memory.limit_in_bytes").write_text("1\n")
    assert _usable(tmp_path, membership) == LIMIT


@pytest.mark.parametrize("text", ["max", "-1", "0", "\u00b2", "9" * 5000, "", "1e9"])
def test_a_memory_limit_that_is_no_number_or_absurd_is_no_limit(tmp_path: Path, text: str) -> None:
    """A value that is not a whole number of bytes (or past an exabyte) is no limit,
    never raised on: sizing a receive must not fail on what a kernel wrote."""
    membership = tmp_path / "cgroup"
    membership.write_text("0::/job\n")
    _tree(tmp_path, "job", {"memory.max": text + "\n"})
    assert cgroups.memory_limit(str(tmp_path), str(membership)) is None


def test_a_receive_without_a_state_is_budgeted_by_the_memory_this_process_may_use() -> None:
    """The recovery receive's budget without ``state_dict=`` asks the one function that
    knows this process's memory, and says where its limit comes from."""
    got = budget(None, None)
    assert got.limit == cgroups.usable_memory() and "cgroup" in got.why
