"""Planting bytes of the test's choosing as one item of a checkpoint on local disk: for
attack tests of what a reader does with stored bytes it did not write (bombs, archives
torch would inflate), past the checksum the planting drops."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from storage.checkpoint import storage_format as fmt


def plant_item(ckpt: Path, fqn: str, stored: bytes, **extra_changes: Any) -> None:
    """Append ``stored`` to the data file of item ``fqn`` of the checkpoint ``ckpt`` and
    point the item at it, its checksum dropped; each of ``extra_changes`` sets that key
    of the item's stored facts, or removes it where the value is ``None``."""
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())  # the test's own file
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == fqn)
    path = ckpt / info.relative_path
    info.offset = path.stat().st_size
    info.length = len(stored)
    with path.open("ab") as f:
        f.write(stored)
    extra = getattr(info, fmt.EXTRA)
    extra.pop("crc32c", None)
    for key, value in extra_changes.items():
        if value is None:
            extra.pop(key, None)
        else:
            extra[key] = value
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
