"""A tiny training job for the preemption and node-loss tests, run as subprocesses.

    python -m tests.support.preempt_job --root URL --local DIR --steps N [--ranks-per-node R] ...

One rank per process (``RANK``/``WORLD_SIZE``/``STORE`` in the environment; gloo and
DDP when ``WORLD_SIZE`` > 1). A seeded MLP with AdamW trains on batches seeded by the
step and rank, so a job resumed from step S reaches every later step with the same bits
as one that never stopped. Each rank's node-local tier is ``DIR/node{rank // R}``.

On start it loads the newest committed step, if any, from the nearest tier. Then it
trains up to step N, saving every ``--save-every`` steps (``--async``: ``blocking=False``)
and, with ``--guard``, stopping at the first step boundary after SIGTERM with a
preemption save (and exiting with its drain in flight). A run that reaches step N waits
for its drains. Rank 0 prints ``@`` lines on stdout (flushed at once) that the tests
parse: ``@loaded STEP TIER HASH RESTORED_BYTES``, ``@step STEP HASH``, ``@committed
STEP``, ``@preempted STEP SAVED``, ``@durable STEPS``; other ranks print
``@preempted`` and ``@restored`` lines too.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

from storage.ops.manager import CheckpointManager

WIDTH = 256


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """A hash of every bit of the model's and the optimizer's state."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.numpy().tobytes())
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            h.update(f"{index}.{key}".encode())
            h.update(value.numpy().tobytes() if isinstance(value, torch.Tensor) else b"%r" % value)
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--endpoint", help="S3 endpoint for an s3:// root")
    parser.add_argument("--local", required=True)
    parser.add_argument("--ranks-per-node", type=int, default=1)
    parser.add_argument("--replicate", action="store_true")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--async", dest="asynchronous", action="store_true")
    parser.add_argument("--guard", action="store_true")
    parser.add_argument("--grace", type=float, default=20.0)
    parser.add_argument("--pace", type=float, default=0.05, help="seconds of sleep per step")
    args = parser.parse_args()

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    if world > 1:
        store = os.environ["STORE"]
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)

    def say(*words: object, every_rank: bool = False) -> None:
        if rank == 0 or every_rank:
            print(*words, flush=True)

    model, optimizer = build()
    net: nn.Module = DistributedDataParallel(model) if world > 1 else model
    options: dict[str, Any] = {}
    if args.endpoint:
        options["storage_options"] = {
            "endpoint_url": args.endpoint,
            "key": "testing",
            "secret": "testing",
        }
    mgr = CheckpointManager(
        args.root,
        local=f"{args.local}/node{rank // args.ranks_per_node}",
        replicate=args.replicate,
        **options,
    )
    assert mgr.tiers is not None

    def state() -> dict[str, Any]:
        model_state, optim_state = get_state_dict(net, optimizer)
        return {"model": model_state, "optim": optim_state}

    start = 0
    held = torch.tensor([mgr.latest() is not None], dtype=torch.int32)
    if world > 1:  # a rank whose node lost its tier may see nothing: load if any rank does
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
    if held.item():  # state() before a first step would initialize AdamW's state: only now
        target = state()
        start = mgr.load(target)
        set_state_dict(
            net, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"]
        )
        tier = getattr(start, "tier", "?")
        say("@loaded", int(start), tier, digest(model, optimizer), mgr.tiers.restored_bytes)
        say("@restored", rank, mgr.tiers.restored_bytes, every_rank=True)
    guard = mgr.save_on_signal(state, grace=args.grace) if args.guard else None

    for step in range(int(start) + 1, args.steps + 1):
        batch = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(16, WIDTH, generator=batch)
        loss = F.mse_loss(net(x), torch.roll(x, 1, dims=1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        say("@step", step, digest(model, optimizer))
        time.sleep(args.pace)
        if args.save_every and step % args.save_every == 0:
            mgr.save(step, state(), blocking=not args.asynchronous)
            if not args.asynchronous:
                say("@committed", step)
        if guard is not None and guard.should_stop(step):
            say("@preempted", step, guard.saved, every_rank=True)
            # Exit with the drain in flight (the interpreter waits for it until the kill):
            # tearing the process group down now would pull it from under the drain.
            return
    mgr.wait()
    say("@durable", ",".join(map(str, mgr.durable_steps())))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
        # Exit at once, as tests.support.distributed.gloo_group does: in the
        # interpreter's own teardown, objects still holding the groups (the manager's
        # own gloo group for asynchronous saves) destroy gloo's threads in no particular
        # order, which now and then aborts the process ("terminate called without an
        # active exception") after everything it was to do is done.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
