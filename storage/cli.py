"""The ``dcp-storage`` command (also ``python -m storage``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from extensions.errors import CheckpointStorageError


def _cmd_demo(args: argparse.Namespace) -> int:
    from storage.demo import format_figures, run_demo

    figures = run_demo(args.dir, steps=args.steps)
    print(format_figures(figures))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dcp-storage", description="Inspect, verify and copy PyTorch DCP checkpoints."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="save and load a small model with zstd, print figures")
    demo.add_argument("--dir", help="keep the checkpoint in this directory (default: a temp dir)")
    demo.add_argument("--steps", type=int, default=3, help="training steps before saving")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (CheckpointStorageError, OSError, ValueError, TypeError) as exc:
        print(f"dcp-storage: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
