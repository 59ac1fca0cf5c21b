"""Checkpointing inside a training loop: what each checkpoint costs a running job.

    python benchmarks/training_loop.py                      # 1 rank, every 10 and 50 steps
    python benchmarks/training_loop.py --ranks 2 --capped   # 2 gloo ranks, capped bucket
    python benchmarks/training_loop.py --quick              # smoke run: small model, seconds
    python benchmarks/training_loop.py --interval 10 --variants "ours async" "stock async"

A deterministic CPU training loop (a small transformer language model with AdamW, seeded
weights and batches; the state dict, model and optimizer, is 277 MB) runs ``--steps`` steps
and checkpoints every ``--interval`` steps (at steps N, 2N, ... below the last) to SeaweedFS
(``weed mini`` on this machine), once per variant of ``benchmarks/loop_variants.py``, each
in fresh processes: ``--ranks`` gloo ranks with DDP, the global batch split between them,
``--threads`` torch threads per rank (1 by default: one rank leaves a core to the server
and to the checkpoint's background work, as a GPU job's Python thread leaves the host's
other cores; two ranks take both). With ``--capped`` the job reaches the bucket through
:class:`tests.support.capped_proxy.CappedProxy` (``--rate`` bytes per second for both directions
together, ``--latency`` per request): the regime of a bucket that many ranks share.

Per variant and interval: the training wall time of the whole run against the same loop
without checkpoints (slowdown %), the stall per checkpoint (time the training thread spends
in the variant's ``save``, state dict building included: median and max, the max over
ranks), the step time (median, p99), the time from the start of a save until its
``.metadata`` object exists in the bucket (durable: watched by this process with HEAD
requests to the server every 50 ms, the proxy bypassed), and from the first step until
the last checkpoint is durable the CPU (user + sys, from /proc) of the job (every rank's
process and its children: torch's checkpoint process) and of the server (``weed``, also as
a share of one core). The "floor" row copies the state's tensors into staging
buffers allocated once and does nothing else. Before the runs, a raw
ceiling: 8 objects x 16 MiB PUT then GET with boto3 in 8 threads through the same endpoint,
with the proxy's own CPU. ``--rounds R`` repeats every variant R times, the order rotating,
and reports medians. ``--profile DIR`` runs rank 0 under ``py-spy record --gil`` (the
stacks of whichever thread holds the GIL, 100 samples a second; raw folded stacks).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.loop_variants import DEFAULT, VARIANTS, WRITES_NOTHING, Context  # noqa: E402
from benchmarks.s3_peers import raw_ceiling  # noqa: E402
from tests.support.capped_proxy import CappedProxy  # noqa: E402
from tests.support.servers import SeaweedFS, boto3_client  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
BUCKET = "bench"
WARMUP_STEPS = 3
# (vocabulary, width, layers, global batch, sequence): 23.1M parameters, 277 MB of state
# dict with AdamW's two moments; a step takes ~0.5 s on one thread of this machine.
SIZES = {"full": (4096, 512, 6, 4, 64), "quick": (1024, 128, 2, 4, 32)}


# --- the job ---------------------------------------------------------------------------


class TinyLM(nn.Module):
    """A small decoder-style transformer language model."""

    def __init__(self, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        block = nn.TransformerEncoderLayer(
            width, nhead=8, dim_feedforward=4 * width, dropout=0.0, batch_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.blocks(self.embed(tokens), mask=mask, is_causal=True))


def child(args: argparse.Namespace) -> None:
    """One rank of one variant's run; rank 0 reports events on stdout as ``@event``
    lines (monotonic times, comparable across processes), every rank its result."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.nn.parallel import DistributedDataParallel

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    vocab, width, layers, batch, seq = SIZES[args.size]
    torch.manual_seed(0)
    model = TinyLM(vocab, width, layers)
    net: nn.Module = DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = torch.Generator().manual_seed(1000 + rank)

    def train_step() -> None:
        tokens = torch.randint(vocab, (batch // world, seq + 1), generator=batches)
        logits = net(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def state() -> dict[str, Any]:
        model_state, optim_state = get_state_dict(net, optimizer)
        return {"model": model_state, "optim": optim_state}

    def emit(event: str, *values: object) -> None:
        if rank == 0:
            print(f"@{event}", *values, flush=True)

    for _ in range(WARMUP_STEPS):  # AdamW allocates its moments on the first step
        train_step()
    group = dist.new_group(backend="gloo")
    ctx = Context(args.child_endpoint, args.child_root, args.child_local, rank, world, state, group)
    variant = VARIANTS[args.child](ctx)
    steps, stalls, starts = [], {}, {}
    dist.barrier()
    begin = time.monotonic()
    emit("start", begin)
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        train_step()
        steps.append(time.perf_counter() - t0)
        if step % args.interval[0] == 0 and step < args.steps:
            starts[step] = time.monotonic()
            emit("save", step, starts[step])
            t0 = time.perf_counter()
            variant.save(step, state)
            stalls[step] = time.perf_counter() - t0
    wall = time.monotonic() - begin
    variant.finish()
    emit("finished", time.monotonic())
    tensors = [t for t in _leaves(state()) if isinstance(t, torch.Tensor)]
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    result = {"rank": rank, "wall": wall, "steps": steps, "stalls": stalls, "starts": starts}
    result["state_bytes"] = state_bytes
    result["cold_copy"] = getattr(variant, "cold_copy", None)
    print("@result", json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in _leaves(value)]
    if isinstance(tree, list | tuple):
        return [leaf for value in tree for leaf in _leaves(value)]
    return [tree]


# --- watching the bucket and the server ---------------------------------------------------


class Watcher(threading.Thread):
    """Polls the server (not through the proxy) for ``root/step-N/.metadata`` of each
    step announced by :meth:`expect`; ``seen`` maps a step to the monotonic time found."""

    def __init__(self, server_url: str, prefix: str, period: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.client, self.prefix, self.period = boto3_client(server_url), prefix, period
        self.wanted: set[int] = set()
        self.seen: dict[int, float] = {}
        self.lock, self.stopped = threading.Lock(), threading.Event()

    def expect(self, step: int) -> None:
        with self.lock:
            self.wanted.add(step)

    def missing(self) -> set[int]:
        with self.lock:
            return self.wanted - set(self.seen)

    def run(self) -> None:
        while not self.stopped.wait(self.period):
            self.poll()

    def poll(self) -> None:
        for step in sorted(self.missing()):
            key = f"{self.prefix}/step-{step}/.metadata"
            try:
                self.client.head_object(Bucket=BUCKET, Key=key)
            except self.client.exceptions.ClientError:
                continue
            with self.lock:
                self.seen[step] = time.monotonic()


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and its live descendants (torch's checkpoint process)."""
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            total += process_cpu(current)
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    todo += [int(child) for child in f.read().split()]
        except OSError:
            continue  # it ended meanwhile
    return total


# --- one variant's run -------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Bench:
    """The server, the optional proxy and the options every run shares."""

    def __init__(
        self, args: argparse.Namespace, server: SeaweedFS, proxy: CappedProxy | None
    ) -> None:
        self.args, self.server, self.proxy = args, server, proxy
        self.endpoint = proxy.url if proxy is not None else server.url
        self.run_id = uuid.uuid4().hex[:8]
        self.work = tempfile.mkdtemp(prefix="dcp-loop-")

    def proxy_cpu(self) -> float:
        return self.proxy.cpu_seconds() if self.proxy is not None else 0.0

    def run(self, name: str, interval: int, steps: int, round_: int) -> dict[str, Any]:
        """Run variant ``name`` once; its raw figures."""
        assert self.server.proc is not None
        weed = self.server.proc.pid
        prefix = f"{self.run_id}/{name.replace(' ', '-')}-n{interval}-r{round_}"
        local = tempfile.mkdtemp(prefix="local-", dir=self.work)
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        # As torchrun launches them: every rank on this host.
        env["WORLD_SIZE"] = env["LOCAL_WORLD_SIZE"] = str(self.args.ranks)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--size", self.args.size]
        cmd += ["--threads", str(self.args.threads)]
        cmd += ["--interval", str(interval), "--steps", str(steps)]
        cmd += ["--child-endpoint", self.endpoint, "--child-root", f"s3://{BUCKET}/{prefix}"]
        cmd += ["--child-local", local]
        procs = []
        for rank in range(self.args.ranks):
            profile = []
            if self.args.profile and rank == 0:  # which thread holds the GIL, 100 times a second
                out = os.path.join(self.args.profile, f"{prefix.split('/')[-1]}.txt")
                spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
                profile = [spy, "record", "--gil", "--threads", "--subprocesses"]
                profile += ["--format", "raw", "--rate", "100", "--output", out, "--"]
            procs.append(
                subprocess.Popen(
                    profile + cmd,
                    env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                    stdout=subprocess.PIPE,
                    stderr=open(os.path.join(self.work, f"{rank}.err"), "w"),  # noqa: SIM115
                    text=True,
                )
            )
        watcher = Watcher(self.server.url, prefix)
        watcher.start()
        cpu: dict[str, float] = {}
        results: list[dict[str, Any]] = []
        assert procs[0].stdout is not None
        for line in procs[0].stdout:
            event, _, rest = line.strip().partition(" ")
            if event == "@start":
                cpu.update(weed=process_cpu(weed), proxy=self.proxy_cpu(), at=time.monotonic())
                cpu["job"] = sum(tree_cpu(p.pid) for p in procs)
            elif event == "@save":
                watcher.expect(int(rest.split()[0]))
            elif event == "@finished":
                watcher.poll()  # every checkpoint is committed once finish() returned
                cpu["job"] = sum(tree_cpu(p.pid) for p in procs) - cpu["job"]
                cpu["weed"] = process_cpu(weed) - cpu["weed"]
                cpu["proxy"] = self.proxy_cpu() - cpu["proxy"]
                cpu["at"] = time.monotonic() - cpu["at"]
            elif event == "@result":
                results.append(json.loads(rest))
        for proc in procs[1:]:
            out, _ = proc.communicate()
            results += [json.loads(x[8:]) for x in out.splitlines() if x.startswith("@result ")]
        codes = [proc.wait() for proc in procs]
        watcher.stopped.set()
        if any(codes) or len(results) != len(procs):
            with open(os.path.join(self.work, "0.err")) as f:
                raise RuntimeError(f"{name} failed (exit codes {codes}):\n{f.read()[-4000:]}")
        if name not in WRITES_NOTHING and watcher.missing():
            raise RuntimeError(f"{name}: steps {sorted(watcher.missing())} never committed")
        return summarize(results, watcher.seen, cpu)


def summarize(
    results: list[dict[str, Any]], seen: dict[int, float], cpu: dict[str, float]
) -> dict[str, Any]:
    """One run's figures: the slowest rank's wall and stall per checkpoint, rank 0's steps."""
    first = min(results, key=lambda r: r["rank"])
    checkpoints = sorted(first["stalls"], key=int)
    stalls = [max(r["stalls"][s] for r in results) for s in checkpoints]
    durable = [seen[int(s)] - first["starts"][s] for s in checkpoints if int(s) in seen]
    steps = sorted(first["steps"])
    return {
        "wall": max(r["wall"] for r in results),
        "step_times": first["steps"],
        "checkpoint_steps": [int(s) for s in checkpoints],
        "state_bytes": first["state_bytes"],
        "cold_copy": max((r["cold_copy"] or 0.0) for r in results) or None,
        "stalls": stalls,
        "durable": durable,
        "step_p50": statistics.median(steps),
        "step_p99": statistics.quantiles(steps, n=100, method="inclusive")[98],
        "job_cpu": cpu["job"],
        "server_cpu": cpu["weed"],
        "proxy_cpu": cpu["proxy"],
        "window": cpu["at"],
    }


# --- the table ---------------------------------------------------------------------------


def report(
    samples: dict[str, list[dict[str, Any]]], interval: int, steps: int, capped: bool
) -> None:
    """The table for one interval: medians over the rounds (stalls and durable times over
    every checkpoint of every round); slowdown against the same round's baseline."""
    base = samples["none"]
    step_s = statistics.median(r["step_p50"] for r in base)
    count = len(base[0]["stalls"]) if base else 0
    print(
        f"\ncheckpoint every {interval} steps = {interval * step_s:.1f} s "
        f"(step median {1000 * step_s:.0f} ms without checkpoints); {steps} steps, "
        f"{count} checkpoints per run, {len(base)} round(s)"
    )
    proxy = " proxy CPU s |" if capped else ""
    print(
        "| variant | slowdown % | stall median ms | stall max ms | step p50 ms | step p99 ms "
        f"| durable median s | durable max s | job CPU s | job CPU s per checkpointed GB "
        f"| server CPU s (share of a core) |{proxy}"
    )
    print("|---" * (11 + capped) + "|")
    base_cpu = statistics.median(r["job_cpu"] for r in base)
    for name, runs in samples.items():
        slow = statistics.median(100 * (r["wall"] / b["wall"] - 1) for r, b in zip(runs, base))
        stalls = [s for r in runs for s in r["stalls"]]
        durable = [d for r in runs for d in r["durable"]]
        cpu = statistics.median(r["server_cpu"] for r in runs)
        share = statistics.median(r["server_cpu"] / r["window"] for r in runs)
        cells = [
            name,
            f"{slow:.1f}" if name != "none" else "0",
            f"{1000 * statistics.median(stalls):.0f}" if stalls else "-",
            f"{1000 * max(stalls):.0f}" if stalls else "-",
            f"{1000 * statistics.median(r['step_p50'] for r in runs):.0f}",
            f"{1000 * statistics.median(r['step_p99'] for r in runs):.0f}",
            f"{statistics.median(durable):.2f}" if durable else "-",
            f"{max(durable):.2f}" if durable else "-",
            f"{statistics.median(r['job_cpu'] for r in runs):.1f}",
            cpu_per_gb(runs, base_cpu),
            f"{cpu:.1f} ({100 * share:.0f}%)",
        ]
        if capped:
            cells.append(f"{statistics.median(r['proxy_cpu'] for r in runs):.2f}")
        print("| " + " | ".join(cells) + " |")
    print("raw samples:", json.dumps(samples))


def checkpoint_cpu(runs: list[dict[str, Any]], base_cpu: float) -> float | None:
    """The job's CPU seconds per checkpointed GB: the variant's job CPU over the run
    without checkpoints, per GB of state saved (None for a run that saves nothing)."""
    saved = statistics.median(len(r["stalls"]) * r["state_bytes"] for r in runs) / 1e9
    if saved <= 0:
        return None
    return (statistics.median(r["job_cpu"] for r in runs) - base_cpu) / saved


def cpu_per_gb(runs: list[dict[str, Any]], base_cpu: float) -> str:
    value = checkpoint_cpu(runs, base_cpu)
    return "-" if value is None else f"{value:.2f}"


def plot_steps(runs: dict[str, dict[str, Any]], title: str, path: str) -> None:
    """One run per variant: each step's time, the steps that checkpointed marked
    (matplotlib, from the bench extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, run in runs.items():
        # A checkpoint step's time includes its stall: the time the loop spent in save.
        times = [1000 * t for t in run["step_times"]]
        marked = [s for s in run["checkpoint_steps"] if s <= len(times)]
        for s, stall in zip(marked, run["stalls"]):
            times[s - 1] += 1000 * stall
        (line,) = ax.plot(range(1, len(times) + 1), times, label=name, linewidth=1.2)
        ax.scatter(marked, [times[s - 1] for s in marked], color=line.get_color(), s=14)
    ax.set_xlabel("training step (dots: steps that took a checkpoint, stall included)")
    ax.set_ylabel("step time, ms")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ceiling(bench: Bench) -> None:
    """Raw boto3 PUT then GET through the job's endpoint, and the proxy's CPU meanwhile."""
    before = bench.proxy_cpu()
    raw = raw_ceiling(bench.endpoint, objects=8, size=16 << 20)
    mb = raw["bytes"] / 1e6
    print(
        f"raw ceiling through {'the capped proxy' if bench.proxy else 'no proxy'}: PUT "
        f"{mb / raw['save']:.0f} MB/s, GET {mb / raw['load']:.0f} MB/s ({mb:.0f} MB each, 8 "
        f"threads); proxy CPU {bench.proxy_cpu() - before:.2f} s for {2 * mb:.0f} MB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--steps", type=int, help="steps per run (default: max(40, 2 x interval))")
    parser.add_argument("--ranks", type=int, choices=(1, 2), default=1)
    parser.add_argument("--capped", action="store_true", help="reach the bucket through the proxy")
    parser.add_argument("--rate", type=float, default=100e6, help="proxy cap, bytes/s in all")
    parser.add_argument("--latency", type=float, default=0.005, help="proxy delay per request, s")
    parser.add_argument("--variants", nargs="+", default=DEFAULT, choices=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="small model, 15 steps, every 5")
    parser.add_argument("--size", choices=list(SIZES), default="full")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--profile", metavar="DIR", help="py-spy record --gil rank 0 into DIR")
    parser.add_argument("--plot", metavar="PNG", help="draw the step times of the last round")
    for hidden in ("--child", "--child-endpoint", "--child-root", "--child-local"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.quick:
        args.size, args.interval, args.steps = "quick", [5], args.steps or 15
    names = ["none"] + [n for n in args.variants if n != "none"]
    with SeaweedFS(bucket=BUCKET) as server:
        proxy = (
            CappedProxy(server.url, rate=args.rate, latency=args.latency) if args.capped else None
        )
        bench = Bench(args, server, proxy)
        try:
            ceiling(bench)
            for interval in args.interval:
                steps = args.steps or max(40, 2 * interval)
                samples: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
                for round_ in range(args.rounds):
                    shift = round_ % len(names)
                    for name in names[shift:] + names[:shift]:
                        samples[name].append(bench.run(name, interval, steps, round_))
                        print(f"  {name}: {samples[name][-1]['wall']:.1f} s", flush=True)
                report(samples, interval, steps, proxy is not None)
                if args.plot:
                    last = {n: runs[-1] for n, runs in samples.items()}
                    title = f"{args.ranks} rank(s), a checkpoint every {interval} steps"
                    stem, ext = os.path.splitext(args.plot)
                    plot_steps(last, title, f"{stem}-every{interval}{ext or '.png'}")
        finally:
            if proxy is not None:
                proxy.close()
            shutil.rmtree(bench.work, ignore_errors=True)


if __name__ == "__main__":
    main()
