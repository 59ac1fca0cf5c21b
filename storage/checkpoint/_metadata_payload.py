"""The ``.metadata`` a writer's save publishes, completed and serialized (:func:`metadata_payload`).

DCP hands the writer's ``finish`` the global ``Metadata``; what makes it this save's
checkpoint is added here: the storage index of every item (where its bytes are and how
they were encoded: ``storage_format.StoredItem``), ``storage_meta`` naming the location
and the save id (the data files' names carry it), torch's metadata version, and our
facts (``storage_format.dump_metadata``): for a global metadata, how many ranks saved
together; for a save that records fingerprints, the
length of its incremental chain (``0`` when no item references a base), and the seals
of the chain's sealing keys (``storage.checkpoint.seal``), made over the complete
metadata under its own file name. Publishing it, or handing it to the caller who does,
is the writer's (``commit.commit_checkpoint``); docs/format.md describes the fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.storage import WriteResult

from storage.checkpoint import incremental
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.seal import make_seals

DCP_VERSION = "1.0.0"


def metadata_payload(
    metadata: Metadata,
    results: list[list[WriteResult]],
    *,
    url: str,
    save_id: str,
    name: str,
    transforms: Sequence[Any],
    fingerprint: bool,
    base: incremental.Base | None,
) -> bytes:
    """``metadata`` (changed in place) completed with the storage index of ``results``
    and save ``save_id`` of the checkpoint at ``url``, sealed as the file ``name``
    (``.metadata``, or a rank's ``__{rank}.metadata``) under the sealing keys of
    ``transforms``, then serialized. ``fingerprint``: the save recorded fingerprints,
    so its chain length is recorded too, one more than ``base``'s where an item
    references it."""
    metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
    metadata.storage_meta = StorageMeta(checkpoint_id=url, save_id=save_id)
    metadata.version = DCP_VERSION
    extra: dict[str, Any] = {}
    if name == fmt.METADATA_NAME:  # every rank's results: verify checks coverage by it
        extra[fmt.RANKS] = len(results)
    if fingerprint:  # incremental saves since the last full one
        refs = any(fmt.stored_item(i).ref for i in metadata.storage_data.values())
        extra[fmt.CHAIN] = (base.chain + 1 if base else 1) if refs else 0
    seals = make_seals(metadata, transforms, save_id, name)
    if seals:
        extra[fmt.SEAL] = seals
    return fmt.dump_metadata(metadata, **extra)
