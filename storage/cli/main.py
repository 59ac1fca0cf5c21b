"""The ``dcp-storage`` command (also ``python -m storage``).

Subcommands: ``demo``, ``ls ROOT``, ``inspect CKPT``, ``verify CKPT``, ``cp SRC DST``,
``export SRC DEST --format safetensors``,
``rm CKPT`` and ``gc ROOT``; see ``docs/operations.md``. Tables for people by default,
``--json`` for programs; progress bars go to stderr when it is a terminal; errors are
one line on stderr with exit code 1 (``verify`` also exits 1 when an item is bad).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from extensions.errors import CheckpointStorageError, printable
from storage.cli import commands
from storage.cli._support import DTYPE_NAMES, TRANSFORM_SPECS

Add = Callable[[str, str], argparse.ArgumentParser]  # a subcommand: (name, help) -> parser


def build_parser() -> argparse.ArgumentParser:
    common = _common_options()
    parser = argparse.ArgumentParser(
        prog="dcp-storage", description="Inspect, verify, copy and prune PyTorch DCP checkpoints."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, parents=[common])

    for add_commands in (_add_demo_ls, _add_inspect_verify, _add_cp, _add_export, _add_rm_gc):
        add_commands(add)
    return parser


def _common_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print JSON instead of a table")
    common.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    common.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="client option for remote URLs (repeatable), e.g. endpoint_url=...",
    )
    common.add_argument(
        "--key-file",
        metavar="PATH",
        help="JSON file {key_id: key}; keys also come from DCP_STORAGE_KEYS",
    )
    return common


def _add_demo_ls(add: Add) -> None:
    demo = add("demo", "save and load a small model with zstd, print figures")
    demo.add_argument(
        "--dir",
        default="demo-checkpoint",
        help="where the checkpoint is saved and kept, to look at with `inspect` and `verify` "
        "(default: ./demo-checkpoint)",
    )
    demo.add_argument("--steps", type=int, default=3, help="training steps before saving")
    demo.set_defaults(func=commands.demo)

    ls = add("ls", "list the step-<N> checkpoints under ROOT, committed or not")
    ls.add_argument("root", metavar="ROOT")
    ls.add_argument(
        "--local",
        metavar="PATH_OR_URL",
        help="a tiered manager's local tier: also list its steps and which tiers hold each",
    )
    ls.add_argument(
        "--local-storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="client option for the local tier (repeatable)",
    )
    ls.set_defaults(func=commands.ls)


def _add_inspect_verify(add: Add) -> None:
    inspect = add("inspect", "show a checkpoint's items, sizes and transforms")
    inspect.add_argument("checkpoint", metavar="CKPT")
    inspect.set_defaults(func=commands.inspect)

    verify = add("verify", "read every item: checksums, decoding, authentication (exit 1 if bad)")
    verify.add_argument("checkpoint", metavar="CKPT")
    verify.add_argument("--threads", type=int, default=None, help="items read in parallel")
    _add_require_encryption(verify, "when keys are given")
    verify.set_defaults(func=commands.verify)


def _add_cp(add: Add) -> None:
    cp = add("cp", "copy a checkpoint between any two locations, optionally transcoding")
    cp.add_argument("src", metavar="SRC")
    cp.add_argument("dst", metavar="DST")
    cp.add_argument(
        "--transform",
        action="append",
        metavar="SPEC",
        help=f"re-encode with this chain, in order (repeatable): {TRANSFORM_SPECS}; "
        "default: keep the stored bytes",
    )
    cp.add_argument(
        "--overwrite", action="store_true", help="replace a committed checkpoint at DST"
    )
    cp.add_argument(
        "--dst-storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="client options for DST when they differ from SRC's",
    )
    _add_require_encryption(cp, "when --transform re-encodes a source holding encrypted items")
    cp.set_defaults(func=commands.cp)


def _add_export(add: Add) -> None:
    export = add(
        "export", "write a committed checkpoint's tensors as a Hugging Face safetensors model"
    )
    export.add_argument("src", metavar="SRC")
    export.add_argument("dst", metavar="DEST", help="a directory or bucket prefix")
    export.add_argument("--format", choices=["safetensors"], required=True)
    export.add_argument(
        "--dtype",
        choices=sorted(DTYPE_NAMES),
        default=None,
        help="convert floating-point tensors (integer ones keep theirs); default: as stored",
    )
    export.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="largest file, e.g. 5GB, 500MB, 2GiB or bytes (default: 5GB)",
    )
    export.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="PREFIX",
        help="export only the items whose names start with PREFIX (repeatable), e.g. model.",
    )
    export.add_argument(
        "--strip",
        default="",
        metavar="PREFIX",
        help="remove PREFIX, as given, from the tensor names that start with it, e.g. model.",
    )
    export.add_argument(
        "--overwrite", action="store_true", help="replace a safetensors model at DEST"
    )
    export.add_argument(
        "--dst-storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="client options for DEST when they differ from SRC's",
    )
    _add_require_encryption(export, "when keys are given")
    export.set_defaults(func=commands.export)


def _add_rm_gc(add: Add) -> None:
    rm = add("rm", "delete a committed checkpoint (metadata first)")
    rm.add_argument("checkpoint", metavar="CKPT")
    rm.set_defaults(func=commands.rm)

    gc = add("gc", "apply retention under ROOT and remove stale interrupted saves")
    gc.add_argument("root", metavar="ROOT")
    gc.add_argument("--keep-last", type=int, required=True, metavar="N")
    gc.add_argument(
        "--keep-every",
        type=int,
        default=None,
        metavar="K",
        help="also keep every step divisible by K",
    )
    gc.add_argument(
        "--grace",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="remove interrupted saves older than this (default: 3600)",
    )
    gc.add_argument("--dry-run", action="store_true", help="say what would be removed")
    gc.add_argument(
        "--abort-uploads",
        action="store_true",
        help="abort the multipart uploads that interrupted saves left open under ROOT "
        "(older than --grace; listed either way)",
    )
    gc.set_defaults(func=commands.gc)


def _add_require_encryption(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--require-encryption",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="refuse items that are not AES-256-GCM encrypted (default: on "
        f"{default}); --no-require-encryption accepts plain items",
    )


class _EscapedStderr(logging.Handler):
    """logging's last resort (warnings to stderr when nothing configured logging, as in
    this command), with each record escaped whole: a warning may quote names the store
    chose, and one holding a line break or an escape sequence must not reach the
    terminal as one."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(printable(self.format(record)) + "\n")
        except Exception:
            self.handleError(record)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    last_resort, logging.lastResort = logging.lastResort, _EscapedStderr(logging.WARNING)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("dcp-storage: interrupted", file=sys.stderr)
        return 130
    except (CheckpointStorageError, OSError, ValueError, TypeError, KeyError, ImportError) as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        if isinstance(exc, OSError) and not isinstance(exc, CheckpointStorageError):
            message = (
                f"{exc.strerror or type(exc).__name__}: {exc.filename or message}"
                if exc.filename
                else message
            )
        print(f"dcp-storage: error: {printable(message, 2000)}", file=sys.stderr)
        return 1
    finally:
        logging.lastResort = last_resort


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
