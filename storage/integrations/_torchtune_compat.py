"""The one place the torchtune integration touches torchtune's private names.

torchtune 0.6 exposes its checkpointers only from private modules, and the seams we
plug into are private methods and attributes. Each is named here with what it is for;
checked on torchtune 0.6.1 (the lowest the ``torchtune`` extra allows and the tested
release). A hook that a release no longer has would be silently never called, so the
hooks are checked at import: a missing one raises ``PrivateNameMissing`` naming
torchtune and its version (``storage/backends/_private.py``).
"""

from __future__ import annotations

from typing import Any

from storage.backends._private import PrivateNameMissing, private
from storage.integrations._deps import require

require("torchtune.training.checkpointing", "torchtune")

# torchtune.training.checkpointing._checkpointer / ._checkpoint_client (0.6): the
# modules of DistributedCheckpointer (the DCP checkpointer we subclass) and
# CheckpointClient (what distributed recipes use; it builds the DCP checkpointer).
from torchtune.training.checkpointing import _checkpoint_client, _checkpointer  # noqa: E402

TORCHTUNE = "0.6.1"

#: torchtune's ``DistributedCheckpointer``, the base of ours.
TorchtuneDistributedCheckpointer: Any = private(
    _checkpointer, "DistributedCheckpointer", "torchtune", "the DCP checkpointer", TORCHTUNE
)
#: torchtune's ``CheckpointClient``, the base of ours.
TorchtuneCheckpointClient: Any = private(
    _checkpoint_client, "CheckpointClient", "torchtune", "the checkpoint client", TORCHTUNE
)

#: The private methods our subclasses override, and what each is for.
HOOKS = {
    (TorchtuneDistributedCheckpointer, "_get_latest_intermediate_checkpoint"): (
        "finding the checkpoint to resume from"
    ),
    (TorchtuneCheckpointClient, "_get_dcp_checkpointer"): "building the DCP checkpointer",
    (TorchtuneCheckpointClient, "_get_checkpointer"): "the recipe's own checkpointer",
}


def check_hooks() -> None:
    """Raise ``PrivateNameMissing`` if a hook of :data:`HOOKS` is gone."""
    for (owner, name), purpose in HOOKS.items():
        if not callable(getattr(owner, name, None)):
            raise PrivateNameMissing("torchtune", f"{owner.__name__}.{name}", purpose, TORCHTUNE)


check_hooks()


def client_config(client: Any) -> Any:
    """``CheckpointClient._cfg``: the recipe's config (its ``dcp_storage`` section)."""
    return private(client, "_cfg", "torchtune", "reading the recipe config", TORCHTUNE)


def cached_dcp_checkpointer(client: Any) -> Any:
    """``CheckpointClient._dcp_checkpointer``: the DCP checkpointer built so far, or
    ``None``."""
    purpose = "keeping one DCP checkpointer per client"
    return private(client, "_dcp_checkpointer", "torchtune", purpose, TORCHTUNE)


def cache_dcp_checkpointer(client: Any, checkpointer: Any) -> None:
    """Set ``CheckpointClient._dcp_checkpointer`` (what its recipes read back)."""
    cached_dcp_checkpointer(client)  # the name must be there: torchtune reads it
    client._dcp_checkpointer = checkpointer


def output_dir(checkpointer: Any) -> Any:
    """``<checkpointer>._output_dir``: where the recipe's own checkpointer writes, the
    default URL of our saves."""
    purpose = "the default location of saves"
    return private(checkpointer, "_output_dir", "torchtune", purpose, TORCHTUNE)


def set_checkpoint_future(checkpointer: Any, future: Any) -> None:
    """Set ``DistributedCheckpointer._checkpoint_future``: the pending asynchronous save,
    which torchtune's own methods wait for."""
    checkpointer._checkpoint_future = future
