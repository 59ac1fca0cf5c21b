"""Who held the GIL: a summary of ``py-spy record --gil --threads --format raw`` output.

    python benchmarks/gil_summary.py PROFILE.txt [--top 12]

``benchmarks/training_loop.py --profile DIR`` writes one such file per variant run. Each
line is a folded stack (process; thread; frames outermost first) and a sample count; with
``--gil`` py-spy samples only the thread holding the GIL. Printed: samples per thread
(seconds at 100 Hz) and, per thread, the functions with the most samples anywhere on the
stack (inclusive) below the thread's entry point, restricted to the training loop for the
main thread (stacks through ``child``'s loop, not imports or setup).
"""

from __future__ import annotations

import argparse
import collections
import re

_THREAD = re.compile(r"thread \(\d+\): ?(.*)")


def parse(path: str) -> dict[str, list[tuple[list[str], int]]]:
    """Thread name -> [(frames outermost first, samples)]."""
    threads: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            parts = stack.split(";")
            thread = next((m.group(1) or "?" for p in parts if (m := _THREAD.match(p))), "?")
            frames = [p for p in parts if not _THREAD.match(p) and not p.startswith("process ")]
            name = re.sub(r"[-_]\d+(_\d+)?$", "", thread)  # pool threads counted together
            threads[name].append((frames, int(count)))
    return threads


def in_loop(frames: list[str]) -> bool:
    """A main-thread stack of the timed loop: a training step or a variant's save."""
    return any(f.startswith("child (training_loop.py") for f in frames) and any(
        "train_step (" in f or "(loop_variants.py" in f for f in frames
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    threads = parse(args.profile)
    for name, stacks in sorted(threads.items(), key=lambda kv: -sum(c for _, c in kv[1])):
        if name == "MainThread":
            stacks = [(f, c) for f, c in stacks if in_loop(f)]
        total = sum(c for _, c in stacks)
        if not total:
            continue
        print(f"\n{name}: {total} samples holding the GIL ({total / 100:.1f} s)")
        inclusive: collections.Counter[str] = collections.Counter()
        for frames, count in stacks:
            for frame in dict.fromkeys(frames[1:]):  # each function once per stack
                inclusive[re.sub(r":\d+\)$", ")", frame)] += count
        for frame, count in inclusive.most_common(args.top):
            print(f"  {100 * count / total:5.1f}%  {frame}")


if __name__ == "__main__":
    main()
