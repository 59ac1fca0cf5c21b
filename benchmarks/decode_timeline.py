"""Timeline of a zstd load: which thread reads and which decodes, and when.

    PYTHONPATH=. python benchmarks/decode_timeline.py --size-mb 512
    PYTHONPATH=. python benchmarks/decode_timeline.py --size-mb 512 --tensors 2   # 2 big items

Saves the benchmark state dict (``bench.build_state_dict``, or ``--tensors`` large ones)
with ``extensions.ZStandard()``, loads it once untimed (warm page cache), then loads it
again with the readers' reads and the decoders' frames timestamped (by wrapping
``frames.decode_framed``'s reads and ``frames._decode_part``; the code is otherwise the
library's). Prints one row per thread, one column per ``--bucket`` ms: ``#`` decoding,
``r`` reading and checksumming, ``.`` neither; then each thread's busy share and the
total CPU time of the load.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import storage  # noqa: E402
from benchmarks.bench import build_state_dict, zeros_like  # noqa: E402
from extensions import ZStandard  # noqa: E402
from storage.checkpoint import frames  # noqa: E402

Span = tuple[str, str, float, float]  # thread, kind, start, end


def _timed(kind: str, fn: Callable[..., Any], spans: list[Span]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            thread = threading.current_thread()
            name = thread.name if "decoding" in thread.name else f"{thread.name}-{thread.ident}"
            spans.append((name[-28:], kind, start, time.perf_counter()))

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=512)
    parser.add_argument("--tensors", type=int, default=40)
    parser.add_argument("--bucket", type=float, default=5.0, help="ms per column")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="dcp-timeline-")
    try:
        state = build_state_dict(args.size_mb, n_tensors=args.tensors)
        storage.save(state, work, transforms=[ZStandard()])
        target = zeros_like(state)
        storage.load(target, work)  # warm-up: page cache, imports
        spans: list[Span] = []
        frames._decode_part = _timed("decode", frames._decode_part, spans)  # type: ignore[assignment]
        frames.readinto_exact = _timed("read", frames.readinto_exact, spans)  # type: ignore[assignment]
        cpu0, t0 = os.times(), time.perf_counter()
        storage.load(target, work)
        wall, cpu1 = time.perf_counter() - t0, os.times()
        assert all(
            torch.equal(target[k], state[k]) for k in state if isinstance(state[k], torch.Tensor)
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cpu = cpu1.user - cpu0.user + cpu1.system - cpu0.system
    columns = max(1, int(wall * 1000 / args.bucket) + 1)
    names = sorted({s[0] for s in spans})
    print(
        f"{args.size_mb:.0f} MB in {args.tensors} tensors, zstd: load {wall * 1000:.0f} ms, "
        f"CPU {cpu * 1000:.0f} ms ({cpu / wall:.2f} cores); one column = {args.bucket:g} ms"
    )
    for name in names:
        row = ["."] * columns
        busy = 0.0
        for thread, kind, start, end in spans:
            # A decoder's reads are inside its decodes (the same helper): count those once.
            if thread != name or ("decoding" in name and kind == "read"):
                continue
            busy += end - start
            first, last = (
                int((start - t0) * 1000 / args.bucket),
                int((end - t0) * 1000 / args.bucket),
            )
            for c in range(max(0, first), min(columns - 1, last) + 1):
                if row[c] != "#":
                    row[c] = "#" if kind == "decode" else "r"
        print(f"{name:>28} {''.join(row)} {100 * busy / wall:3.0f}% busy")


if __name__ == "__main__":
    main()
