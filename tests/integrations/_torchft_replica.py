"""One torchft replica group (one worker) for tests/integrations/test_integration_torchft.py.

``python _torchft_replica.py JOB`` (JOB: JSON with lighthouse, replica_id, seed, root,
steps, out, and optionally park_at) trains a small model with torchft's Manager, its
DDP wrapper and a gloo process group, healing through StorageCheckpointTransport. With
``park_at`` it writes ``out`` + ".parked" after committing that step and waits there to
be killed; otherwise it trains to ``steps`` and saves its final state to ``out``. It
exits by itself after ``deadline`` seconds whatever happens.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from datetime import timedelta
from typing import Any


def _stop_with_parent(deadline: float) -> None:
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    timer = threading.Timer(deadline, os._exit, args=(3,))
    timer.daemon = True
    timer.start()


def main(job: dict[str, Any]) -> None:
    _stop_with_parent(job["deadline"])
    import torch
    import torch.distributed as dist
    from torchft import Manager
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    from extensions import ZStandard
    from storage.integrations.torchft import StorageCheckpointTransport

    torch.manual_seed(job["seed"])  # the groups start apart: healing must align them
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    transport = StorageCheckpointTransport(
        job["root"],
        replica_id=job["replica_id"],
        transforms=[ZStandard(level=1)],
        storage_options=job.get("storage_options"),
    )
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=60)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=2,
        use_async_quorum=False,
        timeout=timedelta(seconds=60),
        quorum_timeout=timedelta(seconds=job["deadline"]),
        connect_timeout=timedelta(seconds=60),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=job["lighthouse"],
        replica_id=job["replica_id"],
        hostname="127.0.0.1",
        checkpoint_transport=transport,
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = OptimizerWrapper(manager, inner)
    healed_at = None
    while manager.current_step() < job["steps"]:
        step = manager.current_step()
        optimizer.zero_grad()  # the quorum: heals here when behind
        if healed_at is None:
            healed_at = manager.current_step()
        # Each group its own batch, the same for a step whoever computes it.
        gen = torch.Generator().manual_seed(1000 * manager.current_step() + job["batch"])
        inputs, labels = torch.randn(16, 8, generator=gen), torch.randint(4, (16,), generator=gen)
        torch.nn.functional.cross_entropy(ddp(inputs), labels).backward()
        optimizer.step()  # commits when every group did the step
        if job.get("park_at") is not None and manager.current_step() >= job["park_at"] > step:
            with open(job["out"] + ".parked", "w") as f:
                f.write(str(manager.current_step()))
            threading.Event().wait(job["deadline"])  # until killed
    final = {"step": manager.current_step(), "healed_at": healed_at, **state_dict()}
    torch.save(final, job["out"] + ".tmp")
    os.replace(job["out"] + ".tmp", job["out"])
    manager.shutdown(wait=False)
    os._exit(0)  # torchft's threads and servers need not be joined


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
