"""The checks on a :class:`~storage.ops.manager.CheckpointManager`'s options, made
before anything is opened: retention counts, incremental settings, and the writer
options a manager passes on to its writers (its :class:`WriterSettings`)."""

from __future__ import annotations

from typing import Any

from storage.checkpoint.options import WriterSettings

#: Writer options a manager sets itself for each save: the base and fingerprints of an
#: incremental save, and whether it publishes (a tier's own local commit does not).
CHOSEN_PER_SAVE = ("base", "fingerprint", "publish")


def check_options(
    incremental: object,
    full_every: object,
    keep_last: object,
    keep_every: object,
    keep_local: object,
    writer_options: dict[str, Any],
) -> WriterSettings:
    """The writer settings ``writer_options`` ask for, once every option is checked."""
    if not isinstance(incremental, bool):
        raise TypeError(f"incremental must be a bool, got {incremental!r}")
    if full_every is not None and not incremental:
        raise ValueError("full_every needs incremental=True")
    for name, value in (
        ("keep_last", keep_last),
        ("keep_every", keep_every),
        ("full_every", full_every),
        ("keep_local", keep_local),
    ):
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
    if keep_every is not None and keep_last is None:
        raise ValueError(
            "keep_every needs keep_last (without keep_last nothing is deleted); "
            "pass e.g. keep_last=3, keep_every=1000"
        )
    return WriterSettings.from_kwargs(
        writer_options, owner="CheckpointManager", refuse=CHOSEN_PER_SAVE
    )


def check_pace(pace: object) -> float | None:
    """``pace``: the share of the interval between saves an upload may take, or None."""
    if pace is None:
        return None
    if isinstance(pace, bool) or not isinstance(pace, int | float) or not 0 < pace <= 1:
        raise ValueError(f"pace must be a share of the interval in (0, 1] or None, got {pace!r}")
    return float(pace)
