"""What this process may use of its host: the cgroups it belongs to (and every one above
each), and the limits read from them: its CPU quota (:func:`cpu_quotas`, which sizes
the persist worker's mode and copies) and its memory (:func:`usable_memory`, which
sizes a recovery receive's budget). Whatever sizes something by memory asks
:func:`usable_memory`: in a container the host's memory is not the process's (a 4 GiB
limit on a 512 GiB host).

The cgroups are read from ``membership`` (the kernel's ``/proc/self/cgroup``) under the
hierarchies mounted at ``root`` (``/sys/fs/cgroup``): v2's unified one at ``root``
itself, v1's one per controller at ``root/<controllers>`` (or ``root/<controller>``).
Where a cgroup's directory is not there (a container that sees only its own), the limit
at the top of the mount counts. What the system says is read defensively: a value that
is not a whole number in ASCII digits (``max``, ``-1``) is no limit, never raised on,
and so is one past :data:`MAX_VALUE` (v1's "unlimited" memory is about 2**63).
"""

from __future__ import annotations

import os

from extensions.base import whole_number

ROOT = "/sys/fs/cgroup"
MEMBERSHIP = "/proc/self/cgroup"
#: A value past this (an exabyte; 30,000 years in microseconds) is no limit.
MAX_VALUE = 10**18 - 1


def cgroup_dirs(
    controller: str, root: str = ROOT, membership: str = MEMBERSHIP
) -> list[tuple[str, bool]]:
    """The directories of this process's cgroups that ``controller`` (``"cpu"``,
    ``"memory"``) may limit, each followed by those above it up to the top of its
    mount, with whether it is a v1 one (its files are the controller's own:
    ``cpu.cfs_quota_us``, ``memory.limit_in_bytes``; v2's are ``cpu.max``,
    ``memory.max``)."""
    try:
        with open(membership, encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = ["0::/"]  # no membership to read: the top of the v2 mount
    found: list[tuple[str, bool]] = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2: one unified hierarchy at root
            tops = [root]
        elif controller in controllers.split(","):  # v1: the controller's own mount
            tops = [os.path.join(root, controllers), os.path.join(root, controller)]
        else:
            continue
        top = next((t for t in tops if os.path.isdir(t)), None)
        if top is not None:
            found.extend((d, controllers != "") for d in _up_from(top, path))
    return found


def _up_from(top: str, path: str) -> list[str]:
    """``top/path`` and every directory above it up to ``top``; only ``top`` when
    ``path`` is not a directory under it (or leaves it: ``..``)."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts or not os.path.isdir(os.path.join(top, *parts)):
        return [top]
    return [os.path.join(top, *parts[:n]) for n in range(len(parts), -1, -1)]


def cpu_quotas(root: str = ROOT, membership: str = MEMBERSHIP) -> list[int]:
    """The whole cores each cgroup of this process, or one above it, allows (rounded
    down: a fraction of a core is 0 here): v2's ``cpu.max`` (``"<quota> <period>"``, or
    ``"max <period>"`` for none), v1's ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``
    (``-1``: none)."""
    quotas: list[int] = []
    for directory, v1 in cgroup_dirs("cpu", root, membership):
        if v1:
            quota = fields(os.path.join(directory, "cpu.cfs_quota_us"))[:1]
            pair = quota + fields(os.path.join(directory, "cpu.cfs_period_us"))[:1]
        else:
            pair = fields(os.path.join(directory, "cpu.max"))[:2]
        counts = [number(f) for f in pair]
        if len(counts) == 2 and counts[0] is not None and counts[1] is not None:
            quotas.append(counts[0] // counts[1])
    return quotas


def memory_limit(root: str = ROOT, membership: str = MEMBERSHIP) -> int | None:
    """The lowest memory limit of this process's cgroups and those above them, in bytes
    (v2's ``memory.max``, v1's ``memory.limit_in_bytes``), ``None`` where none is set."""
    limits = []
    for directory, v1 in cgroup_dirs("memory", root, membership):
        name = "memory.limit_in_bytes" if v1 else "memory.max"
        value = number((fields(os.path.join(directory, name)) or [""])[0])
        if value is not None:
            limits.append(value)
    return min(limits, default=None)


def physical_memory() -> int | None:
    """This host's physical memory in bytes, ``None`` where it cannot be read."""
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or no such name
        return None
    return pages * size if pages > 0 and size > 0 else None


def usable_memory(root: str = ROOT, membership: str = MEMBERSHIP) -> int | None:
    """The memory this process may use, in bytes: the host's physical memory, lowered
    by its cgroups' memory limit; ``None`` where neither can be read."""
    known = [m for m in (physical_memory(), memory_limit(root, membership)) if m is not None]
    return min(known, default=None)


def fields(path: str) -> list[str]:
    """The whitespace-separated fields of the file at ``path`` (its first 4 KiB), none
    where it cannot be read."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(4096).split()
    except OSError:
        return []


def number(text: str) -> int | None:
    """``text`` as a whole number above zero written in ASCII digits, at most
    :data:`MAX_VALUE`, else ``None``: what comes from the environment or the system is
    ignored, never raised on, when it is not such a number (``"²"`` passes
    ``str.isdigit`` and fails ``int``)."""
    return whole_number(text.strip(), 1, MAX_VALUE)
