"""How many cores this training process may use, and how many training processes share
the host: what the default mode (:func:`storage.checkpoint.persist.default_mode`) and
the staging copies' threads are sized by. What comes from the environment or the
system is read defensively: a value that is not a whole number in ASCII digits is
ignored, never raised on."""

from __future__ import annotations

import os

from extensions.base import whole_number

#: Environment variables that launchers set to the number of training processes on
#: this host (torchrun, Open MPI, MPICH/Intel MPI, Slurm), the first one set counts.
LOCAL_RANKS_VARIABLES = (
    "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
    "SLURM_NTASKS_PER_NODE",
)
#: The most threads a stage's copies from CPU are spread over.
MAX_COPY_THREADS = 4


def local_ranks() -> int:
    """Training processes on this host, as the launcher says (1 when none does)."""
    for name in LOCAL_RANKS_VARIABLES:
        value = _count(os.environ.get(name, ""))
        if value is not None:
            return value
    return 1


def usable_cpus(root: str = "/sys/fs/cgroup", membership: str = "/proc/self/cgroup") -> int:
    """CPUs this process may run on: its affinity, lowered by the CPU quota of its
    cgroup and of every cgroup above it (the lowest counts; a fraction of a core counts
    as one): v2's ``cpu.max`` (``"<quota> <period>"``, or ``"max <period>"`` for none),
    v1's ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` (``-1``: none). The cgroups
    are read from ``membership`` (the kernel's ``/proc/self/cgroup``) under the
    hierarchy mounted at ``root``; where a cgroup's directory is not there (a container
    that sees only its own), the quota at the top of the mount counts. A value that is
    not a whole number in ASCII digits is ignored."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = cpus or 1
    quotas = _cgroup_quotas(root, membership)
    return max(1, min([cpus, *quotas]))


def _cgroup_quotas(root: str, membership: str) -> list[int]:
    """The whole cores each cgroup of this process, or one above it, allows."""
    try:
        with open(membership, encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = ["0::/"]  # no membership to read: the top of the v2 mount
    quotas: list[int] = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2: one unified hierarchy at root
            tops, read = [root], _v2_quota
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own mount
            tops, read = [os.path.join(root, controllers), os.path.join(root, "cpu")], _v1_quota
        else:
            continue
        top = next((t for t in tops if os.path.isdir(t)), None)
        if top is None:
            continue
        for directory in _up_from(top, path):
            quota = read(directory)
            if quota is not None:
                quotas.append(quota)
    return quotas


def _up_from(top: str, path: str) -> list[str]:
    """``top/path`` and every directory above it up to ``top``; only ``top`` when
    ``path`` is not a directory under it (or leaves it: ``..``)."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts or not os.path.isdir(os.path.join(top, *parts)):
        return [top]
    return [os.path.join(top, *parts[:n]) for n in range(len(parts), -1, -1)]


def _v2_quota(directory: str) -> int | None:
    fields = _read_fields(os.path.join(directory, "cpu.max"))
    if len(fields) < 2:
        return None
    quota, period = _count(fields[0]), _count(fields[1])
    return None if quota is None or period is None else quota // period  # "max": None


def _v1_quota(directory: str) -> int | None:
    quota = _read_fields(os.path.join(directory, "cpu.cfs_quota_us"))
    period = _read_fields(os.path.join(directory, "cpu.cfs_period_us"))
    if not quota or not period:
        return None
    quota_us, period_us = _count(quota[0]), _count(period[0])  # "-1": None
    return None if quota_us is None or period_us is None else quota_us // period_us


def _read_fields(path: str) -> list[str]:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(4096).split()
    except OSError:
        return []


def _count(text: str) -> int | None:
    """``text`` as a whole number above zero written in ASCII digits (at most 18 of
    them: beyond any count of processes or microseconds), else ``None``: what comes
    from the environment or the system is ignored, never raised on, when it is not
    such a number (``"²"`` passes ``str.isdigit`` and fails ``int``)."""
    return whole_number(text.strip(), 1, 10**18 - 1)


def copy_threads() -> int:
    """Threads a stage's copies from CPU into the worker's buffers run on: this
    process's share of the host's cores, at most :data:`MAX_COPY_THREADS`. The training
    thread waits for the copy, so its stall is a copy over that many cores where torch
    itself runs on one thread. The share is :func:`usable_cpus` over
    :func:`local_ranks`, or all of them where the launcher bound this process to fewer
    than the host's cores (its affinity is then its share already)."""
    cpus = usable_cpus()
    bound = hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) < (
        os.cpu_count() or 0
    )
    return max(1, min(MAX_COPY_THREADS, cpus if bound else cpus // local_ranks()))
