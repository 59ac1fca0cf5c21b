"""Lightning's versioned checkpoint names (``last.ckpt``, ``last-v1.ckpt``, ...) that a
listing which lags or misses objects does not show, asked for by name."""

from __future__ import annotations

import re

from storage.backends.base import FileSystemBase
from storage.checkpoint.layout import is_committed


def unlisted_versions(
    fs: FileSystemBase,
    location: str,
    names: list[str],
    naming: tuple[str, str, str],
    starting_version: int,
) -> list[str]:
    """The committed checkpoints under ``location`` named ``base + ext`` or ``base + join
    + "v<N>" + ext`` (``naming = (base, ext, join)``, versions from ``starting_version``)
    that ``names``, a listing, does not show: each version through the highest listed,
    and on while each is found. A templated name (``{epoch}-last``) is not asked for."""
    base, ext, join = naming
    if "{" in base:
        return []
    version = re.compile(rf"{re.escape(base + join)}v(\d+){re.escape(ext)}")
    top = max((int(m[1]) for n in names if (m := version.fullmatch(n))), default=0)
    listed, found = set(names), []
    v = starting_version - 1  # the unversioned name first
    while True:
        name = f"{base}{ext}" if v < starting_version else f"{base}{join}v{v}{ext}"
        if name not in listed:
            if is_committed(fs, fs.concat_path(location, name)):
                found.append(name)
            elif v >= max(top, starting_version):
                return found
        v += 1
