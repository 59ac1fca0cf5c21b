"""Restart protocol: every save and every load in a fresh process, stock DCP vs ours.

    python benchmarks/restart.py                     # 512 MB, none and zstd, 3 repeats
    python benchmarks/restart.py --size-mb 256 --repeat 5 --cases none

What a restarted job pays: each timed call runs in a new Python process (imports, thread
pools, first-touch allocations included in the process but not in the timed call's
setup: the state dict is built, and for loads an initialised target is allocated and
touched, before the clock starts). Before every timed call the parent runs an untimed
``sync``. Per case:

- ``save``: into a new step directory;
- ``load``: the checkpoint that side just saved, into zero-initialised tensors;
- ``save-over``: over the checkpoint that side saved before (what a job that reuses one
  path does);
- ``limit``: the physical ceiling beside them - plain ``write`` + ``fsync`` of the same
  bytes into new files, and plain ``readinto`` of ours' data files into pre-touched
  buffers, with the same number of threads our writer/reader use; for ``save-over``
  the same new-file write (a save that keeps the committed checkpoint until its own
  commit must write new files) and, as ``in-place limit``, those files rewritten in
  place through ``O_TRUNC`` (what stock does when it saves over a path); for a zstd
  ``load``, the decoding floor: every item of ours' zstd checkpoint decoded from memory
  (no read, no checksum) on one thread, that time divided by the cores - what a load
  costs when every core decodes all the time.

A warm-up round first (the limits skip it: they write new files or read cached ones),
then the sides alternate (stock, ours, ...) ``--repeat`` times;
the table shows medians and ratios stock/ours (> 1: we are faster). Nothing is deleted
until a case is over: on a disk mounted with ``discard`` the deletions would slow the
next timed writes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MB = 1e6
# The limit rows use as many threads as LocalFileSystem.io_concurrency gives ours.
THREADS = max(2, min(8, os.cpu_count() or 2))


# --- child: one timed call ---------------------------------------------------------------


def _child(op: str, side: str, case: str, path: str, size_mb: float, threads: int) -> None:
    import torch.distributed.checkpoint as dcp
    from bench import build_state_dict, logical_bytes

    # Each child builds only what its call uses (a fresh process's set-up is most of a
    # run's time): values to save, a zeroed target to load into (an initialised model:
    # allocated and touched), nothing for the ceilings that read ours' files.
    state: dict[str, Any] = {}
    if op.startswith("load"):
        state = build_state_dict(size_mb, zeros=True)
    elif op not in ("limit-read", "limit-decode"):
        state = build_state_dict(size_mb)
    nbytes = logical_bytes(state)
    # The ceiling's buffers, like the loads' targets, exist and are touched untimed.
    limit_buffers = _touched_buffers(path) if op == "limit-read" else []
    decode = _decode_one_thread(path) if op == "limit-decode" else None
    cpu0, t0 = os.times(), time.perf_counter()
    if decode is not None:
        decode()
    elif op == "limit-write":
        _limit_write(state, path, threads)
    elif op == "limit-overwrite":
        _limit_write(state, path, threads, in_place=True)
    elif op == "limit-read":
        _limit_read(limit_buffers, threads)
    elif side == "stock":
        if op.startswith("save"):
            from torch.distributed.checkpoint._extension import ZStandard as TorchZStandard

            extra = {"_extensions": [TorchZStandard()]} if case == "zstd" else {}
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path, **extra), no_dist=True)
        else:
            dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    else:
        import storage
        from extensions import ZStandard

        if op.startswith("save"):
            storage.save(state, path, transforms=[ZStandard()] if case == "zstd" else [])
        else:
            storage.load(state, path)
    wall = time.perf_counter() - t0
    if decode is not None:
        wall /= threads  # the floor: every core decoding all the time
    cpu1 = os.times()
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    print(json.dumps({"s": wall, "cpu": cpu, "bytes": nbytes}))


def _limit_write(
    state: dict[str, Any], directory: str, threads: int, *, in_place: bool = False
) -> None:
    """New files (what any save that keeps the committed checkpoint must write), or,
    ``in_place``, the same files rewritten through ``O_TRUNC`` as stock DCP does when
    it saves over a path: the disk may serve the second much faster."""
    import torch

    os.makedirs(directory, exist_ok=True)
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    groups = [tensors[i::threads] for i in range(threads)]

    def write(n: int, group: list[Any]) -> None:
        name = os.path.join(directory, f"raw{n}")
        if not in_place and os.path.exists(name):
            raise FileExistsError(name)
        with open(name, "wb", buffering=0) as f:
            for t in group:
                data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                # 256 KiB writes: on this VM one 16 MiB write into the page cache is
                # ~10x slower per byte than 256 KiB ones (measured), so a ceiling
                # written in big pieces would not be a ceiling.
                for i in range(0, len(data), 256 << 10):
                    f.write(data[i : i + (256 << 10)])
            f.flush()
            os.fsync(f.fileno())

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(write, range(threads), groups))
    fd = os.open(directory, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def _decode_one_thread(directory: str) -> Any:
    """A call that decodes every item of the zstd checkpoint in ``directory`` from
    memory into a reused, touched buffer on one thread (the files are read first)."""
    from extensions.zstd import frame_reader
    from storage.checkpoint import storage_format as fmt

    with open(os.path.join(directory, ".metadata"), "rb") as f:
        meta = fmt.load_metadata(f.read(), directory)
    files: dict[str, bytes] = {}
    for info in meta.storage_data.values():
        if info.relative_path not in files:
            with open(os.path.join(directory, info.relative_path), "rb") as f:
                files[info.relative_path] = f.read()
    out = memoryview(bytearray(64 << 20))
    out[::4096] = b"\1" * len(out[::4096])

    def run() -> None:
        for info in meta.storage_data.values():
            source = memoryview(files[info.relative_path])[info.offset : info.offset + info.length]
            reader = frame_reader(source, across_frames=True)
            while reader.readinto(out):
                pass

    return run


def _touched_buffers(directory: str) -> list[tuple[str, bytearray]]:
    """One buffer per data file of ``directory``, allocated and touched."""
    files = [os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".distcp")]
    buffers = [bytearray(os.path.getsize(f)) for f in files]
    for b in buffers:
        b[::4096] = b"\1" * len(b[::4096])
    return list(zip(files, buffers))


def _limit_read(buffers: list[tuple[str, bytearray]], threads: int) -> None:
    def read(args: tuple[str, bytearray]) -> None:
        path, buffer = args
        view, got = memoryview(buffer), 0
        with open(path, "rb", buffering=0) as f:
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, buffers))


# --- parent ------------------------------------------------------------------------------


def _run(op: str, side: str, case: str, path: str, size_mb: float, threads: int) -> dict:
    subprocess.run(["sync"], check=True)
    args = [sys.executable, __file__, "--child", op, side, case, path, str(size_mb), str(threads)]
    out = subprocess.run(args, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_case(case: str, work: str, size_mb: float, repeat: int, threads: int) -> list[dict]:
    """One case (``none`` or ``zstd``) by the protocol above, in ``work`` (emptied at the
    end): a row per op (``save``, ``load``, ``save-over``) with the medians of both sides,
    their ratio and the limits; benchmarks/check.py reads these rows too."""
    times: dict[tuple[str, str], list[dict]] = {}
    for round_ in range(repeat + 1):  # round 0 is the warm-up
        for side in ("stock", "ours"):
            base = os.path.join(work, f"{case}-{side}")
            new = f"{base}-{round_}"
            results = {
                "save": _run("save", side, case, new, size_mb, threads),
                "load": _run("load", side, case, new, size_mb, threads),
                "save-over": _run("save-over", side, case, new, size_mb, threads),
            }
            if round_:
                for op, r in results.items():
                    times.setdefault((side, op), []).append(r)
        if not round_:
            continue  # the ceilings need no warm-up: each writes new files or reads cached ones
        limit_dir = os.path.join(work, f"{case}-limit-{round_}")
        # What ours just saved over (its data files only: the replaced ones are gone).
        ours_dir = os.path.join(work, f"{case}-ours-{round_}")
        lw = _run("limit-write", "-", case, limit_dir, size_mb, threads)
        # The floor of a zstd load is decoding, not reading.
        limit = "limit-decode" if case == "zstd" else "limit-read"
        lr = _run(limit, "-", case, ours_dir, size_mb, threads)
        lo = _run("limit-overwrite", "-", case, limit_dir, size_mb, threads)
        times.setdefault(("limit", "save"), []).append(lw)
        times.setdefault(("limit", "load"), []).append(lr)
        times.setdefault(("limit", "save-over"), []).append(lw)
        times.setdefault(("limit-in-place", "save-over"), []).append(lo)
    # Deleting inside the rounds would put the disk's discards (this VM mounts with
    # ``discard``) under the next timed writes: everything goes at the end of the case.
    for name in os.listdir(work):
        shutil.rmtree(os.path.join(work, name), ignore_errors=True)
    rows = []
    for op in ("save", "load", "save-over"):
        stock = statistics.median(r["s"] for r in times[("stock", op)])
        ours = statistics.median(r["s"] for r in times[("ours", op)])
        nbytes = times[("ours", op)][0]["bytes"]
        limit = times.get(("limit", op))
        in_place = times.get(("limit-in-place", op))
        rows.append(
            {
                "case": case,
                "op": op,
                "stock_s": stock,
                "ours_s": ours,
                "ratio": stock / ours,
                "ours_MBps": nbytes / MB / ours,
                "ours_cpu_s_per_GB": statistics.median(r["cpu"] for r in times[("ours", op)])
                / (nbytes / 1e9),
                "limit_s": statistics.median(r["s"] for r in limit) if limit else None,
                "in_place_s": statistics.median(r["s"] for r in in_place) if in_place else None,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cases", default="none,zstd")
    parser.add_argument("--threads", type=int, default=THREADS)
    parser.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        op, side, case, path, size, threads = args.child
        _child(op, side, case, path, float(size), int(threads))
        return
    work = tempfile.mkdtemp(prefix="dcp-restart-", dir=args.dir)
    try:
        rows = []
        for case in args.cases.split(","):
            rows += run_case(case, work, args.size_mb, args.repeat, args.threads)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        "| case | op | stock s | ours s | stock/ours | ours MB/s | ours CPU s/GB | limit s "
        "| in-place limit s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        limit, in_place = (
            "-" if r[k] is None else f"{r[k]:.2f}" for k in ("limit_s", "in_place_s")
        )
        print(
            f"| {r['case']} | {r['op']} | {r['stock_s']:.2f} | {r['ours_s']:.2f} | "
            f"{r['ratio']:.2f}x | {r['ours_MBps']:.0f} | {r['ours_cpu_s_per_GB']:.2f} | {limit} "
            f"| {in_place} |"
        )


if __name__ == "__main__":
    main()
