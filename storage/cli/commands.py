"""The ``dcp-storage`` subcommands: each parses nothing and adds no behaviour of its own;
it calls ``storage.ops`` or ``storage.checkpoint`` and prints a table or JSON
(``storage.cli.main`` builds the parser and turns errors into one line)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict

from extensions.errors import CheckpointNotFoundError, CheckpointStorageError
from storage.backends.base import FileSystemBase
from storage.cli._support import (
    DTYPE_NAMES,
    bad_lines,
    emit,
    human_age,
    human_size,
    keys_from_args,
    location,
    not_a_checkpoint_hint,
    parse_size,
    parse_transforms,
    progress_bar,
    progress_line,
    table,
    upload_lines,
)


def demo(args: argparse.Namespace) -> int:
    from storage.ops.demo import format_figures, run_demo

    figures = run_demo(os.path.abspath(args.dir), steps=args.steps)
    emit(args, figures, format_figures(figures).split("\n"))
    return 0


def ls(args: argparse.Namespace) -> int:
    from storage.checkpoint.layout import directory_info, is_committed, parse_step
    from storage.ops.manager import CheckpointManager

    fs, root = location(args.root, args.storage_option)
    # A save killed before any object landed leaves nothing but its open upload.
    if not fs.exists(root) and not fs.pending_uploads(root):
        raise CheckpointNotFoundError(f"{fs.url(root)} does not exist")
    # persist="thread" here and below: the CLI never saves, so it starts no persist worker
    mgr = CheckpointManager(fs.url(root), filesystem=fs, persist="thread")
    infos = mgr.entries()
    if args.local:  # a tiered manager's local tier: which tiers hold each step
        from storage.ops.restore import merge_entries

        local_fs, local_root = location(args.local, args.local_storage_option)
        local = CheckpointManager(local_fs.url(local_root), filesystem=local_fs, persist="thread")
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
    lines = table(head, rows, right={2, 3, 4})
    latest = mgr.latest()
    if latest is not None:
        lines.append(f"latest: step-{latest}")
    data = {"root": mgr.url, "latest": latest, "checkpoints": [asdict(i) for i in infos]}
    emit(args, data, lines)
    if not infos:
        print(
            f"dcp-storage: {mgr.url} holds no checkpoints (no step-<N> directories and no "
            ".metadata)",
            file=sys.stderr,
        )
        return 1
    return 0


def inspect(args: argparse.Namespace) -> int:
    from storage.ops.describe import describe

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


def verify(args: argparse.Namespace) -> int:
    from storage.checkpoint.safetensors.verify import is_model
    from storage.ops.describe import describe
    from storage.ops.verify import verify

    fs, path = location(args.checkpoint, args.storage_option)
    try:
        total = describe(fs, path).stored
    except CheckpointNotFoundError as exc:
        if is_model(fs, path):
            return _verify_model(args, fs, path)
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
        lines += bad_lines(report.bad)
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
    emit(args, data, lines)
    return 1 if report.bad else 0


def _verify_model(args: argparse.Namespace, fs: FileSystemBase, path: str) -> int:
    """``verify`` of a Hub-layout safetensors model instead of a DCP checkpoint."""
    from storage.checkpoint.safetensors.verify import verify_model

    started = time.perf_counter()
    with progress_line(args, "verify") as progress:
        done = [0]

        def read(n: int) -> None:
            done[0] += n
            progress(done[0], 0)

        report = verify_model(fs, path, threads=args.threads or 4, progress=read)
    elapsed = time.perf_counter() - started
    count = len(report.ok) + len(report.bad) + len(report.unchecksummed)
    if report.bad:
        lines = [f"BAD: {len(report.bad)} of {count} tensors failed in {report.url}:"]
        lines += bad_lines(report.bad)
    else:
        lines = [
            f"OK: safetensors model {report.url}: {len(report.files)} files, {count} tensors "
            f"({human_size(report.bytes_read)} checked in {elapsed:.1f} s)"
        ]
    if report.unchecksummed:
        lines.append(
            f"note: no checksums recorded for {len(report.unchecksummed)} tensors (not written "
            "by dcp-storage); their headers and the index were checked, not their bytes"
        )
    lines += [
        f"note: {url} is the staging area of a safetensors save in flight or killed; "
        "`dcp-storage gc` removes it once older than --grace"
        for url in report.staging
    ]
    emit(args, dict(asdict(report), format="safetensors", valid=not report.bad), lines)
    return 1 if report.bad else 0


def cp(args: argparse.Namespace) -> int:
    from storage.ops.copy import copy_checkpoint
    from storage.ops.describe import describe

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
    emit(args, data, [text])
    return 0


def export(args: argparse.Namespace) -> int:
    import torch

    from storage.ops.export import export_safetensors

    src_fs, src = location(args.src, args.storage_option)
    dst_fs, dst = location(args.dst, args.dst_storage_option or args.storage_option)
    started = time.perf_counter()
    with progress_line(args, "export") as progress:
        try:
            result = export_safetensors(
                src_fs,
                src,
                dst_fs,
                dst,
                dtype=getattr(torch, DTYPE_NAMES[args.dtype]) if args.dtype else None,
                max_shard_size=parse_size(args.max_shard_size, "--max-shard-size"),
                only=args.only,
                strip=args.strip,
                overwrite=args.overwrite,
                keys=keys_from_args(args),
                require_encryption=args.require_encryption,
                progress=progress,
            )
        except CheckpointNotFoundError as exc:
            raise not_a_checkpoint_hint(src_fs, src, exc) from None
    elapsed = time.perf_counter() - started
    lines = [
        f"exported {result.source} -> {result.destination}: {result.tensors} tensors, "
        f"{human_size(result.size)} in {len(result.files)} files ({', '.join(result.files)}) "
        f"in {elapsed:.1f} s"
    ]
    if result.skipped:
        lines.append(f"skipped {len(result.skipped)} items that are not tensors")
    emit(args, asdict(result), lines)
    return 0


def rm(args: argparse.Namespace) -> int:
    from storage.checkpoint.committed import open_committed
    from storage.checkpoint.deletion import delete_checkpoint
    from storage.checkpoint.siblings import refuse_if_referenced

    fs, path = location(args.checkpoint, args.storage_option)
    checkpoint = open_committed(fs, path)
    try:
        checkpoint.require()
    except CheckpointNotFoundError as exc:
        raise CheckpointNotFoundError(
            f"{exc}. Refusing to delete it; interrupted saves under a root are removed by "
            "`dcp-storage gc ROOT`"
        ) from None
    except CheckpointStorageError as exc:  # metadata refused: which files are its own?
        raise type(exc)(
            f"{str(exc).rstrip('.')}. Refusing to delete {fs.url(path)}: which files are "
            "its own cannot be told while its metadata cannot be read; nothing was deleted"
        ) from None
    refuse_if_referenced(fs, path)
    # Again once its metadata is moved aside: an incremental save in another process
    # may have chosen it as its base meanwhile (deletion.delete_checkpoint).
    kept = delete_checkpoint(fs, path, checkpoint, recheck=lambda: refuse_if_referenced(fs, path))
    text = f"removed {fs.url(path)}"
    if kept:
        text += (
            f" (left {', '.join(kept)} in place: not files its metadata names; "
            "`dcp-storage gc` removes leftovers of saves after the grace period)"
        )
    emit(args, {"removed": fs.url(path), "kept": kept}, [text])
    return 0


def gc(args: argparse.Namespace) -> int:
    from storage.ops.manager import CheckpointManager

    fs, root = location(args.root, args.storage_option)
    # A save killed before any object landed leaves nothing but its open upload.
    if not fs.exists(root) and not fs.pending_uploads(root):
        raise CheckpointNotFoundError(f"{fs.url(root)} does not exist")
    keep = {"keep_last": args.keep_last, "keep_every": args.keep_every}
    mgr = CheckpointManager(fs.url(root), **keep, filesystem=fs, persist="thread")
    pruned = mgr.apply_retention(dry_run=args.dry_run)
    orphans = mgr.orphans(grace_seconds=args.grace, dry_run=args.dry_run)
    cleaned = mgr.cleanup(grace_seconds=args.grace, dry_run=args.dry_run)
    staging = mgr.stale_staging(grace_seconds=args.grace, dry_run=args.dry_run)
    abort = args.abort_uploads and not args.dry_run
    uploads = mgr.stale_uploads(args.grace, abort=abort)
    verb = "would remove" if args.dry_run else "removed"
    lines = [f"{verb} step-{s} (retention)" for s in pruned]
    lines += [f"{verb} step-{s} (interrupted save)" for s in cleaned]
    lines += [f"{verb} {url} (a data file no metadata names)" for url in orphans]
    lines += [f"{verb} {url} (staging area of an interrupted safetensors save)" for url in staging]
    lines += upload_lines(fs, uploads, abort, args.abort_uploads)
    linked = mgr.linked_steps()
    lines += [f"kept step-{s}: a symbolic link, never deleted through" for s in linked]
    policy = mgr.retained(mgr.steps())
    bases = {b: users for b, users in mgr.referenced_by().items() if b not in policy}
    lines += [
        f"kept step-{b}: referenced by {', '.join(f'step-{u}' for u in users)}"
        for b, users in sorted(bases.items())
    ]
    lines = lines or [f"nothing to do under {mgr.url}"]
    if not args.dry_run:
        lines.append(f"kept: {', '.join(f'step-{s}' for s in mgr.steps()) or 'none'}")
    emit(
        args,
        {
            "root": mgr.url,
            "dry_run": args.dry_run,
            "retention": pruned,
            "interrupted": cleaned,
            "orphans": orphans,
            "staging": staging,
            "linked": linked,
            "referenced": {str(b): users for b, users in sorted(bases.items())},
            "uploads": [
                {"url": fs.url(u.path), "started": u.started, "aborted": abort} for u in uploads
            ],
            "steps": mgr.steps(),
        },
        lines,
    )
    return 0
