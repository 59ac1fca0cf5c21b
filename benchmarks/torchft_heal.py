"""torchft healing: a live replica sends its state to one that (re)joins, per transport.

    python benchmarks/torchft_heal.py --size-mb 512

Transports side by side, each in two fresh processes (``spawn``-like: new interpreters):
torchft's ``HTTPTransport`` (the sender serves over HTTP on 127.0.0.1, no chunking, as the
``Manager``'s default), torchft's ``PGTransport`` (a gloo process group of 2 on 127.0.0.1)
and ours, :class:`storage.integrations.torchft.StorageCheckpointTransport`, with a local
root (a temp directory), a SeaweedFS root on loopback and the same SeaweedFS behind
:class:`tests.support.capped_proxy.CappedProxy` (``--rate``, 100 MB/s for both directions
together).

Protocol, per transport: the sender builds the state (``bench.build_state_dict``: bf16 and
fp32 tensors like a model and its Adam state), times ``--idle-steps`` of a fixed CPU
"training step" (matmuls on one thread), then, once the receiver is ready, calls
``send_checkpoint(dst_ranks=[1], step, state, timeout)`` as torchft's ``Manager`` does and
keeps stepping until the receiver has healed. The receiver ("the healing replica") times
``recv_checkpoint`` from the call to having the state dict, then checks every tensor
against the sender's per-tensor sums. Reported: heal time (receiver), the time the sender
was blocked in ``send_checkpoint``, its step time idle and while serving, the steps the
healthy group lost in the window (send start to heal end, in idle steps), the bytes moved
(HTTP: bytes served; PG: tensor bytes; ours: bytes written and read, read through the
proxy where there is one) and the physical limit beside it (a memcpy of the state; for
the capped bucket, written + read bytes at the cap).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from datetime import timedelta
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench import build_state_dict  # noqa: E402
from benchmarks.s3_peers import raw_ceiling  # noqa: E402
from tests.support.capped_proxy import CappedProxy  # noqa: E402
from tests.support.servers import SeaweedFS, boto3_client, s3_options  # noqa: E402

BUCKET = "bench"
MB = 1e6
STEP = 7
TIMEOUT = timedelta(seconds=600)
CASES = ["http", "pg", "ours-local", "ours-seaweedfs", "ours-capped"]


# --- the two processes ----------------------------------------------------------------


def _wait_for(path: str, deadline: float, what: str) -> None:
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited too long for {what} ({path})")
        time.sleep(0.001)


def _write_json(path: str, value: dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


def _sums(state: dict[str, Any]) -> dict[str, int]:
    """A CRC of every tensor's bytes: the receiver checks it got the state bit for bit."""
    return {
        k: zlib.crc32(v.contiguous().view(-1).view(torch.uint8).numpy().data)
        for k, v in state.items()
        if isinstance(v, torch.Tensor)
    }


def _make_transport(args: argparse.Namespace, rank: int) -> Any:
    if args.case == "http":
        from torchft.checkpointing.http_transport import HTTPTransport

        return HTTPTransport(timeout=TIMEOUT, num_chunks=0)
    if args.case == "pg":
        import torch.distributed as dist
        from torchft.checkpointing.pg_transport import PGTransport

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=2
        )
        pg = dist.distributed_c10d._get_default_group()
        return PGTransport(pg=pg, timeout=TIMEOUT, device=torch.device("cpu"))
    from storage.integrations.torchft import StorageCheckpointTransport

    opts = s3_options(args.endpoint) if args.endpoint else None
    replica = "sender" if rank == 0 else "healer"
    return StorageCheckpointTransport(args.root, replica_id=replica, storage_options=opts)


def _training_step(a: torch.Tensor) -> None:
    b = a
    for _ in range(6):
        b = torch.mm(b, a)
        b = b / b.norm()


