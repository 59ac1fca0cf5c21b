"""Resealing a tampered metadata, as only a holder of the key could: for tests of what
stands behind the metadata's seal (an item's own binding, a decoder's bounds, the
encryption policy), which an attacker without the key meets only after the seal."""

from __future__ import annotations

import pickle
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from storage.checkpoint import storage_format as fmt
from storage.checkpoint.seal import make_seals


def resealed(metadata: Metadata, *transforms: Any, name: str = ".metadata") -> bytes:
    """``metadata`` serialized with its seal made afresh under ``transforms``' keys, as
    the file ``name``. It is copied through pickle first, so changes made in place to
    its records count."""
    fresh = pickle.loads(pickle.dumps(metadata))  # the test's own objects: trusted
    seals = make_seals(fresh, list(transforms), "resealed", name)
    setattr(fresh, fmt.EXTRA, {**fmt.checkpoint_facts(fresh), fmt.SEAL: seals})
    return pickle.dumps(fresh)
