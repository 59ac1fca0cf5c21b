"""How many cores this training process may use, and how many training processes share
the host: what the default mode (:func:`storage.checkpoint.persist.default_mode`) and
the staging copies' threads are sized by. What comes from the environment or the
system is read defensively: a value that is not a whole number in ASCII digits is
ignored, never raised on."""

from __future__ import annotations

import os

from storage.checkpoint import cgroups

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
        value = cgroups.number(os.environ.get(name, ""))
        if value is not None:
            return value
    return 1


def usable_cpus(root: str = cgroups.ROOT, membership: str = cgroups.MEMBERSHIP) -> int:
    """CPUs this process may run on: its affinity, lowered by the CPU quota of its
    cgroup and of every cgroup above it (the lowest counts; a fraction of a core counts
    as one), read from ``membership`` under ``root`` (:func:`cgroups.cpu_quotas`)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = cpus or 1
    return max(1, min([cpus, *cgroups.cpu_quotas(root, membership)]))


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