def sender(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    state = build_state_dict(args.size_mb)
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    copies = [torch.ones_like(t) for t in tensors]  # allocated and touched: a plain copy
    memcpy = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for dst, src in zip(copies, tensors, strict=True):
            dst.copy_(src)
        memcpy = min(memcpy, time.perf_counter() - t0)
    del copies
    transport = _make_transport(args, 0)
    a = torch.randn(512, 512)
    idle = []
    for _ in range(args.idle_steps):
        t0 = time.perf_counter()
        _training_step(a)
        idle.append(time.perf_counter() - t0)
    metadata = transport.metadata()
    if args.case == "http":
        metadata = metadata.replace(socket.gethostname(), "127.0.0.1")
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    _wait_for(os.path.join(args.work, "receiver-ready"), deadline, "the receiver")
    _write_json(
        os.path.join(args.work, "go.json"),
        {"metadata": metadata, "sums": _sums(state), "logical": sum(t.nbytes for t in tensors)},
    )
    start = time.perf_counter()
    transport.send_checkpoint(dst_ranks=[1], step=STEP, state_dict=state, timeout=TIMEOUT)
    blocked = time.perf_counter() - start
    sent_at = time.time()
    done = os.path.join(args.work, "healed.json")
    serving = []
    while not os.path.exists(done):
        if time.monotonic() > deadline:
            raise TimeoutError("the receiver did not heal in time")
        t0 = time.perf_counter()
        _training_step(a)
        serving.append(time.perf_counter() - t0)
    window = time.perf_counter() - start
    transport.disallow_checkpoint()
    transport.shutdown(wait=args.case != "http")
    result = {"memcpy": memcpy, "idle": idle, "serving": serving, "blocked": blocked}
    result["window"], result["sent_at"] = window, sent_at
    _write_json(os.path.join(args.work, "sender.json"), result)
    if args.case == "pg":
        import torch.distributed as dist

        dist.destroy_process_group()


class _Counted:
    """A response that counts the bytes read from it (HTTP: the bytes served)."""

    total = 0

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def read(self, n: int = -1) -> bytes:
        data: bytes = self._inner.read(n)
        _Counted.total += len(data)
        return data

    def readinto(self, buf: Any) -> int:
        n: int = self._inner.readinto(buf)
        _Counted.total += n
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __enter__(self) -> _Counted:
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.close()


def receiver(args: argparse.Namespace) -> None:
    import urllib.request

    opener = urllib.request.urlopen
    urllib.request.urlopen = lambda *a, **k: _Counted(opener(*a, **k))  # type: ignore[assignment]
    transport = _make_transport(args, 1)
    open(os.path.join(args.work, "receiver-ready"), "w").close()
    go = os.path.join(args.work, "go.json")
    _wait_for(go, time.monotonic() + TIMEOUT.total_seconds(), "the sender")
    with open(go) as f:
        sent = json.load(f)
    start = time.perf_counter()
    state = transport.recv_checkpoint(
        src_rank=0, metadata=sent["metadata"], step=STEP, timeout=TIMEOUT
    )
    heal = time.perf_counter() - start
    healed = {"heal": heal, "served": _Counted.total, "healed_at": time.time()}
    _write_json(os.path.join(args.work, "healed.json"), healed)
    got = _sums(state)
    if got != sent["sums"]:
        bad = sorted(k for k in sent["sums"] if got.get(k) != sent["sums"][k])
        raise SystemExit(f"{args.case}: healed state differs from the sender's in {bad[:5]}")
    transport.shutdown()
    if args.case == "pg":
        import torch.distributed as dist

        dist.destroy_process_group()


# --- the parent -----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stored(root: str, endpoint: str | None) -> int:
    if endpoint is None:
        return sum(
            os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files
        )
    prefix = root.removeprefix(f"s3://{BUCKET}/")
    pages = boto3_client(endpoint).get_paginator("list_objects_v2")
    return sum(
        o["Size"]
        for p in pages.paginate(Bucket=BUCKET, Prefix=prefix)
        for o in p.get("Contents", [])
    )


def run_case(
    case: str, args: argparse.Namespace, server: SeaweedFS | None, proxy: CappedProxy | None
) -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix=f"heal-{case}-")
    cmd = [sys.executable, os.path.abspath(__file__), "--case", case, "--work", work]
    cmd += ["--size-mb", str(args.size_mb), "--idle-steps", str(args.idle_steps)]
    cmd += ["--port", str(_free_port())]
    endpoint = None
    if case == "ours-local":
        cmd += ["--root", os.path.join(work, "root")]
    elif case.startswith("ours-"):
        assert server is not None
        endpoint = proxy.url if case == "ours-capped" and proxy else server.url
        cmd += ["--root", f"s3://{BUCKET}/{os.path.basename(work)}", "--endpoint", endpoint]
    before = (proxy.bytes_up, proxy.bytes_down) if proxy and case == "ours-capped" else None
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    procs = []
    for role in ("sender", "receiver"):
        spy: list[str] = []
        if args.profile:  # py-spy of every thread, idle ones too: where the seconds go
            out = os.path.join(args.profile, f"{case}-{role}.txt")
            spy = [os.path.join(os.path.dirname(sys.executable), "py-spy"), "record", "--idle"]
            spy += ["--threads", "--format", "raw", "--rate", "50", "--output", out, "--"]
        procs.append(subprocess.Popen(spy + cmd + ["--child", role], env=env))
    try:
        for proc in procs:
            if proc.wait(timeout=TIMEOUT.total_seconds()) != 0:
                raise SystemExit(f"{case}: a child failed (exit {proc.returncode})")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    with open(os.path.join(work, "sender.json")) as f:
        row: dict[str, Any] = json.load(f)
    with open(os.path.join(work, "healed.json")) as f:
        row.update(json.load(f))
    with open(os.path.join(work, "go.json")) as f:
        row["logical"] = json.load(f)["logical"]
    if case == "http":
        row["moved"] = f"{row['served'] / MB:.0f} served"
    elif case == "pg":
        row["moved"] = f"{row['logical'] / MB:.0f} sent"
    else:
        root = cmd[cmd.index("--root") + 1]
        direct = server.url if endpoint and server else None  # listed past the proxy
        stored = _stored(root, direct)
        row["moved"] = f"{stored / MB:.0f} w + {stored / MB:.0f} r"
        if before is not None and proxy is not None:
            up, down = proxy.bytes_up - before[0], proxy.bytes_down - before[1]
            row["moved"] = f"{up / MB:.0f} w + {down / MB:.0f} r"
            assert proxy.bucket is not None
            row["limit"] = (up + down) / proxy.bucket.rate
        elif endpoint and args.ceiling:  # the bucket's own limit here: raw PUT then GET
            row["limit"] = stored / args.ceiling["put"] + stored / args.ceiling["get"]
            row["limit_name"] = "raw PUT+GET"
        if direct:  # the next case starts from an empty bucket
            client = boto3_client(direct)
            prefix = root.removeprefix(f"s3://{BUCKET}/")
            pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
            for page in pages:
                for o in page.get("Contents", []):
                    client.delete_object(Bucket=BUCKET, Key=o["Key"])
    row.setdefault("limit", row["memcpy"])
    row["after_send"] = row["healed_at"] - row["sent_at"]
    shutil.rmtree(work, ignore_errors=True)
    return row


