"""The ``dcp-storage`` command (also ``python -m storage``).

Subcommands: ``demo``, ``ls ROOT``, ``inspect CKPT``, ``verify CKPT``, ``cp SRC DST``,
``rm CKPT`` and ``gc ROOT``; see ``docs/operations.md``. Tables for people by default,
``--json`` for programs; progress bars go to stderr when it is a terminal; errors are
one line on stderr with exit code 1 (``verify`` also exits 1 when an item is bad).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict

from extensions.errors import CheckpointNotFoundError, CheckpointStorageError, printable
from storage.cli._support import (
    TRANSFORM_SPECS,
    emit,
    human_age,
    human_size,
    keys_from_args,
    location,
    not_a_checkpoint_hint,
    parse_transforms,
    progress_bar,
    table,
)

# --- commands -----------------------------------------------------------------------


def _cmd_demo(args: argparse.Namespace) -> int:
    from storage.ops.demo import format_figures, run_demo

    figures = run_demo(os.path.abspath(args.dir), steps=args.steps)
    emit(args, figures, format_figures(figures))
    return 0


def _cmd_ls(args: argparse.Namespace) -> int:
    from storage.checkpoint.layout import directory_info, is_committed, parse_step
    from storage.ops.manager import CheckpointManager

    fs, root = location(args.root, args.storage_option)
    # A save killed before any object landed leaves nothing but its open upload.
    if not fs.exists(root) and not fs.pending_uploads(root):
        raise CheckpointNotFoundError(f"{fs.url(root)} does not exist")
    mgr = CheckpointManager(fs.url(root), filesystem=fs)
    infos = mgr.entries()
    if args.local:  # a tiered manager's local tier: which tiers hold each step
        from storage.ops.restore import merge_entries

        local_fs, local_root = location(args.local, args.local_storage_option)
        local = CheckpointManager(local_fs.url(local_root), filesystem=local_fs)
        infos = merge_entries(local.entries(), infos)
    try:
        others = [n for n in fs.ls(root) if parse_step(n) is None]
    except NotADirectoryError:
        others = []
    for name in others:  # checkpoints not named step-<N>: listed, never managed
        path = fs.concat_path(root, name)
        if is_committed(fs, path):
            infos.append(directory_info(fs, path, name))  # type: ignore[arg-type]
    if not infos and is_committed(fs, root):
        infos.append(directory_info(fs, root, "."))  # type: ignore[arg-type]
    state = {True: "committed", False: "uncommitted"}
    rows = [
        [i.name, state[i.committed], str(i.files), human_size(i.size), human_age(i.modified)]
        + ([",".join(i.tiers) or "-"] if args.local else [])
        for i in infos
    ]
    head = ["NAME", "STATE", "FILES", "SIZE", "AGE"] + (["TIERS"] if args.local else [])
    text = table(head, rows, right={2, 3, 4})
    latest = mgr.latest()
    if latest is not None:
        text += f"\nlatest: step-{latest}"
    data = {"root": mgr.url, "latest": latest, "checkpoints": [asdict(i) for i in infos]}
    emit(args, data, text)
    if not infos:
        print(
            f"dcp-storage: {mgr.url} holds no checkpoints (no step-<N> directories and no "
            ".metadata)",
            file=sys.stderr,
        )
        return 1
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from storage.ops.tools import describe

    fs, path = location(args.checkpoint, args.storage_option)
    try:
        summary = describe(fs, path)
    except CheckpointNotFoundError as exc:
        raise not_a_checkpoint_hint(fs, path, exc) from None

    def ratio(value: float | None) -> str:
        return f"{value:.2f}" if value is not None else "-"

    rows = [
        [
            r.item,
            "x".join(map(str, r.shape)) if r.shape is not None else "-",
            r.dtype or "object",
            human_size(r.logical),
            human_size(r.stored),
            ratio(r.ratio),
            " | ".join(r.transforms) or "-",
        ]
        for r in summary.items
    ]
    rows.append(
        [
            "TOTAL",
            f"{len(summary.items)} items",
            f"{summary.files} files",
            human_size(summary.logical),
            human_size(summary.stored),
            ratio(summary.ratio),
            "",
        ]
    )
    header = ["ITEM", "SHAPE", "DTYPE", "LOGICAL", "STORED", "RATIO", "TRANSFORMS"]
    if summary.referenced:  # incremental: which base holds each referenced item's bytes
        header.append("FROM")
        for row, r in zip(rows, summary.items):
            row.append(r.ref or "-")
        rows[-1].append(f"{human_size(summary.referenced)} in bases")
    items = [dict(asdict(r), ratio=r.ratio) for r in summary.items]
    total = {
        "items": len(items),
        "files": summary.files,
        "logical": summary.logical,
        "stored": summary.stored,
        "ratio": summary.ratio,
        "referenced": summary.referenced,
    }
    data = {"checkpoint": summary.url, "items": items, "total": total}
    emit(args, data, table(header, rows, right={3, 4, 5}))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from storage.ops.tools import describe, verify

    fs, path = location(args.checkpoint, args.storage_option)
    try:
        total = describe(fs, path).stored
    except CheckpointNotFoundError as exc:
        raise not_a_checkpoint_hint(fs, path, exc) from None
    started = time.perf_counter()
    with progress_bar(args, total, "verify") as progress:
        report = verify(
            fs,
            path,
            keys=keys_from_args(args),
            thread_count=args.threads,
            progress=progress,
            require_encryption=args.require_encryption,
        )
    elapsed = time.perf_counter() - started
    count = len(report.ok) + len(report.bad)
    if report.bad:
        lines = [f"BAD: {len(report.bad)} of {count} items failed in {report.url}:"]
        lines += [f"  {item}: {reason}" for item, reason in sorted(report.bad.items())]
    else:
        lines = [
            f"OK: {count} items verified in {report.url} "
            f"({human_size(report.bytes_read)} in {elapsed:.1f} s)"
        ]
    if report.unchecksummed:
        lines.append(
            f"note: {len(report.unchecksummed)} items carry no checksum (written by "
            "stock DCP); they were decoded but their bytes could not be checked"
        )
    data = dict(asdict(report), valid=not report.bad)
    emit(args, data, "\n".join(lines))
    return 1 if report.bad else 0


def _cmd_cp(args: argparse.Namespace) -> int:
    from storage.ops.copy import copy_checkpoint
    from storage.ops.tools import describe

    src_fs, src = location(args.src, args.storage_option)
    dst_fs, dst = location(args.dst, args.dst_storage_option or args.storage_option)
    keys = keys_from_args(args)
    chain = parse_transforms(args.transform, keys) if args.transform else None
    try:
        source = describe(src_fs, src)
    except CheckpointNotFoundError as exc:
        raise not_a_checkpoint_hint(src_fs, src, exc) from None
    started = time.perf_counter()
    with progress_bar(args, source.stored, "cp") as progress:
        result = copy_checkpoint(
            src_fs,
            src,
            dst_fs,
            dst,
            transforms=chain,
            overwrite=args.overwrite,
            keys=keys,
            progress=progress,
            require_encryption=args.require_encryption,
        )
    elapsed = time.perf_counter() - started
    chains = sorted({" | ".join(r.transforms) or "none" for r in result.items})
    text = (
        f"copied {source.url} -> {result.url}: {len(result.items)} items, "
        f"{human_size(source.stored)} -> {human_size(result.stored)} stored "
        f"(transforms: {', '.join(chains) or 'none'}) in {elapsed:.1f} s"
    )
    data = {
        "source": source.url,
        "destination": result.url,
        "items": len(result.items),
        "stored_before": source.stored,
        "stored": result.stored,
        "transforms": chains,
    }
    emit(args, data, text)
    return 0


def _cmd_rm(args: argparse.Namespace) -> int:
    from storage.checkpoint.committed import open_committed, refuse_if_referenced
    from storage.checkpoint.deletion import delete_checkpoint

    fs, path = location(args.checkpoint, args.storage_option)
    checkpoint = open_committed(fs, path)
    try:
        checkpoint.require()
    except CheckpointNotFoundError as exc:
        raise CheckpointNotFoundError(
            f"{exc}. Refusing to delete it; interrupted saves under a root are removed by "
            "`dcp-storage gc ROOT`"
        ) from None
    refuse_if_referenced(fs, path)
    kept = delete_checkpoint(fs, path, checkpoint)
    text = f"removed {fs.url(path)}"
    if kept:
        text += (
            f" (left {', '.join(kept)} in place: not files its metadata names; "
            "`dcp-storage gc` removes leftovers of saves after the grace period)"
        )
    emit(args, {"removed": fs.url(path), "kept": kept}, text)
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    from storage.ops.manager import CheckpointManager

    fs, root = location(args.root, args.storage_option)
    # A save killed before any object landed leaves nothing but its open upload.
    if not fs.exists(root) and not fs.pending_uploads(root):
        raise CheckpointNotFoundError(f"{fs.url(root)} does not exist")
    mgr = CheckpointManager(
        fs.url(root), keep_last=args.keep_last, keep_every=args.keep_every, filesystem=fs
    )
    pruned = mgr.apply_retention(dry_run=args.dry_run)
    cleaned = mgr.cleanup(grace_seconds=args.grace, dry_run=args.dry_run)
    abort = args.abort_uploads and not args.dry_run
    uploads = mgr.stale_uploads(args.grace, abort=abort)
    verb = "would remove" if args.dry_run else "removed"
    lines = [f"{verb} step-{s} (retention)" for s in pruned]
    lines += [f"{verb} step-{s} (interrupted save)" for s in cleaned]
    if abort:
        fate = "aborted"
    elif args.abort_uploads:
        fate = "would abort"
    else:
        fate = "left open (--abort-uploads aborts it)"
    for upload in uploads:
        age = time.time() - (upload.started or 0.0)
        lines.append(
            f"incomplete multipart upload of {fs.url(upload.path)}, begun {age:.0f} s ago: {fate}"
        )
    linked = mgr.linked_steps()
    lines += [f"kept step-{s}: a symbolic link, never deleted through" for s in linked]
    policy = mgr.retained(mgr.steps())
    bases = {b: users for b, users in mgr.referenced_by().items() if b not in policy}
    lines += [
        f"kept step-{b}: referenced by {', '.join(f'step-{u}' for u in users)}"
        for b, users in sorted(bases.items())
    ]
    text = "\n".join(lines) or f"nothing to do under {mgr.url}"
    text += (
        f"\nkept: {', '.join(f'step-{s}' for s in mgr.steps()) or 'none'}"
        if not args.dry_run
        else ""
    )
    emit(
        args,
        {
            "root": mgr.url,
            "dry_run": args.dry_run,
            "retention": pruned,
            "interrupted": cleaned,
            "linked": linked,
            "referenced": {str(b): users for b, users in sorted(bases.items())},
            "uploads": [
                {"url": fs.url(u.path), "started": u.started, "aborted": abort} for u in uploads
            ],
            "steps": mgr.steps(),
        },
        text,
    )
    return 0


# --- parser -------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
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

    parser = argparse.ArgumentParser(
        prog="dcp-storage", description="Inspect, verify, copy and prune PyTorch DCP checkpoints."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, parents=[common])

    demo = add("demo", "save and load a small model with zstd, print figures")
    demo.add_argument(
        "--dir",
        default="demo-checkpoint",
        help="where the checkpoint is saved and kept, to look at with `inspect` and `verify` "
        "(default: ./demo-checkpoint)",
    )
    demo.add_argument("--steps", type=int, default=3, help="training steps before saving")
    demo.set_defaults(func=_cmd_demo)

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
    ls.set_defaults(func=_cmd_ls)

    inspect = add("inspect", "show a checkpoint's items, sizes and transforms")
    inspect.add_argument("checkpoint", metavar="CKPT")
    inspect.set_defaults(func=_cmd_inspect)

    verify = add("verify", "read every item: checksums, decoding, authentication (exit 1 if bad)")
    verify.add_argument("checkpoint", metavar="CKPT")
    verify.add_argument("--threads", type=int, default=None, help="items read in parallel")
    _add_require_encryption(verify, "when keys are given")
    verify.set_defaults(func=_cmd_verify)

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
    cp.set_defaults(func=_cmd_cp)

    rm = add("rm", "delete a committed checkpoint (metadata first)")
    rm.add_argument("checkpoint", metavar="CKPT")
    rm.set_defaults(func=_cmd_rm)

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
    gc.set_defaults(func=_cmd_gc)
    return parser


def _add_require_encryption(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--require-encryption",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="refuse items that are not AES-256-GCM encrypted (default: on "
        f"{default}); --no-require-encryption accepts plain items",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
