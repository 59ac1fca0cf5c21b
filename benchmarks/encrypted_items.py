"""What encryption's sealed metadata costs: an encrypted save and load, each in a fresh
process, of one code tree against another.

    python benchmarks/encrypted_items.py --against /path/to/older/checkout
    python benchmarks/encrypted_items.py --count 40 --size 13107200 --against ...

Saves ``--count`` float32 tensors of ``--size`` bytes with ``storage.save(...,
transforms=[AES256GCM(...)])`` to a local directory, then loads them with
``storage.load(..., keys=...)``, each call in a new interpreter whose ``sys.path``
starts with the tree being measured (this checkout, and ``--against``: a worktree of an
older commit, e.g. ``git worktree add /tmp/old <rev>``, with the compiled
``extensions/_native*.so`` copied in). The state, and for a load its target, is built
before the clock starts. A warm-up round, then ``--rounds`` rounds alternating the
trees; each call's seconds are printed, then the medians. The checkpoint a tree saves
is the one it loads, so each side pays for what it writes (a seal, or none).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = bytes(range(32))  # a benchmark key: protects nothing


def _child(tree: str, op: str, path: str, count: int, size: int) -> None:
    sys.path.insert(0, tree)
    import time

    import torch

    import storage
    from extensions import AES256GCM

    gen = torch.Generator().manual_seed(0)
    state = {f"layer{i}.w": torch.randn(size // 4, generator=gen) for i in range(count)}
    if op == "save":
        start = time.perf_counter()
        storage.save(state, path, transforms=[AES256GCM(key=KEY, key_id="bench")])
    else:
        target = {k: torch.empty_like(v) for k, v in state.items()}
        start = time.perf_counter()
        storage.load(target, path, keys={"bench": KEY})
        assert all(torch.equal(target[k], v) for k, v in state.items())
    print(f"{time.perf_counter() - start:.3f}")


def _run(tree: str, op: str, path: str, count: int, size: int) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--child", tree, op, path, str(count), str(size)],
        check=True,
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),  # never the checkout: the child imports from `tree`
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        tree, op, path, count, size = sys.argv[2:7]
        _child(tree, op, path, int(count), int(size))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="the other code tree")
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--size", type=int, default=64, help="bytes per tensor")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    trees = {"this": ROOT, "against": os.path.abspath(args.against)}
    work = tempfile.mkdtemp(prefix="encrypted-items-")
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for round_ in range(args.rounds + 1):
            for name, tree in trees.items():
                path = os.path.join(work, name)
                shutil.rmtree(path, ignore_errors=True)
                save = _run(tree, "save", path, args.count, args.size)
                load = _run(tree, "load", path, args.count, args.size)
                label = "warm-up" if round_ == 0 else f"round {round_}"
                print(f"{label}: {name}: save {save:.3f} s, load {load:.3f} s", flush=True)
                if round_:
                    times.setdefault((name, "save"), []).append(save)
                    times.setdefault((name, "load"), []).append(load)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for op in ("save", "load"):
        this = statistics.median(times[("this", op)])
        other = statistics.median(times[("against", op)])
        print(f"{op}: this {this:.3f} s, against {other:.3f} s, difference {this - other:+.3f} s")


if __name__ == "__main__":
    main()
