"""The one place where dcp-storage touches torch's private API.

Every name below is private to torch (leading underscore or a private module) and may
move or change between releases. Each is imported here once, with the releases that
provide it, so a torch upgrade that breaks one fails here, by name, and nowhere else.
It lives in ``extensions`` because that is the lowest layer: ``storage`` imports it,
and ``extensions`` imports nothing from ``storage``. Checked against torch 2.13.0 (the
tested release); "since" gives the first release that has the name.
"""

from __future__ import annotations

import abc
import contextlib
import pickle
from typing import IO, Any

import torch

# torch.distributed.checkpoint._extension (since 2.7): torch's experimental
# stream-transform API. Our transforms subclass its base class and our registry accepts
# its registry, so a transform written for stock DCP works here unchanged.
try:
    from torch.distributed.checkpoint._extension import (
        ExtensionRegistry as TorchExtensionRegistry,
    )
    from torch.distributed.checkpoint._extension import (
        StreamTransformExtension as TorchStreamTransform,
    )
except ImportError:  # pragma: no cover - torch before 2.7
    TorchStreamTransform = abc.ABC  # type: ignore[misc,assignment]
    TorchExtensionRegistry = None  # type: ignore[misc,assignment]

# _StorageInfo (since 2.0; its ``transform_descriptors`` field since 2.7): where one item
# lives in a data file. It is the class stock readers unpickle from ``.metadata``.
# _item_size (since 2.0): how stock FileSystemWriter sizes an item.
# narrow_tensor_by_index (torch.distributed._shard._utils, since 1.13): the slice of a
# stored chunk that a read item asks for (stock readers use the same function).
from torch.distributed._shard._utils import narrow_tensor_by_index  # noqa: E402

# torch.distributed._shard.sharded_tensor.metadata.TensorProperties (since 1.13): the
# ShardedTensor-era tensor properties that checkpoints saved by older releases pickle in
# their .metadata; stock readers accept them, so the metadata checks do too.
from torch.distributed._shard.sharded_tensor.metadata import (  # noqa: E402
    TensorProperties as LegacyTensorProperties,
)

# StateDictStager (checkpoint._state_dict_stager, since 2.8): the deep copy DCP's
# DefaultStager stages with (it keeps DTensors and other objects intact). The persist
# worker's staging overrides its ``_stage_untyped_storage`` to copy into shared memory;
# without it (torch 2.7) saves persist in threads.
try:
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager
except ImportError:  # pragma: no cover - torch 2.7
    StateDictStager = None  # type: ignore[assignment,misc]

# set_element (checkpoint._traverse, since 2.1), _EmptyStateDictLoadPlanner
# (default_planner, since 2.2) and _load_state_dict (state_dict_loader, since 2.0): a
# load into an empty state dict without a process group (the recovery transport).
from torch.distributed.checkpoint._traverse import set_element  # noqa: E402
from torch.distributed.checkpoint.default_planner import (  # noqa: E402
    _EmptyStateDictLoadPlanner as EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.filesystem import (  # noqa: E402
    _item_size as item_size,
)
from torch.distributed.checkpoint.filesystem import (  # noqa: E402
    _StorageInfo as StorageInfo,
)

# _create_chunk_list (checkpoint.planner_helpers, since 2.0): the chunks of the global
# tensor a state-dict value holds on this rank (a tensor's whole, a DTensor's or a
# ShardedTensor's local shards), as DefaultLoadPlanner plans its reads for them.
from torch.distributed.checkpoint.planner_helpers import (  # noqa: E402
    _create_chunk_list as local_chunks,
)
from torch.distributed.checkpoint.state_dict_loader import (  # noqa: E402
    _load_state_dict as load_state_dict_without_collectives,
)

# DTensorSpec and TensorMeta (torch.distributed.tensor._dtensor_spec), and _StridedShard
# (placement_types; FSDP2 with tensor parallelism shards so): what the recovery transport
# rebuilds a received DTensor from. DeviceMesh's ``_init_backend`` keyword is used by
# ``mesh_without_groups`` below; ``compute_local_shape_and_global_offset`` (tensor._utils)
# checks a received shard against its spec. All are in 2.7 (the oldest release supported).
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # noqa: E402
from torch.distributed.tensor._utils import (  # noqa: E402
    compute_local_shape_and_global_offset as local_shape_and_offset,
)
from torch.distributed.tensor.placement_types import (  # noqa: E402
    _StridedShard as StridedShard,
)

__all__ = [
    "DTensorSpec",
    "EmptyStateDictLoadPlanner",
    "LegacyTensorProperties",
    "StorageInfo",
    "TorchExtensionRegistry",
    "TorchStreamTransform",
    "item_size",
    "load_state_dict_without_collectives",
    "local_chunks",
    "local_shape_and_offset",
    "narrow_tensor_by_index",
    "StateDictStager",
    "StridedShard",
    "TensorMeta",
    "mesh_without_groups",
    "save_tensor_archive",
    "set_element",
]


def mesh_without_groups(
    device_type: str, ranks: list[Any], dim_names: tuple[str, ...] | None
) -> DeviceMesh:
    """A ``DeviceMesh`` of these global ``ranks`` that creates no process group
    (``_init_backend=False``): creating groups is a collective, which one receiving
    worker cannot run alone. It equals a mesh of the same ranks, layout and names that
    the process built itself (DeviceMesh compares those), so a DTensor on it loads into
    one on the process's own mesh; a collective on it (``full_tensor``) may need the
    groups it lacks."""
    return DeviceMesh(device_type, ranks, mesh_dim_names=dim_names, _init_backend=False)


def save_tensor_archive(tensor: torch.Tensor, out: IO[bytes]) -> None:
    """``torch.save(tensor, out)`` without the zlib CRC-32 of each archive record.

    Uses ``torch._C.PyTorchFileWriter(stream, compute_crc32, alignment)`` (the CRC flag
    since 2.6), ``torch.serialization._get_storage_alignment`` (since 2.6) and
    ``torch.serialization._save`` (since 1.6). That CRC costs ~0.5 s of CPU per GB and
    duplicates our CRC-32C of the stored bytes; torch.load does not need it. torch only
    offers a process-wide switch, which would change every other torch.save in the
    process while a save runs, so the archive writer is built here with the CRC off for
    this call alone; where the private API differs this falls back to torch.save."""
    serialization: Any = torch.serialization
    try:
        writer = torch._C.PyTorchFileWriter(out, False, serialization._get_storage_alignment())
        save_records = serialization._save
    except (AttributeError, TypeError):
        torch.save(tensor, out)
        return
    try:
        save_records(tensor, writer, pickle, serialization.DEFAULT_PROTOCOL, False)
    except BaseException:
        # Finalize now, as torch.save does: an unfinalized writer finalizes in its C++
        # destructor, and a write failing there (the stream is gone) aborts the process.
        with contextlib.suppress(Exception):
            writer.write_end_of_file()
        raise
    writer.write_end_of_file()
