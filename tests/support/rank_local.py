"""A writer that saves as one rank of a job would with ``use_collectives=False``."""

from __future__ import annotations

from typing import Any

import storage


class RankWriter(storage.CheckpointWriter):
    """Saves as ``rank`` (torch passes each rank its own in ``set_up_storage_writer``):
    its ``__{rank}.metadata`` and data files, no global ``.metadata``."""

    def __init__(self, rank: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fixed_rank = rank

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        kwargs["rank"] = self.fixed_rank  # as torch passes it on that rank
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