def report(rows: dict[str, dict[str, Any]], proxy: CappedProxy | None) -> None:
    base = rows.get("http")
    logical = next(iter(rows.values()))["logical"]
    print(
        f"\nstate: {logical / MB:.0f} MB of tensors; step {STEP}; one training step = "
        "6 matmuls 512x512 fp32 on 1 thread"
    )
    head = "| transport | heal s | heal vs HTTP | send blocked s | step idle ms | step serving ms "
    head += "| steps lost | lost vs HTTP | heal after send s | MB moved | limit s |"
    print(head)
    print("|---" * 11 + "|")
    for name, r in rows.items():
        idle = statistics.median(r["idle"])
        serving = f"{statistics.mean(r['serving']) * 1e3:.1f}" if r["serving"] else "-"
        lost = r["window"] / idle - len(r["serving"])
        r["lost"], r["idle_ms"] = lost, idle * 1e3
        heal_ratio = f"{r['heal'] / base['heal']:.2f}x" if base else "-"
        lost_ratio = f"{lost / base['lost']:.2f}x" if base and base.get("lost", 0) > 0 else "-"
        limit = r.get("limit_name", "cap" if proxy and name == "ours-capped" else "memcpy")
        print(
            f"| {name} | {r['heal']:.2f} | {heal_ratio} | {r['blocked']:.2f} | {idle * 1e3:.1f} "
            f"| {serving} | {lost:.1f} | {lost_ratio} | {r['after_send']:.2f} | {r['moved']} "
            f"| {r['limit']:.2f} ({limit}) |"
        )
    if base is None:
        return
    base_serving = statistics.mean(base["serving"]) if base["serving"] else float("nan")
    for name in ("ours-local", "ours-seaweedfs", "ours-capped"):
        if name in rows and rows[name]["serving"]:
            s = statistics.mean(rows[name]["serving"])
            verdict = "met" if s <= base_serving else "NOT met"
            print(
                f"goal: {name} step while serving {s * 1e3:.1f} ms <= HTTP's "
                f"{base_serving * 1e3:.1f} ms: {verdict}"
            )
    if "ours-seaweedfs" in rows:
        h = rows["ours-seaweedfs"]["heal"]
        verdict = "met" if h <= base["heal"] else "NOT met"
        print(
            f"goal: heal from a loopback bucket {h:.2f} s <= HTTP's {base['heal']:.2f} s: {verdict}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=512)
    parser.add_argument("--idle-steps", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=1, help="runs per transport (median)")
    parser.add_argument("--cases", nargs="+", default=CASES, choices=CASES)
    parser.add_argument("--rate", type=float, default=100e6, help="proxy cap, bytes/s in all")
    parser.add_argument("--latency", type=float, default=0.005, help="proxy delay per request, s")
    parser.add_argument("--profile", help="py-spy both processes, raw stacks into this dir")
    parser.add_argument("--child", choices=["sender", "receiver"])
    parser.add_argument("--case", choices=CASES)
    parser.add_argument("--work")
    parser.add_argument("--root")
    parser.add_argument("--endpoint")
    parser.add_argument("--port", type=int)
    args = parser.parse_args()
    if args.child:
        (sender if args.child == "sender" else receiver)(args)
        return
    rows: dict[str, dict[str, Any]] = {}
    need_s3 = any(c.startswith("ours-") and c != "ours-local" for c in args.cases)
    server = SeaweedFS(bucket=BUCKET).start() if need_s3 else None
    proxy = None
    try:
        if server is not None:  # the first write to a bucket grows its volumes: not timed
            boto3_client(server.url).put_object(Bucket=BUCKET, Key="warm-up", Body=bytes(1 << 20))
        args.ceiling = None
        if server is not None and "ours-seaweedfs" in args.cases:
            raw = raw_ceiling(server.url)
            args.ceiling = {"put": raw["bytes"] / raw["save"], "get": raw["bytes"] / raw["load"]}
            print(
                f"raw SeaweedFS ceiling (boto3, 8 x 32 MiB in 8 threads): PUT "
                f"{args.ceiling['put'] / MB:.0f} MB/s, GET {args.ceiling['get'] / MB:.0f} MB/s",
                flush=True,
            )
        if server is not None and "ours-capped" in args.cases:
            proxy = CappedProxy(server.url, rate=args.rate, latency=args.latency)
        runs: dict[str, list[dict[str, Any]]] = {case: [] for case in args.cases}
        for _ in range(args.repeat):
            for case in args.cases:
                t0 = time.perf_counter()
                runs[case].append(run_case(case, args, server, proxy))
                print(
                    f"  {case}: heal {runs[case][-1]['heal']:.2f} s "
                    f"(case {time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
        for case, samples in runs.items():  # the run with the median heal time
            rows[case] = sorted(samples, key=lambda r: r["heal"])[len(samples) // 2]
    finally:
        if proxy is not None:
            proxy.close()
        if server is not None:
            server.stop()
    report(rows, proxy)


if __name__ == "__main__":
    main()
